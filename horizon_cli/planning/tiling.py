"""Sequence tiles in the memory plan (`engine.seq_tile`, model.tiling): the layer working set with
the token-local block's intermediates counted for one tile, the tile `auto` picks, and the longest
sequence a plan fits.

    with_tile  the plan's `layer working set` row for a tile of N tokens (planning.memory
               layer_work_bytes(tile=N)); the untiled figure kept beside it (`untiled_work`)
    auto       untiled (0) when the untiled plan fits the machine; else the largest tile of
               TILES that fits what the rest of the plan leaves free; none fitting: the smallest
               (the fit check then refuses the run with the plan's figures); no machine: untiled
    longest    the longest sequence (a multiple of STEP tokens) whose plan fits the machine, by
               bisection over plans that each pick their tile as `auto` does

Only the device's working set and a kept layer's graph depend on the tile: the layer's input and
output and one row's K/V (natively: its queries run per tile; transformers' layers keep their
attention whole) stay whole, and so do the saved layer inputs on the host (L x batch x seq x
hidden: at long context the host term that grows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..arch import ArchSpec
from ..arch.tiling import note as block_note
from .fit import RESERVE, Machine
from .memory import MemoryPlan, kept_graph_bytes, layer_work_bytes
from .transients import backward_transient_bytes

WORK = "layer working set"
TILES = tuple(1 << k for k in range(20, 7, -1))  # 1M ... 256 tokens, largest first
STEP = 1024
TRANSIENTS = "backward transients"  # planning.memory's row


def with_tile(
    plan: MemoryPlan,
    spec: ArchSpec,
    tile: int,
    tokens: int,
    rows: int,
    T: int,
    item: int,
    adapters: Callable[[int], int] | None = None,
) -> MemoryPlan:
    """The plan (planned untiled) with its layer working set for `tile` tokens per tile, and a
    kept layer's graphs as the tiled layer saves them (planning.memory.kept_graph_bytes; the
    adapters' part of them as untiled). adapters: tile -> the LoRA adapters' share of the working
    set (lora.sizes.adapter_work_bytes)."""
    untiled = plan.device[WORK]
    if tile <= 0 or tile >= tokens:
        return replace(plan, seq_tile=0 if tile <= 0 else tile, untiled_work=untiled)
    cut = layer_work_bytes(spec, tokens, rows, T, item) - layer_work_bytes(spec, tokens, rows, T, item, tile)
    if adapters is not None:
        cut += adapters(0) - adapters(tile)
    device = {**plan.device, WORK: untiled - cut}
    if TRANSIENTS in device:  # the native layer's dQ accumulator: one query tile's (planning.transients)
        layer = device[TRANSIENTS] - backward_transient_bytes(spec, tokens, 0, item)
        device[TRANSIENTS] = layer + backward_transient_bytes(spec, tokens, 0, item, tile)
    weights, graphs = plan.kept_layer
    if graphs:
        v = plan.kept_vectors
        graphs -= plan.kept_mbs * (
            kept_graph_bytes(spec, tokens, rows, T, item, v)
            - kept_graph_bytes(spec, tokens, rows, T, item, v, tile)
        )
    return replace(plan, device=device, seq_tile=tile, untiled_work=untiled, kept_layer=(weights, graphs))


def slack(plan: MemoryPlan, where: Machine) -> int:
    """Bytes the plan leaves free on `where` (negative: it does not fit): a node's host against
    the RAM, a rank's device against the device less RESERVE (both in RAM on `device: cpu`)."""
    if where.device is None:
        return where.host - plan.node_host_total - plan.node_device_total
    return min(where.host - plan.node_host_total, where.device - plan.device_total - RESERVE)


def auto_tile(at: Callable[[int], MemoryPlan], tokens: int, where: Machine | None) -> int:
    """at(tile) -> the plan with that tile. The tile `auto` picks (module doc)."""
    if where is None or slack(at(0), where) >= 0:
        return 0
    sizes = [t for t in TILES if t < tokens]
    for t in sizes:
        if slack(at(t), where) >= 0:
            return t
    return sizes[-1] if sizes else 0


def resolve(
    setting: int | str, at: Callable[[int], MemoryPlan], tokens: int, where: Machine | None
) -> MemoryPlan:
    """engine.seq_tile -> the plan with its tile (N: N tokens; 0: untiled; auto: as auto_tile)."""
    tile = auto_tile(at, tokens, where) if setting == "auto" else int(setting)
    return at(tile)


def longest(fits_at: Callable[[int], bool], lo: int, hi: int) -> int:
    """The longest multiple of STEP in [lo, hi] with fits_at(seq) (fits_at falls with seq), 0: none."""
    a, b = max(1, lo // STEP), hi // STEP
    if b < a or not fits_at(a * STEP):
        return 0
    while a < b:
        m = (a + b + 1) // 2
        a, b = (m, b) if fits_at(m * STEP) else (a, m - 1)
    return a * STEP


NATIVE_NOTE = (
    "every token-local part of every layer (norms, Q/K/V and output projections with RoPE, "
    "residuals, the MLP block); attention per query tile over its row's K/V (model.tiled_layer)"
)


def note(spec: ArchSpec) -> str:
    """What engine.seq_tile tiles in each layer of this model, in words (inspect, --dry-run);
    transformers' layers: their MLP/MoE blocks (arch.tiling)."""
    return spec.visit(lambda _: NATIVE_NOTE, block_note)
