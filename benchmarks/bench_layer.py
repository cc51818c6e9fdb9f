"""One decoder layer, horizon's functional layer against transformers' own, phase by phase.

    .venv/bin/python benchmarks/bench_layer.py [--sizes 30m,120m] [--dtypes bfloat16,float32]
        [--batch 4] [--seq 256] [--kv-heads N] [--repeat 30] [--json FILE]

The same weights (a random `LlamaDecoderLayer`, seed 0) and the same input, at the shapes of
`make bench` (benchmarks/common.py). Phases, each timed alone (best of --repeat, interleaved
between the implementations, so a busy neighbour on a shared machine hits both alike):

  fwd          the forward without autograd (horizon's forward pass, HF's checkpointed forward)
  fwd+bwd      the forward under autograd and its backward to the input and every weight
               (horizon's backward: recompute + backward; HF's with gradient checkpointing)
  attn, mlp    the same fwd+bwd, for the attention half (norm, q/k/v, RoPE, SDPA, o) and the
               MLP half (norm, SwiGLU) alone
  rope, norm   forward of RoPE on q and k (both the query's shape here), and of one RMSNorm

With --kv-heads below the head count (grouped-query attention) "horizon-expand" is horizon's layer
with K/V expanded to every query head by copying before SDPA, as it was before engine/attend.py.

HF runs as `make bench` runs it: fp32 weights, in bf16 under CPU autocast ("hf"), and also with
its weights cast to bf16 ("hf-pure", the same arithmetic dtype as horizon's bf16 layer).

--clock cpu (the default) times each call by the CPU time of the calling thread, with one compute
thread: on a machine shared with other work, wall time measures the neighbours as much as the
layer, while one thread's CPU time barely moves between runs. --clock wall --threads 2 times what
a user sees on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from common import SHAPES, llama_config

from horizon_cli.arch import spec_from_hf
from horizon_cli.data.batch import MicroBatch
from horizon_cli.model.layer import apply_rope, attention, inv_freq, layer_forward, mlp, rms_norm
from horizon_cli.model.masks import attn_context

DT = {"bfloat16": torch.bfloat16, "float32": torch.float32}
NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


CLOCK = {"cpu": time.thread_time, "wall": time.perf_counter}


def timed(fn, clock) -> float:
    t = clock()
    fn()
    return clock() - t


def grad_of(fn, x, params):
    """fwd+bwd of fn(x) to x and params, with a fixed upstream gradient."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        y = fn(x)
        torch.autograd.grad(y, [x, *params], torch.ones_like(y))


def setup(size: str, dtype: str, batch: int, seq: int, kv_heads: int | None):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    shape = dict(SHAPES[size], **({"kv_heads": kv_heads} if kv_heads else {}))
    cfg = llama_config(shape, seq)
    torch.manual_seed(0)
    hf = LlamaDecoderLayer(cfg, layer_idx=0).float().train()
    hf_pure = LlamaDecoderLayer(cfg, layer_idx=0).to(torch.bfloat16).train()
    hf_pure.load_state_dict({k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()})
    sd = hf.state_dict()
    dt = DT[dtype]
    w = {k: sd[v].to(dt).contiguous() for k, v in NAMES.items()}
    spec = spec_from_hf(cfg.to_dict() | {"model_type": "llama"})
    ids = torch.zeros(batch, seq, dtype=torch.int64)
    mb = MicroBatch(ids, ids, torch.arange(seq).expand(batch, seq))
    ctx = attn_context(mb, spec, inv_freq(spec), dt, "cpu")
    x = torch.randn(batch, seq, cfg.hidden_size) * 0.5
    pos = torch.arange(seq).expand(batch, seq)
    rope = LlamaRotaryEmbedding(cfg)
    cos, sin = rope(x, pos)  # fp32; HF casts them to the activations' dtype
    return dict(hf=hf, hf_pure=hf_pure, w=w, spec=spec, ctx=ctx, x=x, pos=pos, cos=cos, sin=sin, dt=dt)


def cases(s: dict, dtype: str) -> dict[str, dict[str, object]]:
    """phase -> implementation -> zero-argument callable."""
    w, spec, ctx, dt = s["w"], s["spec"], s["ctx"], s["dt"]
    xh = s["x"].to(dt)
    leaves = [t.detach().requires_grad_(True) for t in w.values()]
    wl = dict(zip(w, leaves, strict=True))
    bf16 = dtype == "bfloat16"

    def hf_layer(layer, x, pe):
        return layer(x, attention_mask=None, position_ids=s["pos"], position_embeddings=pe)

    def hf_runs(layer, pure: bool):
        x = s["x"].to(torch.bfloat16) if pure else s["x"]
        pe = (s["cos"].to(x.dtype), s["sin"].to(x.dtype))
        ac = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and not pure)
        params = list(layer.parameters())
        attn_p = [*layer.self_attn.parameters(), *layer.input_layernorm.parameters()]
        mlp_p = [*layer.mlp.parameters(), *layer.post_attention_layernorm.parameters()]

        def fwd():
            with torch.no_grad(), ac:
                hf_layer(layer, x, pe)

        def fwdbwd():
            with ac:
                grad_of(lambda xx: hf_layer(layer, xx, pe), x, params)

        def attn_half():
            with ac:
                grad_of(lambda xx: layer.self_attn(layer.input_layernorm(xx), pe, None)[0], x, attn_p)

        def mlp_half():
            with ac:
                grad_of(lambda xx: layer.mlp(layer.post_attention_layernorm(xx)), x, mlp_p)

        return {"fwd": fwd, "fwd+bwd": fwdbwd, "attn": attn_half, "mlp": mlp_half}

    def ours_fwd():
        with torch.no_grad():
            layer_forward(w, xh, ctx, spec, None)

    ours = {
        "fwd": ours_fwd,
        "fwd+bwd": lambda: grad_of(lambda xx: layer_forward(wl, xx, ctx, spec, None), xh, leaves),
        "attn": lambda: grad_of(
            lambda xx: attention(wl, rms_norm(xx, wl["attn_norm"], spec.rms_eps), ctx, spec, None),
            xh,
            leaves[:5],
        ),
        "mlp": lambda: grad_of(
            lambda xx: mlp(wl, rms_norm(xx, wl["mlp_norm"], spec.rms_eps)), xh, leaves[5:]
        ),
    }
    q = torch.randn(xh.shape[0], spec.n_heads, xh.shape[1], spec.head_dim).to(dt)
    ours["rope"] = lambda: (apply_rope(q, ctx.cos, ctx.sin), apply_rope(q, ctx.cos, ctx.sin))  # q and k
    ours["norm"] = lambda: rms_norm(xh, w["attn_norm"], spec.rms_eps)
    out = {ph: {"horizon": fn} for ph, fn in ours.items()}
    if spec.n_kv_heads < spec.n_heads:
        for ph in ("fwd", "fwd+bwd", "attn"):
            out[ph]["horizon-expand"] = expanded(ours[ph])
    for name, layer, pure in (("hf", s["hf"], False), ("hf-pure", s["hf_pure"], True)):
        if pure and not bf16:
            continue
        for ph, fn in hf_runs(layer, pure).items():
            out[ph][name] = fn
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    out["rope"]["hf"] = lambda: apply_rotary_pos_emb(q, q, s["cos"].to(dt), s["sin"].to(dt))
    out["norm"]["hf"] = lambda: (s["hf_pure"] if bf16 else s["hf"]).input_layernorm(xh)
    return out


def expanded(fn):
    """fn, with grouped-query K/V expanded by copying before the kernel (horizon before attend.py)."""
    import horizon_cli.model.layer as layer_mod

    def attend_expanded(q, k, v, mask, scale):
        b, kv, T, hd = k.shape
        rep = q.shape[1] // kv
        k = k[:, :, None].expand(b, kv, rep, T, hd).reshape(b, kv * rep, T, hd)
        v = v[:, :, None].expand(b, kv, rep, T, hd).reshape(b, kv * rep, T, hd)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale
        )

    def run():
        real, layer_mod.attend = layer_mod.attend, attend_expanded
        try:
            fn()
        finally:
            layer_mod.attend = real

    return run


def op_log(fn) -> Counter:
    """The aten ops fn runs (views excluded), with their tensors' shapes, dtypes and strides."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter = Counter()

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                sig = tuple(
                    (tuple(a.shape), str(a.dtype), a.stride()) for a in args if isinstance(a, torch.Tensor)
                )
                seen[(str(func), sig)] += 1
            return func(*args, **(kwargs or {}))

    with Log():
        fn()
    return seen


def check_ops(table: dict, size: str, dtype: str) -> None:
    """Does horizon's layer run the same ops as transformers' (pure bf16 / fp32) one?"""
    ref = "hf-pure" if "hf-pure" in table["fwd+bwd"] else "hf"
    a, b = op_log(table["fwd+bwd"]["horizon"]), op_log(table["fwd+bwd"][ref])
    extra, missing = a - b, b - a
    print(f"{size} {dtype} fwd+bwd: {sum(a.values())} ops; horizon vs {ref}: "
          f"{sum(extra.values())} extra, {sum(missing.values())} missing")  # fmt: skip
    for (op, sig), n in list(extra.items())[:10]:
        print(f"  + {n} x {op} {sig}")
    for (op, sig), n in list(missing.items())[:10]:
        print(f"  - {n} x {op} {sig}")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="30m,120m")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--kv-heads", type=int, default=0, help="grouped-query attention (0: as in make bench)")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--clock", choices=CLOCK, default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="compute threads (0: 1 with --clock cpu, else 2)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--check-ops", action="store_true", help="compare the layers' aten ops, then exit")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or (1 if args.clock == "cpu" else 2))
    clock = CLOCK[args.clock]
    rows = []
    for size in args.sizes.split(","):
        for dtype in args.dtypes.split(","):
            s = setup(size, dtype, args.batch, args.seq, args.kv_heads or None)
            table = cases(s, dtype)
            if args.check_ops:
                check_ops(table, size, dtype)
                continue
            for fns in table.values():  # warm-up: oneDNN builds its kernels per shape
                for fn in fns.values():
                    fn()
            times: dict[str, dict[str, float]] = {ph: {} for ph in table}
            for r in range(args.repeat):  # interleaved rounds, the order flipped every other round
                for ph, fns in table.items():  # (the second call of a phase finds its input in cache)
                    for impl, fn in list(fns.items())[:: 1 if r % 2 else -1]:
                        times[ph][impl] = min(times[ph].get(impl, float("inf")), timed(fn, clock))
            for ph, t in times.items():
                row = {"size": size, "dtype": dtype, "phase": ph, **{k: v * 1e3 for k, v in t.items()}}
                rows.append(row)
                ref = t.get("hf")
                ratio = f"{ref / t['horizon']:.2f}x" if ref else "-"
                others = "  ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in t.items() if k != "horizon")
                print(
                    f"{size:5s} {dtype:9s} {ph:8s} horizon {t['horizon'] * 1e3:7.2f} ms  {others}  hf/horizon {ratio}"
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"command": " ".join(sys.argv), "clock": args.clock, "rows": rows}, indent=1)
        )
    return rows


if __name__ == "__main__":
    main()
