"""A PNG timeline a person can read at a glance: lanes for the link, compute and the optimizer."""

from __future__ import annotations

from pathlib import Path

from ..runtime.trace import Span

ROWS = [
    ("h2d", "host → device"),
    ("compute", "device compute"),
    ("d2h", "device → host"),
    ("optimizer", "CPU AdamW"),
]


def _color(s: Span) -> str:
    n = s.name
    if s.lane == "optimizer":
        return "#9467bd"
    if n.endswith(" kept"):  # a kept layer: forward under autograd, backward from its graph
        return "#8c564b"
    if n.startswith(("fwd", "f")) and not n.startswith("g"):
        return "#1f77b4"
    if n.startswith(("bwd", "b")):
        return "#ff7f0e"
    if n.startswith("head"):
        return "#2ca02c"
    if n.startswith("g"):
        return "#d62728"
    if n.startswith("save"):
        return "#17becf"
    return "#7f7f7f"


def plot_timeline(spans: list[Span], out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(s.t0 for s in spans)
    floor = 0.0005 * (max(s.t1 for s in spans) - t0) * 1e3  # keep short copies visible
    fig, ax = plt.subplots(figsize=(13, 3.6), dpi=110)
    for y, (lane, _label) in enumerate(ROWS):
        lane_spans = [s for s in spans if s.lane == lane]
        bars = [((s.t0 - t0) * 1e3, max((s.t1 - s.t0) * 1e3, floor)) for s in lane_spans]
        ax.broken_barh(
            bars, (len(ROWS) - 1 - y - 0.4, 0.8), facecolors=[_color(s) for s in lane_spans], edgecolor="none"
        )
    for s in spans:
        if s.lane == "step":
            ax.axvline((s.t0 - t0) * 1e3, color="black", lw=0.8, ls=":")
    ax.set_yticks(range(len(ROWS)))
    ax.set_yticklabels([label for _, label in reversed(ROWS)])
    ax.set_xlabel("time (ms); dotted lines: optimizer step boundaries")
    legend = [
        Patch(color="#1f77b4", label="forward / weights for it"),
        Patch(color="#ff7f0e", label="backward (recompute) / weights + saved inputs"),
        Patch(color="#8c564b", label="kept layer (graph held, no recompute)"),
        Patch(color="#2ca02c", label="loss head"),
        Patch(color="#17becf", label="saved activations"),
        Patch(color="#d62728", label="gradients"),
        Patch(color="#9467bd", label="AdamW update"),
    ]
    ax.legend(
        handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=7, fontsize=8, frameon=False
    )
    ax.set_title(title or "horizon pipeline timeline", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
