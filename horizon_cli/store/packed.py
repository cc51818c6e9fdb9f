"""Packed units: the byte layout of a decoder layer in a quantized (NF4) store.

A quantized store keeps the element layout of every unit (store.layout: where each tensor sits in
the dense buffer the engine computes with) and adds, for decoder layers, a byte layout of the unit
file: each slot (checkpoint tensor) is a region of its own, starting on a REGION-byte boundary,
holding either the tensor's raw bytes in the store dtype (norms, biases, tensors that are not whole
NF4 blocks, and in a routed layer the small gates that decide routing: `kept`) or its NF4 parts
(quant/nf4.py) in the layout of the store's scheme (`scheme_of`: bitsandbytes' since version 5).
The embedding and the head stay dense and keep the plain layout. A packed layer crosses the link
as these bytes and is dequantized into the dense layout on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..arch import ArchSpec
from ..arch.names import is_expert
from ..quant import nf4
from .layout import UnitLayout, round_up
from .manifest import VERSION_QUANT

REGION = 128  # bytes


def scheme_of(version: int) -> str:
    """The NF4 layout of a quantized store of this manifest version: bitsandbytes' from version 5
    on, torchao's arithmetic before (versions 3 and 4, read only)."""
    return "bnb" if version >= 5 else "torchao"


@dataclass(frozen=True)
class PackedSlot:
    name: str
    hf: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the unit file
    nbytes: int
    numel: int
    dense: int  # element offset of the tensor in the dense layout
    quant: str  # "" (raw, store dtype) | "nf4"


@dataclass(frozen=True)
class PackedLayout:
    name: str
    slots: tuple[PackedSlot, ...]
    nbytes: int  # bytes of the unit, REGION aligned
    scheme: str = nf4.SCHEME  # the NF4 layout of its quantized slots (quant/nf4.py)

    def slot(self, name: str) -> PackedSlot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(f"{self.name} has no tensor {name!r}")


def packs(unit: str, quant: str) -> bool:
    """Which units a store with `quant` packs: decoder layers only."""
    return bool(quant) and unit.startswith("layer.")


def kept(spec: ArchSpec, lay: UnitLayout) -> frozenset[str]:
    """Slots of a decoder layer kept in the store dtype though NF4 could hold them: biases (gpt-oss
    stacks its experts' as (E, 2I) matrices), and in a routed layer every weight outside the
    experts with at most E output rows: the router's (E, hidden) and a shared expert's (1, hidden)
    gate. 4-bit error there can flip which experts a token picks, and these are at most E x hidden
    elements a layer. QLoRA practice agrees: bitsandbytes replaces only nn.Linear modules, and
    transformers 5's routers are their own modules, so they stay in the compute dtype.
    """
    moe = spec.kind.moe
    routed = moe is not None and int(lay.name.split(".")[1]) in moe.layers
    keep = set()
    for p in lay.tensors:
        gate = (
            routed
            and moe is not None
            and len(p.shape) == 2
            and p.shape[0] <= moe.n_experts
            and not is_expert(p.name, tuple(p.shape), moe)
        )
        if gate or p.name.endswith("bias") or p.dtype is not None:  # an integer table: as it is
            keep |= {s.name for s in lay.slots if p.offset <= s.offset < p.offset + p.numel}
    return frozenset(keep)


def packed_layout(
    spec: ArchSpec, lay: UnitLayout, itemsize: int, quant: str, version: int = VERSION_QUANT
) -> PackedLayout:
    """The packing a quantized store of manifest `version` has: version 3's from before `kept`
    (every tensor of whole blocks NF4, routers and expert biases included); the NF4 layout by
    `scheme_of(version)`."""
    if quant != "nf4":
        raise ValueError(f"unknown quantization {quant!r}")
    keep = frozenset() if version <= 3 else kept(spec, lay)
    scheme = scheme_of(version)
    out, off = [], 0
    for s in lay.slots:
        q = "nf4" if nf4.quantizable(s.shape) and s.name not in keep else ""
        n = nf4.nbytes(s.numel, itemsize, scheme) if q else s.numel * itemsize
        out.append(PackedSlot(s.name, s.hf, s.shape, off, n, s.numel, s.offset, q))
        off = round_up(off + n, REGION)
    return PackedLayout(lay.name, tuple(out), max(off, REGION), scheme)
