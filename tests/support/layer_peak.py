"""The measured peak memory of one native layer's forward + backward on the CPU, tiled or not
(engine.seq_tile), against the plan's layer working set (planning.memory.layer_work_bytes).

    python -m tests.support.layer_peak '{"hidden": 128, "intermediate": 2048, "tokens": 2048,
        "tiles": [0, 512], "heads": 2, "kv_heads": 1}'

    python -m tests.support.layer_peak '{"store": STORE, "tokens": 4096, "tile": 1024}'

prints one JSON object: per tile the measured peak, the plan's working set, the weight gradients'
bytes (a plan row of their own: the gradient accumulators) and the seconds it took. What the
engine does per layer: a forward without autograd, then the recompute under autograd and
`autograd.grad` seeded with the output gradient. The weights, the input and the output gradient
exist before the measurement starts (the plan's weight buffers and boundary activations).

How: in a process of its own, glibc's malloc is told to serve every block over 64 KiB by mmap and
to return freed memory at once (so the resident set follows the live tensors; its default adapts
the threshold and keeps freed blocks), the kernel's peak resident set (VmHWM) is reset
(/proc/self/clear_refs) before each measurement, and the peak less the resident set at the start
is what one layer's forward + backward needed. Each path runs once first (thread pools, kernel
scratch space: one-time allocations that are no working set).

With a "store" (a one-layer model, any family): one engine step on one row of `tokens` instead
(engine_peak: a warm-up step, then the measured one), so transformers' own layers are measured as
the engine runs them; the step's embedding and chunked loss are in the figure (small for a small
vocabulary), the layer's weight gradients reported beside it.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
import time

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def _quiet_malloc() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 65536)
    libc.mallopt(M_TRIM_THRESHOLD, 0)


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set
    return _status("VmRSS")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"{key}:\s+(\d+) kB", f.read())
    assert m is not None, key
    return int(m.group(1)) * 1024


def measure(
    hidden: int, intermediate: int, tokens: int, tiles: list[int], heads: int = 2, kv_heads: int = 1,
    warm_tokens: int = 0, docs: int = 0,
) -> dict:  # fmt: skip
    """warm_tokens: the length of the first run of each path (0: `tokens`); docs: the row packs
    that many documents of equal length (model.masks: untiled a dense (T, T) mask, tiled its rule)."""
    from horizon_cli.arch import spec_from_hf
    from horizon_cli.data.batch import MicroBatch
    from horizon_cli.model.call import LayerCall
    from horizon_cli.model.layer import AttnContext, inv_freq, layer_forward, rope_tables
    from horizon_cli.model.masks import attn_context
    from horizon_cli.planning.memory import layer_work_bytes

    _quiet_malloc()
    torch.set_num_threads(1)
    hf = dict(model_type="llama", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
              num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=64,
              max_position_embeddings=max(tokens, 2048))  # fmt: skip
    spec = spec_from_hf(hf)
    H, inter, q, kv = spec.hidden, spec.intermediate, spec.q_dim, spec.kv_dim
    g = torch.Generator().manual_seed(0)
    shapes = dict(wq=(q, H), wk=(kv, H), wv=(kv, H), wo=(H, q), w_gate=(inter, H), w_up=(inter, H), w_down=(H, inter),
                  attn_norm=(H,), mlp_norm=(H,))  # fmt: skip
    w = {k: (torch.randn(s, generator=g) * 0.02).requires_grad_(True) for k, s in shapes.items()}
    leaves = list(w.values())

    inv = inv_freq(spec)

    def inputs(n: int):
        cos, sin = rope_tables(inv, torch.arange(n)[None], torch.float32)
        return torch.randn(1, n, H, generator=g), torch.randn(1, n, H, generator=g), AttnContext(cos, sin, {})

    def step(tile: int, x, dy, ctx) -> None:
        n = x.shape[1]
        if docs:  # the masks model.masks builds for this row (inside the measurement)
            doc = (torch.arange(n) * docs // n)[None].to(torch.int32)
            ids = torch.zeros(1, n, dtype=torch.long)
            mb = MicroBatch(ids, ids, torch.arange(n)[None], doc, None)
            ctx.masks = attn_context(mb, spec, inv, torch.float32, "cpu", False, rows=tile > 0).masks
        else:
            ctx.masks = {None: None}
        with torch.no_grad():
            y = layer_forward(w, x, ctx, spec, None, LayerCall(tile=tile))
        del y
        xi = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = layer_forward(w, xi, ctx, spec, None, LayerCall(tile=tile))
            grads = torch.autograd.grad([y], [xi, *leaves], [dy])
        del y, grads, xi
        ctx.masks = {}

    small = inputs(warm_tokens) if warm_tokens else None
    big = inputs(tokens)
    for t in sorted({0, *[t for t in tiles if t]}, reverse=True)[:2]:  # one-time allocations of each path
        step(min(t, warm_tokens // 2) if small and t else t, *(small or big))
    out = []
    for tile in tiles:
        base, t0 = _reset_peak(), time.perf_counter()
        step(tile, *big)
        out.append({
            "tile": tile,
            "peak_bytes": _status("VmHWM") - base,
            "plan_bytes": layer_work_bytes(spec, tokens, 1, tokens, 4, tile),
            "seconds": time.perf_counter() - t0,
        })  # fmt: skip
    grads = sum(p.numel() for p in leaves) * 4
    return {
        "hidden": H,
        "intermediate": inter,
        "tokens": tokens,
        "docs": docs,
        "weight_grad_bytes": grads,
        "runs": out,
    }


def engine_peak(store: str, tokens: int, tile: int) -> dict:
    """One engine step of a one-layer store's model on one row of `tokens`, measured (module doc)."""
    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.data.batch import MicroBatch
    from horizon_cli.engine import Engine
    from horizon_cli.planning.memory import layer_work_bytes
    from horizon_cli.store import Store

    _quiet_malloc()
    torch.set_num_threads(1)
    st = Store.open(store)
    ids = torch.randint(3, st.arch.vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    mb = MicroBatch(ids, ids.clone(), torch.arange(tokens)[None].clone())
    ecfg = EngineConfig(device="cpu", dtype="float32", seq_tile=tile, keep_activations=0, compute_threads=1)
    eng = Engine(st, ecfg, OptimConfig(kernel="torch"))
    try:
        eng.step([mb], 1e-5)  # the warm-up: optimizer state, saved-input buffers, thread pools
        eng.wait()
        base, t0 = _reset_peak(), time.perf_counter()
        eng.step([mb], 1e-5)
        eng.wait()
        peak, secs = _status("VmHWM") - base, time.perf_counter() - t0
        grads = 4 * sum(p.numel for lay in eng.host.units.values() if lay.layout.name.startswith("layer.")
                        for p in lay.layout.tensors if p.trainable)  # fmt: skip
    finally:
        eng.close()
    plan = layer_work_bytes(st.arch, tokens, 1, tokens, 4, tile)
    return {"tile": tile, "peak_bytes": peak, "plan_bytes": plan, "weight_grad_bytes": grads, "seconds": secs}


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    print(json.dumps(engine_peak(**job) if "store" in job else measure(**job)))
