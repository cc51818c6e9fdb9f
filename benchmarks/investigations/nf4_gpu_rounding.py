"""How far a base quantized by bitsandbytes on a GPU is from a horizon NF4 store (= bitsandbytes
on the CPU): an emulation of the CUDA kernel's 8-bit absmax rounding, not a GPU measurement.

    .venv/bin/python -m benchmarks.investigations.nf4_gpu_rounding [--rows 4096 --cols 4096 --tensors 4]

bitsandbytes quantizes the block absmaxes (double quantization) on the CPU through 65536 evenly
spaced bins (what horizon matches, quant/nf4_bnb.py), on CUDA by a 7-step binary search of the
dynamic map from index 127 followed by a midpoint comparison with the neighbour on the side the
value lies (kernels.cu, dQuantize<0>). The 4-bit codes and the dequantization are the same on both.
This runs the CUDA rule in fp32 on torch.randn * 0.02 weights and prints how many absmax indices
and dequantized weights differ, and by how much. Results: docs/store-format.md ("Quantized stores").
"""

from __future__ import annotations

import argparse
import json

import torch

from horizon_cli.quant import nf4_bnb


def cuda_index(v: torch.Tensor) -> torch.Tensor:
    """(n,) fp32 normalised values -> (n,) int64 indices into the dynamic map, as the CUDA kernel."""
    code = nf4_bnb.DYNAMIC
    pivot = torch.full(v.shape, 127, dtype=torch.long)
    lower_p, upper_p = torch.zeros_like(pivot), torch.full_like(pivot, 255)
    lower, upper = torch.full_like(v, -1.0), torch.full_like(v, 1.0)
    val = code[pivot]
    step = 64
    while step > 0:
        right = v > val
        lower_p, lower = torch.where(right, pivot, lower_p), torch.where(right, val, lower)
        upper_p, upper = torch.where(right, upper_p, pivot), torch.where(right, upper, val)
        pivot = torch.where(right, pivot + step, pivot - step)
        val = code[pivot]
        step //= 2
    upper = torch.where(upper_p == 255, code[255], upper)
    lower = torch.where(lower_p == 0, code[0], lower)
    right = v > val
    up_mid, lo_mid = (upper + val) * 0.5, (lower + val) * 0.5
    return torch.where(
        right, torch.where(v > up_mid, upper_p, pivot), torch.where(v < lo_mid, lower_p, pivot)
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--tensors", type=int, default=4)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    n_idx = d_idx = n_w = d_w = 0
    rel: list[torch.Tensor] = []
    for _ in range(a.tensors):
        w = (torch.randn(a.rows, a.cols, generator=g) * 0.02).bfloat16()
        q = nf4_bnb.quantize(w)
        _, absmax = nf4_bnb.quantize_blocks(w.reshape(-1))
        nb = absmax.numel()
        group = q["absmax2"].repeat_interleave(nf4_bnb.GROUP)[:nb]
        v = (absmax - q["offset"]) * (1.0 / group)
        gpu = {**q, "absmax": cuda_index(v).to(torch.uint8)}
        cpu_w = nf4_bnb.dequantize(q, torch.empty(w.numel(), dtype=w.dtype)).float()
        gpu_w = nf4_bnb.dequantize(gpu, torch.empty(w.numel(), dtype=w.dtype)).float()
        n_idx, d_idx = n_idx + nb, d_idx + int((gpu["absmax"] != q["absmax"]).sum())
        diff = cpu_w != gpu_w
        n_w, d_w = n_w + w.numel(), d_w + int(diff.sum())
        rel.append(((cpu_w - gpu_w).abs() / gpu_w.abs())[diff])
    r = torch.cat(rel)
    out = {
        "absmax_indices": n_idx,
        "absmax_indices_differing": d_idx,
        "absmax_fraction": d_idx / n_idx,
        "weights": n_w,
        "weights_differing": d_w,
        "weights_fraction": d_w / n_w,
        "rel_diff_median": float(r.median()) if r.numel() else 0.0,
        "rel_diff_max": float(r.max()) if r.numel() else 0.0,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
