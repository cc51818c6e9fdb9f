"""The measuring stages of scripts/gpu_check.sh (each also rehearsed on the CPU with --device cpu,
at small sizes, so a GPU slot is never spent on a typo):

    python3 benchmarks/gpu_stages.py env|bandwidth|layer|throughput --device cuda|cpu --json FILE

    env         torch, CUDA, transformers, the GPU (name, capability, memory), the driver, host RAM
    bandwidth   pinned host <-> device copies of 1 GB (CPU: 16 MB): H2D, D2H, and both at once on
                two streams (the duplex the pipeline relies on), GB/s, best of 3
    layer       one Llama-3.1-8B-shaped layer (32K vocabulary) trained one step in bf16 against
                fp32 from the same store: the loss and the layer's gradient, relative errors
    throughput  an 8B-shaped model of 16 layers (vocabulary 128256) at 64K and at 8K tokens a step:
                step time, phase times (forward, head, backward, optimizer: the trace's spans), the
                GPU-busy fraction (compute spans' union over the step), achieved GB/s each way, MFU
                against 989 TFLOP/s (H200 dense bf16), allocated / reserved / driver memory against
                the plan's device bytes. CPU: 2 small layers, 2 x 64 and 8 x 64 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.data.batch import MicroBatch
from horizon_cli.engine import Engine
from horizon_cli.runtime.trace import Tracer
from tests.support.synthetic import random_store

PEAK = 989e12


def shape(device: str, layers: int, vocab: int) -> dict:
    big = device == "cuda"
    return dict(model_type="llama", num_hidden_layers=layers, vocab_size=vocab if big else 512,
                hidden_size=4096 if big else 64, intermediate_size=14336 if big else 160,
                num_attention_heads=32 if big else 8, num_key_value_heads=8 if big else 2,
                max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False)  # fmt: skip


def rows(vocab: int, n: int, seq: int, micro: int = 1, seed: int = 0) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    pos = torch.arange(seq).expand(n, seq)
    return [
        MicroBatch(ids[i : i + micro], ids[i : i + micro], pos[i : i + micro]) for i in range(0, n, micro)
    ]


# -- env -------------------------------------------------------------------------------------------
def env(device: str) -> dict:
    import transformers

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "python": platform.python_version(), "cpus": os.cpu_count(),
           "host_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30}  # fmt: skip
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        out.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_gib=total / 2**30, free_gib=free / 2**30,
                   driver=os.popen("nvidia-smi --query-gpu=driver_version --format=csv,noheader").read().strip())  # fmt: skip
    return out


# -- bandwidth -------------------------------------------------------------------------------------
def bandwidth(device: str) -> dict:
    n = (1 << 30) if device == "cuda" else (16 << 20)
    return _cuda_bandwidth(n) if device == "cuda" else _cpu_bandwidth(n)


def _cuda_bandwidth(n: int) -> dict:
    host = [torch.empty(n, dtype=torch.uint8).pin_memory() for _ in range(2)]
    dev = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def timed(jobs) -> float:
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for stream, dst, src in jobs:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    h2d = timed([(streams[0], dev[0], host[0])])
    d2h = timed([(streams[1], host[1], dev[1])])
    both = timed([(streams[0], dev[0], host[0]), (streams[1], host[1], dev[1])])
    return {
        "bytes": n,
        "h2d_gbps": n / h2d / 1e9,
        "d2h_gbps": n / d2h / 1e9,
        "duplex_gbps": 2 * n / both / 1e9,
    }


def _cpu_bandwidth(n: int) -> dict:
    from horizon_cli.runtime.transport import copy_bytes

    a, b, c, d = (torch.ones(n, dtype=torch.uint8) for _ in range(4))

    def timed(pairs) -> float:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            threads = [threading.Thread(target=copy_bytes, args=p) for p in pairs]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            best = min(best, time.perf_counter() - t)
        return best

    one = timed([(b, a)])
    return {"bytes": n, "h2d_gbps": n / one / 1e9, "d2h_gbps": n / timed([(d, c)]) / 1e9,
            "duplex_gbps": 2 * n / timed([(b, a), (d, c)]) / 1e9}  # fmt: skip


# -- layer: bf16 against fp32 ----------------------------------------------------------------------
def layer(device: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = shape(device, 1, 32768)
        store = random_store(Path(tmp) / "store", cfg, dtype="float32")
        mbs = rows(cfg["vocab_size"], 1, 4096 if device == "cuda" else 128)
        got = {}
        for dtype in ("float32", "bfloat16"):
            ecfg = EngineConfig(device=device, dtype=dtype, loss_chunk=2048, keep_activations=0)
            eng = Engine(store, ecfg, OptimConfig(lr=1e-5))
            try:
                loss, _, _ = eng.forward_backward(mbs)
                eng.wait()
                got[dtype] = (loss, eng.host.units["layer.0"].grad.float().clone())
            finally:
                eng.close()
    (l32, g32), (l16, g16) = got["float32"], got["bfloat16"]
    loss_err = abs(l16 - l32) / abs(l32)
    grad_err = float((g16 - g32).norm() / g32.norm())
    return {"loss_fp32": l32, "loss_bf16": l16, "loss_rel_err": loss_err, "grad_rel_err": grad_err,
            "ok": loss_err < 1e-2 and grad_err < 5e-2}  # fmt: skip


# -- throughput ------------------------------------------------------------------------------------
def union(spans) -> float:
    total, end = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.t0):
        if s.t1 > end:
            total += s.t1 - max(s.t0, end)
            end = s.t1
    return total


def phases(tracer: Tracer) -> dict:
    sp = tracer.spans
    step = [s for s in sp if s.lane == "step"][-1]
    inside = [s for s in sp if s.t0 >= step.t0 and s.t1 <= step.t1 + 5.0]
    comp = [s for s in inside if s.lane == "compute"]
    out = {"step_s": step.t1 - step.t0, "gpu_busy": union(comp) / (step.t1 - step.t0)}
    for name in ("fwd", "head", "bwd"):
        out[f"{name}_s"] = sum(s.t1 - s.t0 for s in comp if s.name.startswith(name))
    out["optimizer_s"] = sum(s.t1 - s.t0 for s in inside if s.lane == "optimizer")
    for lane in ("h2d", "d2h"):
        spans = [s for s in inside if s.lane == lane]
        busy, n = union(spans), sum(s.args.get("bytes", 0) for s in spans)
        out[f"{lane}_busy_s"], out[f"{lane}_gbps"] = busy, n / busy / 1e9 if busy else 0.0
    return out


def throughput(device: str) -> dict:
    from benchmarks.gpu_throughput import flops_per_token
    from horizon_cli.planning.memory import memory_plan

    cuda = device == "cuda"
    seq = 4096 if cuda else 64
    sizes = {"64K": 16, "8K": 2} if cuda else {"512": 8, "128": 2}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = shape(device, 16 if cuda else 2, 128256)
        store = random_store(Path(tmp) / "store", cfg, dtype="bfloat16" if cuda else "float32")
        dtype = "bfloat16" if cuda else "float32"
        tracer = Tracer(enabled=True)
        ecfg = EngineConfig(device=device, dtype=dtype, loss_chunk=4096, keep_activations=0)
        eng = Engine(store, ecfg, OptimConfig(lr=1e-5), tracer=tracer, max_tokens=max(sizes.values()) * seq)
        out = {"layers": cfg["num_hidden_layers"], "params": store.manifest.params, "seq": seq}
        try:
            for label, n in sizes.items():
                mbs = rows(cfg["vocab_size"], n, seq)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                got = []
                for _ in range(3):  # the first warms up
                    tracer.clear()
                    r = eng.step(mbs, 1e-5)
                    got.append((r, phases(tracer)))
                r, ph = got[-1]
                step = statistics.median(p["step_s"] for _, p in got[1:])
                model_f, _ = flops_per_token(store.arch, seq)
                plan = memory_plan(store.arch, dtype, "auto", n, 1, seq, 2, 4096).device_total
                res = {"tokens": n * seq, "step_s": step, "tokens_per_s": n * seq / step, **ph,
                       "mfu": model_f * n * seq / step / PEAK, "plan_device_bytes": plan,
                       "device_peak_bytes": r.device_peak_bytes, "loss": r.loss}  # fmt: skip
                if cuda:
                    free, total = torch.cuda.mem_get_info()
                    res.update(allocated=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved(),
                               driver_used=total - free)  # fmt: skip
                    res["reserved_over_plan"] = res["reserved"] / plan
                out[label] = res
                print(label, json.dumps(res), flush=True)
        finally:
            eng.close()
    return out


STAGES = {"env": env, "bandwidth": bandwidth, "layer": layer, "throughput": throughput}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=list(STAGES))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = STAGES[args.stage](args.device)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    raise SystemExit(0 if out.get("ok", True) else 1)


if __name__ == "__main__":
    main()
