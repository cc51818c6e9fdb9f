"""One rank's host state of full fine-tuning in the memory plan (planning.memory): the streaming
copy, the memory mode's optimizer state and its gradients, over the largest piece of each unit a
rank holds (parallel/shard.py).
"""

from __future__ import annotations

from ..arch import ArchSpec
from ..optim.modes import MemoryMode
from ..parallel.shard import SHARD_ALIGN, shard_range, shard_size
from ..state.host import compact_grad
from ..state.layout import StateKind, kind_numel, state_layout
from ..store import UnitLayout

ITEM = {"bfloat16": 2, "float32": 4}


def frozen_stream(stored: str, dtype: str, link: bool) -> str:
    """A frozen base's streaming dtype (state.frozen): a store narrower than the compute dtype is
    held and moved as stored where there is a link (upcast on the device), else the compute dtype."""
    return stored if link and stored in ITEM and ITEM[stored] < ITEM[dtype] else dtype


def piece(numel: int, world: int) -> int:
    """Elements of the largest piece of a flat buffer that one of `world` ranks holds."""
    return min(numel, shard_size(numel, world, SHARD_ALIGN))


def compact_rows(spec: ArchSpec, lays: dict, tokens: int, world: int) -> int | None:
    """Elements of the embedding's gradient the host holds when it keeps only the rows a step of
    `tokens` touches (state.host.compact_grad); None: all."""
    if not compact_grad(lays["embed"], spec.tie_embeddings, world):
        return None
    return min(spec.vocab, tokens) * spec.hidden


def trained_host(
    lays: dict, dtype: str, gitem: int, mode: MemoryMode, world: int = 1, embed_held: int | None = None
) -> dict[str, int]:
    """Host state of full fine-tuning, one rank's pieces: the streaming copy, the mode's optimizer
    state (exact: fp32 master + moments; lean: state/layout.py) and its gradients (release: chunks,
    or on several ranks buffers of the largest piece of a unit but the embedding; embed_held: the
    embedding gradient's elements held, compact_rows: MemoryMode.grad_bytes)."""
    numel = sum(piece(lay.numel, world) for lay in lays.values())
    embed = piece(lays["embed"].numel, world)
    largest = max(piece(lay.numel, world) for name, lay in lays.items() if name != "embed")

    def kinds() -> tuple[int, int]:
        counts = [rank_kinds(lay, world, mode) for lay in lays.values()]
        return sum(k[0] for k in counts), sum(k[1] for k in counts)

    host = {"weights (streaming copy)": numel * ITEM[dtype], **mode.state_bytes(numel, dtype, kinds)}
    host[mode.grad_label(gitem, world)] = mode.grad_bytes(numel, embed, gitem, largest, world, embed_held)
    return host


def rank_kinds(lay: UnitLayout, world: int, mode: MemoryMode) -> tuple[int, int]:
    """(lean, exact) trained elements in the piece of a packed unit that costs a rank the most
    host bytes (exact elements: 10 B of state, lean ones ~3.1 B)."""
    segs = state_layout(mode).segments(lay)
    if world == 1:
        return kind_numel(segs, StateKind.LEAN), kind_numel(segs, StateKind.EXACT)
    best = (0, 0)
    for r in range(world):
        a, b = shard_range(lay.numel, world, r, SHARD_ALIGN)
        n = dict.fromkeys(StateKind, 0)
        for s in segs:
            n[s.kind] += max(0, min(b, s.end) - max(a, s.start))
        lean, exact = n[StateKind.LEAN], n[StateKind.EXACT]
        if lean * 25 + exact * 80 > best[0] * 25 + best[1] * 80:  # 8x the bytes
            best = (lean, exact)
    return best
