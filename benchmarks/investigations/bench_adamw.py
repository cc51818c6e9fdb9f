"""Benchmark the CPU AdamW step: the fused kernel (kernels/adamw.cpp) against the alternatives.

Run (the command behind the kernel's reported figures):

    .venv/bin/python -m benchmarks.investigations.bench_adamw --sizes 1M,16M,64M --threads 2 --json bench_out/adamw.json

Variants, each timed on one flat unit of N elements, state updated in place every step:
  kernel-fp32[-ISA]   native.adamw_fp32_   p, g, m, v fp32
  kernel-split[-ISA]  native.adamw_split_  master as bf16 hi + int16 lo, g, m, v fp32
  kernel-lean[-ISA]   native.adamw_lean_   optim.memory lean: bf16 hi + int8 lo8, 8-bit m and sqrt(v)
                      with fp32 scales per 64, g fp32
  torch-ref-lean      optim.lean.adamw_lean_ (its pure-torch reference)
  torch-ref-fp32      optim.adamw.adamw_fp32_ (pure torch, ~8 passes)
  torch-ref-split     optim.adamw.adamw_split_
  torch-fused         torch.optim.AdamW(fused=True).step()
  torch-fused+bf16    the same, then the bf16 streaming copy refreshed from p (+4 read, +2 written):
                      the work the split kernel does in its one pass
  deepspeed           deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True).step(), when importable

Timing: warm-up steps, then rounds in which every variant runs one step in turn; rates and the
speedup over torch-fused use each variant's best round (median also reported). --cache cold
(default) flushes the caches before each timed step, as training does to a unit between its
updates; --cache hot times a unit that the caches already hold.

GB/s counts the bytes a single fused pass must move per element (read + written): fp32 master
4+4 (p) + 4 (g) + 4+4 (m) + 4+4 (v) = 28; split master 2+2 (hi) + 2+2 (lo) + 4 + 8 + 8 = 28; lean
2+2 (hi) + 1+1 (lo8) + 4 (g) + 1+1 (qm) + 1+1 (qw) + 0.25 (two fp32 scales per 64, read and written) ~ 14.
The same count is used for the unfused torch reference, so its figure is an effective rate: it
really moves several times more.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from horizon_cli.optim import adamw as ref
from horizon_cli.optim import (
    lean,
    native,
)
from horizon_cli.optim.split import split_

FP32, SPLIT, LEAN = 28, 28, 14  # bytes read + written per element, see the module docstring
HYPER = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


@dataclass
class Variant:
    name: str
    bytes_per_elem: int
    step: Callable[[int], None]  # step(t) runs optimizer step t (1-based) in place
    times_s: list[float] = field(default_factory=list)
    t: int = 0

    def run(self, timed: bool) -> None:
        self.t += 1
        start = time.perf_counter()
        self.step(self.t)
        if timed:
            self.times_s.append(time.perf_counter() - start)

    def row(self, n: int) -> dict:
        # Rates come from the best round: on a shared machine the median mostly measures the
        # neighbours; the median is kept alongside.
        best = min(self.times_s)
        return {
            "variant": self.name,
            "n": n,
            "bytes_per_elem": self.bytes_per_elem,
            "min_s": best,
            "median_s": statistics.median(self.times_s),
            "elems_per_s": n / best,
            "gb_per_s": n * self.bytes_per_elem / best / 1e9,
            "repeats": len(self.times_s),
        }


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def hyper(t: int) -> ref.AdamWHyper:
    return ref.AdamWHyper(step=t, grad_scale=0.5, **HYPER)


def fp32_state(n: int) -> tuple[torch.Tensor, ...]:
    # (N,) each: p, g, m, v. Non-zero moments so no path takes a shortcut on zeros.
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    return (
        p,
        torch.randn(n, generator=gen),
        torch.randn(n, generator=gen) * 1e-3,
        torch.rand(n, generator=gen) * 1e-6,
    )


def split_state(n: int) -> tuple[torch.Tensor, ...]:
    p, g, m, v = fp32_state(n)
    hi, lo = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    split_(p, hi, lo)
    return hi, lo, g, m, v


def lean_state(n: int) -> tuple[torch.Tensor, ...]:
    """hi, lo8, g, qm, qw, sm, sw after one step from fp32_state, so the codes are not all zero."""
    p, g, _, _ = fp32_state(n)
    hi, lo8 = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int8)
    lean.split24_(p, hi, lo8)
    qm, qw = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    sm, sw = torch.zeros(n // lean.BLOCK), torch.zeros(n // lean.BLOCK)
    native.adamw_lean_(hi, lo8, g, qm, qw, sm, sw, hyper(1), 1, 0)
    return hi, lo8, g, qm, qw, sm, sw


def torch_adamw(cls: type, n: int, **kw) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    p, g, _, _ = fp32_state(n)
    param = torch.nn.Parameter(p)
    param.grad = g
    h = HYPER
    opt = cls(
        [param],
        lr=h["lr"],
        betas=(h["beta1"], h["beta2"]),
        eps=h["eps"],
        weight_decay=h["weight_decay"],
        **kw,
    )
    return param, opt


def torch_step(cls: type, n: int, **kw) -> Callable[[int], None]:
    _, opt = torch_adamw(cls, n, **kw)
    return lambda t: opt.step()


def fused_with_bf16_copy(n: int) -> Callable[[int], None]:
    """What an fp32-master engine built on torch's fused AdamW does per unit: the step, then a
    refresh of the bf16 streaming copy (reads p, writes the copy). The split kernel does both."""
    param, opt = torch_adamw(torch.optim.AdamW, n, fused=True)
    copy = torch.empty(n, dtype=torch.bfloat16)

    def step(t: int) -> None:
        opt.step()
        copy.copy_(param.detach())

    return step


def variants(n: int, isas: list[str], reference: bool, deepspeed: type | None) -> list[Variant]:
    """Every variant for one size. The kernel paths and the reference share one state per master
    layout (they all update it in place; only the time matters here)."""
    out = [Variant("torch-fused", FP32, torch_step(torch.optim.AdamW, n, fused=True))]
    out.append(Variant("torch-fused+bf16", FP32 + 6, fused_with_bf16_copy(n)))
    p, g, m, v = fp32_state(n)
    hi, lo, g2, m2, v2 = split_state(n)
    for isa in isas:
        out.append(
            Variant(
                f"kernel-fp32-{isa}",
                FP32,
                lambda t, isa=isa: native.adamw_fp32_(p, g, m, v, hyper(t), isa=isa),
            )
        )
    for isa in isas:
        out.append(
            Variant(
                f"kernel-split-{isa}",
                SPLIT,
                lambda t, isa=isa: native.adamw_split_(hi, lo, g2, m2, v2, hyper(t), isa=isa),
            )
        )
    ls = lean_state(n)
    for isa in isas:
        out.append(
            Variant(
                f"kernel-lean-{isa}",
                LEAN,
                lambda t, isa=isa: native.adamw_lean_(*ls, hyper(t), t, 0, isa=isa),
            )
        )
    if reference:
        out.append(Variant("torch-ref-lean", LEAN, lambda t: lean.adamw_lean_(*ls, hyper(t), t, 0)))
        out.append(Variant("torch-ref-fp32", FP32, lambda t: ref.adamw_fp32_(p, g, m, v, hyper(t))))
        out.append(
            Variant("torch-ref-split", SPLIT, lambda t: ref.adamw_split_(hi, lo, g2, m2, v2, hyper(t)))
        )
    if deepspeed is not None:
        out.append(Variant("deepspeed", FP32, torch_step(deepspeed, n, adamw_mode=True)))
    return out


def measure(vs: list[Variant], warmup: int, repeats: int, cache: str, flush_mb: int) -> None:
    """Round-robin: each round times one step of every variant, so load from other processes on
    a shared machine falls on all variants alike rather than on whichever ran at that moment.

    cache="cold": the caches are flushed before each timed step, as in training, where a unit's
    buffers were last touched a whole step ago. cache="hot": each timed step directly follows an
    untimed one of the same variant, so a unit that fits in the caches runs from them."""
    flush = torch.empty(flush_mb << 18)  # fp32, flush_mb MiB
    for _ in range(warmup):
        for var in vs:
            var.run(timed=False)
    for _ in range(repeats):
        for var in vs:
            if cache == "cold":
                flush.fill_(var.t)  # writes every line: evicts the variant's buffers
            else:
                var.run(timed=False)
            var.run(timed=True)


def load_deepspeed() -> tuple[type | None, str]:
    """DeepSpeedCPUAdam and "" when it imports and its op builds, else None and why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # not installed, or its import fails on this machine
        return None, f"import failed: {type(e).__name__}: {_first_line(e)}"
    try:  # the cpu_adam op is JIT-built on first construction
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(16))])
    except Exception as e:
        return None, f"op build failed: {type(e).__name__}: {_first_line(e)}"
    return DeepSpeedCPUAdam, ""


def _first_line(e: Exception) -> str:
    return next((ln for ln in str(e).splitlines() if ln.strip()), "")


def print_table(rows: list[dict]) -> None:
    head = f"{'variant':<22} {'N':>9} {'best ms':>8} {'median ms':>10} {'Gelem/s':>8} {'GB/s':>6} {'vs fused':>8}"
    print(head)
    for r in rows:
        print(
            f"{r['variant']:<22} {r['n']:>9} {r['min_s'] * 1e3:>8.2f} {r['median_s'] * 1e3:>10.2f} "
            f"{r['elems_per_s'] / 1e9:>8.3f} {r['gb_per_s']:>6.1f} {r['speedup_vs_torch_fused']:>7.2f}x"
        )


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1M,16M,64M", help="comma-separated element counts (K/M/G suffixes)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cache", choices=["cold", "hot"], default="cold", help="see measure()")
    ap.add_argument(
        "--flush-mb", type=int, default=256, help="cold: MiB written between steps (> last-level cache)"
    )
    ap.add_argument("--isas", default="auto", help="kernel paths: 'auto', 'all', or e.g. avx512,avx2,scalar")
    ap.add_argument("--no-reference", action="store_true", help="skip the slow pure-torch reference")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    if not native.available():
        sys.exit(f"error: native kernel unavailable: {native.reason()}")
    isas = native.isas() if args.isas == "all" else args.isas.split(",")
    ds_cls, ds_reason = (None, "skipped (--no-deepspeed)") if args.no_deepspeed else load_deepspeed()
    if ds_reason:
        print(f"deepspeed: {ds_reason}")

    load_start = os.getloadavg()
    rows: list[dict] = []
    for n in (parse_size(s) for s in args.sizes.split(",")):
        vs = variants(n, isas, not args.no_reference, ds_cls)
        measure(vs, args.warmup, args.repeats, args.cache, args.flush_mb)
        fused_s = min(vs[0].times_s)
        rows += [v.row(n) | {"speedup_vs_torch_fused": fused_s / min(v.times_s)} for v in vs]
        del vs  # free this size's buffers before the next
    print_table(rows)
    print(
        f"load average before/after: {load_start[0]:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )

    if args.json:
        meta = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "threads": args.threads,
            "cache": args.cache,
            "torch": torch.__version__,
            "cpu": cpu_name(),
            "cpu_count": os.cpu_count(),
            # other processes on a shared machine skew timings; this says how busy it was
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "kernel_isas": native.isas(),
            "deepspeed": ds_reason or "ok",
            "hyper": HYPER,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
        tmp.replace(args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
