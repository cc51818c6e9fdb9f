"""A step's time on paper, with and without gradient release (issue 39): Llama-3.1-70B on one H200.

    .venv/bin/python scripts/step_time.py                  # 8K and 64K tokens a step
    .venv/bin/python scripts/step_time.py --tflops 989 --mfu-layers 0.6 --link-gbs 50 --host-gbs 300

A model of three resources, each phase as long as its busiest one (no kept layer, attention's
arithmetic left out, every transfer and update overlapped perfectly within its phase):

  device   forward 2 P N FLOPs, the backward's recompute 2 P N and backward 4 P N, at
           --tflops x --mfu-layers
  link     each phase's loads, P bf16 weights each (forward, recompute; a norm-first pass two more),
           and the backward's P bf16 gradients the other way, at --link-gbs each way
  host     DRAM traffic at --host-gbs: the link's copies (read or written once) and exact AdamW's
           26 B/param (read weight 2, int16 remainder 2, moments 8, gradient 2; write 12)

Without release every update waits for the global norm, so AdamW overlaps only the next step's
forward (the forward's phase also holds it); with release (optim.grad_clip 0) it runs inside the
backward; with release and grad_clip > 0 a norm-first pass adds, as built (engine/step.py released_step),
a whole forward and backward that only measure the norm (their loads and compute, no gradient
leaves the device). A short tail (the last unit's and the
embedding's AdamW) is added to each. MFU counts 6 P N useful FLOPs against the peak.
"""

from __future__ import annotations

import argparse

P = 70.55e9  # Llama-3.1-70B's parameters (the memory plan's count)
EMBED, LAYER = 128256 * 8192, 855.6e6  # the embedding's and one layer's parameters
ADAMW = 26  # exact AdamW's host bytes a parameter and step


def step(tokens: int, a: argparse.Namespace, release: str) -> float:
    flops = a.tflops * 1e12 * a.mfu_layers
    fwd, bwd = 2 * P * tokens / flops, 6 * P * tokens / flops  # backward: recompute + backward
    load, host = 2 * P / (a.link_gbs * 1e9), a.host_gbs * 1e9
    adamw = ADAMW * P / host
    tail = ADAMW * (EMBED + LAYER) / host
    if release == "off":
        forward = max(fwd, load, adamw + 2 * P / host)
        return forward + max(bwd, load, 4 * P / host) + tail
    releasing = max(bwd, load, adamw + 4 * P / host)
    measure = max(fwd, load, 2 * P / host) + max(bwd, load, 2 * P / host)  # the measuring pass
    norm = measure if release == "norm-first" else 0.0
    return max(fwd, load, 2 * P / host) + norm + releasing + tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tflops", type=float, default=989.0, help="the device's dense bf16 peak, TFLOP/s")
    ap.add_argument("--mfu-layers", type=float, default=0.6, help="fraction of the peak the layers reach")
    ap.add_argument("--link-gbs", type=float, default=50.0, help="host-device link, GB/s each way")
    ap.add_argument("--host-gbs", type=float, default=300.0, help="host DRAM bandwidth, GB/s")
    a = ap.parse_args()
    print("| tokens a step | without release | release, grad_clip 0 | release, grad_clip > 0 (norm-first) |")
    print("|---|---|---|---|")
    for tokens in (8192, 65536):
        cells = []
        for mode in ("off", "one pass", "norm-first"):
            t = step(tokens, a, mode)
            cells.append(f"{t:.1f} s ({6 * P * tokens / (t * a.tflops * 1e12):.0%} MFU)")
        print(f"| {tokens:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
