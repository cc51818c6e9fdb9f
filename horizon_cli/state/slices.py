"""How the optimizer walks a unit, and how a release run's gradient reaches it in chunks.

AdamW runs over a unit's trained segments in slices of at most `SLICE` elements (the pure-torch
path's temporaries stay small; a slice never crosses a segment, so a lean segment's 8-bit blocks
are whole in it). A release run on one rank (optim.grad_release, state.pool) sends each unit's
gradient to the host in `spans`: runs of consecutive slices at most `elems` elements long, each
landing in a fixed-size buffer whose slices are updated as soon as it is in. The optimizer makes
the same slice calls whichever buffer a slice's gradient sits in, so chunked and whole updates
are the same arithmetic, element for element.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .layout import Segment

SLICE = 1 << 22  # elements per update call (16 MiB of fp32)


def slices(
    segments: Iterable[Segment], lo: int = 0, hi: int | None = None
) -> Iterator[tuple[Segment, int, int]]:
    """(segment, a, b): the unit's elements [a, b) one update call reads, in order; only those
    inside [lo, hi) (a release chunk's: a run of whole slices), found without walking the rest."""
    for seg in segments:
        end = seg.end if hi is None else min(seg.end, hi)
        first = seg.start + max(0, -(-(lo - seg.start) // SLICE)) * SLICE  # the first slice at >= lo
        for a in range(first, end, SLICE):
            b = min(seg.end, a + SLICE)
            if b <= end:
                yield seg, a, b


def spans(segments: Iterable[Segment], elems: int) -> list[tuple[int, int]]:
    """[a, b) ranges of the unit, each a run of whole slices at most `elems` (>= SLICE) long;
    elements in no segment (frozen) between two slices are carried along, never alone."""
    out: list[tuple[int, int]] = []
    for _, a, b in sorted(slices(segments), key=lambda s: s[1]):
        if out and b - out[-1][0] <= elems:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
