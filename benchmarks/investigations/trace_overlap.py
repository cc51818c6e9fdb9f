"""How much of the CPU AdamW lane's busy time lies inside a backward, from `horizon profile --trace`.

    .venv/bin/python benchmarks/investigations/trace_overlap.py prof.trace.json [more.trace.json ...]

Per trace: each measured step's backward window (the first to the last `bwd` span of the compute
lane within the step's span), the optimizer lane's busy seconds, and the share of them inside a
backward window. Without gradient release the updates wait for the whole backward (0 %); with
`optim.grad_release: true` each unit's AdamW runs as soon as its gradient lands (issue 39).
"""

from __future__ import annotations

import json
import sys


def overlap(path: str) -> dict:
    with open(path) as f:
        d = json.load(f)
    ev = d["traceEvents"] if isinstance(d, dict) else d
    lane = {e["args"]["name"]: e["tid"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in ev if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == lane["step"])
    bwd = [
        (e["ts"], e["ts"] + e["dur"])
        for e in spans
        if e["tid"] == lane["compute"] and e["name"].startswith("bwd")
    ]
    opt = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == lane["optimizer"]]
    wins = []
    for s0, s1 in steps:
        inside = [(a, b) for a, b in bwd if s0 <= a < s1]
        if inside:
            wins.append((min(a for a, _ in inside), max(b for _, b in inside)))
    busy = sum(b - a for a, b in opt)
    within = sum(max(0.0, min(b, w1) - max(a, w0)) for a, b in opt for w0, w1 in wins)
    return {"steps": len(steps), "backward_s": [(b - a) / 1e6 for a, b in wins], "updates": len(opt),
            "optimizer_s": busy / 1e6, "inside_backward_s": within / 1e6, "share": within / busy if busy else 0.0}  # fmt: skip


def main() -> None:
    for path in sys.argv[1:]:
        r = overlap(path)
        print(
            f"{path}: {r['steps']} steps, backward windows {' '.join(f'{s:.1f}' for s in r['backward_s'])} s; "
            f"{r['updates']} AdamW spans, {r['optimizer_s']:.2f} s busy, {r['inside_backward_s']:.2f} s inside "
            f"a backward ({r['share']:.0%})"
        )


if __name__ == "__main__":
    main()
