"""The race stress of scripts/gpu_check.sh: the same training steps under three transports, which
must give bitwise the same losses and weights.

    python3 benchmarks/gpu_race.py --device cuda|cpu [--json FILE] [--layers 2] [--steps 3]

    plain       the engine's own transport (CUDA: copy streams; CPU: copies on a worker per direction)
    serialized  every copy starts on an idle device (CUDA: each copy's request waits for the
                compute issued before it, and the copy worker synchronizes the device once the
                copy's dependencies are met; CPU: one copy at a time, either direction)
    delayed     random (seeded) delays before each copy (CUDA: torch.cuda._sleep on the copy
                stream; CPU: the chaos transport, runtime/chaos.py)

each at prefetch 1, 2, 3 and keep_activations 0 and auto (the delayed ones at prefetch 1-3 with
keep 0, and prefetch 2 with auto). Kept layers equal recomputed ones bitwise (tests/engine/test_keep.py),
so every run is held against the serialized one. CUDA: Llama-3.1-8B-shaped bf16 layers (hidden
4096, 32/8 heads, intermediate 14336) with a 32K vocabulary, 2 x 2,048 tokens a step: each layer
is 436 MB on the link, so a missing wait is a race of milliseconds, not microseconds. CPU (the
rehearsal): the same code on a small Llama shape.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.data.batch import MicroBatch
from horizon_cli.engine import Engine
from horizon_cli.runtime.events import FutureEvent
from horizon_cli.runtime.transport import CpuTransport, copy_bytes
from tests.support.synthetic import random_store

CUDA_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
CPU_SHAPE = dict(hidden_size=64, intermediate_size=160, num_attention_heads=8, num_key_value_heads=2)


def config(device: str, layers: int) -> dict:
    shape = CUDA_SHAPE if device == "cuda" else CPU_SHAPE
    return dict(model_type="llama", num_hidden_layers=layers, vocab_size=32768 if device == "cuda" else 512,
                max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False, **shape)  # fmt: skip


def cuda_transports():
    from horizon_cli.runtime.cuda import CudaTransport

    class Serialized(CudaTransport):
        def record(self):  # a copy's request (and any event): the compute issued so far completes
            ev = super().record()
            ev.host_wait()
            return ev

        def _stream_wait(self, stream, ev):
            super()._stream_wait(stream, ev)
            if any(stream == s for s in self.streams.values()):  # a copy: on an idle device
                self.api.synchronize()

    class Delayed(CudaTransport):
        def __init__(self, device, seed: int = 0):
            super().__init__(device)
            self._rng = random.Random(seed)

        def _stream_wait(self, stream, ev):
            super()._stream_wait(stream, ev)
            if any(stream == s for s in self.streams.values()):  # a copy, not the compute
                torch.cuda._sleep(self._rng.randrange(0, 2_000_000))  # up to ~1 ms at ~2 GHz

    dev = torch.device("cuda", 0)
    return {
        "plain": lambda: CudaTransport(dev),
        "serialized": lambda: Serialized(dev),
        "delayed": lambda: Delayed(dev),
    }


def cpu_transports():
    from horizon_cli.runtime.chaos import ChaosTransport

    class Serialized(CpuTransport):
        def __init__(self):
            super().__init__(1e6)  # an unthrottled link: every load a real copy
            self._one = threading.Lock()

        def _copy(self, direction, pairs, deps, label):
            pairs = list(pairs)

            def job():
                for d in deps:
                    d.host_wait()
                with self._one:  # one copy at a time, either direction
                    for dst, src in pairs:
                        copy_bytes(dst, src)

            return FutureEvent(self._pools[direction].submit(job))

    return {
        "plain": lambda: CpuTransport(1e6),
        "serialized": Serialized,
        "delayed": lambda: ChaosTransport(seed=7),
    }


def batches(vocab: int, steps: int, rows: int, seq: int) -> list[list[MicroBatch]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        pos = torch.arange(seq).expand(rows, seq)
        out.append([MicroBatch(ids[i : i + 1], ids[i : i + 1], pos[i : i + 1]) for i in range(rows)])
    return out


def digest(eng: Engine) -> str:
    h = hashlib.sha256()
    for name in sorted(eng.host.units):
        h.update(eng.host.units[name].master().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def kept(store, device: str, prefetch: int, keep, rows: int, seq: int) -> int:
    """keep_activations as `horizon train` resolves it: auto, what the plan finds room for on this
    GPU (the CPU rehearsal: every layer)."""
    if keep != "auto":
        return int(keep)
    if device != "cuda":
        return store.arch.n_layers
    from horizon_cli.planning.fit import Machine
    from horizon_cli.planning.keep import keep_plan
    from horizon_cli.planning.memory import memory_plan

    plan = memory_plan(store.arch, "bfloat16", "auto", rows, 1, seq, prefetch, 1024)
    return keep_plan(plan, "auto", Machine(1 << 50, torch.cuda.mem_get_info()[0], "this GPU")).kept


def run(store, device: str, make, prefetch: int, keep, data) -> dict:
    dtype = "bfloat16" if device == "cuda" else "float32"
    cfg = EngineConfig(device=device, dtype=dtype, prefetch=prefetch, loss_chunk=1024)
    k = kept(store, device, prefetch, keep, len(data[0]), data[0][0].input_ids.shape[1])
    t0 = time.perf_counter()
    eng = Engine(store, cfg, OptimConfig(lr=1e-4, grad_clip=1.0), transport=make(), keep=k)
    try:
        losses = [eng.step(mbs, 1e-4).loss for mbs in data]
        eng.wait()
        return {
            "losses": losses,
            "weights": digest(eng),
            "kept": eng.p.keep,
            "seconds": time.perf_counter() - t0,
        }
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    kinds = cuda_transports() if cuda else cpu_transports()
    plan = [("serialized", 2, 0)]
    plan += [("plain", p, k) for p in (1, 2, 3) for k in (0, "auto")]
    plan += [("delayed", p, 0) for p in (1, 2, 3)] + [("delayed", 2, "auto")]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(args.device, args.layers)
        store = random_store(Path(tmp) / "store", cfg, dtype="bfloat16" if cuda else "float32")
        data = batches(cfg["vocab_size"], args.steps, 2, 2048 if cuda else 64)
        runs = []
        for kind, prefetch, keep in plan:
            r = run(store, args.device, kinds[kind], prefetch, keep, data)
            runs.append({"transport": kind, "prefetch": prefetch, "keep": keep, **r})
            print(json.dumps(runs[-1]), flush=True)
    ref = runs[0]
    same = all(r["losses"] == ref["losses"] and r["weights"] == ref["weights"] for r in runs)
    out = {"ok": same, "layers": args.layers, "steps": args.steps, "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print("bitwise equal across", len(runs), "runs:", same)
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
