"""The frozen base of a LoRA run: per unit, only the streaming copy (no master, moments, gradients).

Dense units (the embedding, the head, and every layer of an unquantized store) hold their flat
buffer in the compute dtype, as full fine-tuning's streaming copy; with `narrow` (a link to cross:
CUDA, or an emulated one) a store narrower than the compute dtype (bf16 under fp32) is held as
stored, crosses the link in its own bytes and is upcast on the device (state.widen). Packed
units (decoder layers of an NF4 store, store/packed.py) hold the unit file's bytes as they are:
they cross the link in 4 bits and `dequantize` expands them on the device, into one layer-sized
scratch buffer in the dense layout, just before the layer's compute. Nothing here is ever written after loading.

Sharded runs (`shard=(world, rank)`): a unit holds this rank's slice of its flat buffer (elements,
or a packed unit's bytes: parallel.shard.shard_range, align SHARD_ALIGN); the loader all-gathers it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..parallel.shard import SHARD_ALIGN, shard_range
from ..quant import nf4
from ..store import Store, UnitLayout
from ..store.packed import PackedLayout
from .widen import Widen

PACKED = "__packed__"  # views() of a packed unit: its raw bytes, to be dequantized


@dataclass
class FrozenUnit:
    name: str
    layout: UnitLayout  # the dense element layout (what the engine computes with)
    stream: torch.Tensor  # (numel,) compute dtype, or (nbytes,) uint8 for a packed unit
    packed: PackedLayout | None = None
    full: int = 0  # the whole unit's stream length (a sharded rank holds a slice of it)

    @property
    def full_numel(self) -> int:
        return self.full or self.stream.numel()

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.packed is not None:
            return {PACKED: flat}
        return {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.layout.tensors}

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"stream": self.stream}


class FrozenState:
    def __init__(
        self,
        store: Store,
        dtype: torch.dtype,
        alloc: Callable[[int, torch.dtype], torch.Tensor],
        progress: Callable[[int], None] = lambda n: None,
        shard: tuple[int, int] = (1, 0),
        narrow: bool = False,
    ):
        """shard: (world, rank) of a sharded run: this rank's slice of every unit. narrow: dense
        units of a store narrower than `dtype` stay as stored (upcast on the device)."""
        self.dtype, self.store_dtype = dtype, store.dtype
        # what a dense unit's streaming copy holds: the compute dtype, or the store's where narrower
        keep = narrow and store.dtype.is_floating_point and store.dtype.itemsize < dtype.itemsize
        self.stream_dtype = store.dtype if keep else dtype
        self.units: dict[str, FrozenUnit] = {}
        for u in store.units:
            lay = store.layout(u.name)
            packed = store.packed.get(u.name)
            if shard[0] > 1:
                self.units[u.name] = self._slice(store, u.name, lay, packed, alloc, shard)
                progress(u.nbytes)
                continue
            if packed is not None:
                buf = alloc(packed.nbytes, torch.uint8)  # pinned on CUDA: it crosses the link
                store.read_unit(u.name, buf)
            else:
                buf = alloc(lay.numel, self.stream_dtype)
                if store.dtype == self.stream_dtype:
                    store.read_unit(u.name, buf)
                else:
                    src = torch.empty(lay.numel, dtype=store.dtype)
                    store.read_unit(u.name, src)
                    buf.copy_(src)
            self.units[u.name] = FrozenUnit(u.name, lay, buf, packed)
            progress(u.nbytes)

        self.scratch: torch.Tensor | None = None  # the device buffer a packed layer expands into
        self.kept: dict[str, torch.Tensor] = {}  # kept layers: each expands into a buffer of its own
        self.widen = Widen(self.units, dtype)  # narrow dense units: upcast on the device

    def _slice(self, store: Store, name: str, lay, packed, alloc, shard) -> FrozenUnit:
        """This rank's slice of a unit (its checksums: train/sharded_checkpoint.verify_split)."""
        full = packed.nbytes if packed is not None else lay.numel
        a, b = shard_range(full, shard[0], shard[1], SHARD_ALIGN)
        src = store.unit_view(name)[a:b]
        buf = alloc(b - a, torch.uint8 if packed is not None else self.stream_dtype)
        buf.copy_(src)
        return FrozenUnit(name, lay, buf, packed, full)

    def __getitem__(self, unit: str) -> FrozenUnit:
        return self.units[unit]

    def attach(
        self, device_empty: Callable[[int, torch.dtype], torch.Tensor], dtype: torch.dtype, kept=(), own=()
    ) -> int:
        """Allocate the device buffer packed layers are dequantized into (the largest layer's dense
        layout, zeroed: padding is never written), and one per packed unit of `kept` (a kept layer's
        graph holds its weights until its backward, while the scratch buffer serves the next
        layer); narrow dense units' upcast buffers likewise (state.widen; `own`: the head and a
        tied embedding, on the device); their bytes (0: nothing is packed or narrow)."""
        layers = [u for u in self.units if u.startswith("layer.")]
        wide = self.widen.attach(device_empty, layers, [*kept, *own])
        packed = [u.layout.numel for u in self.units.values() if u.packed is not None]
        if not packed:
            return wide
        self.scratch = device_empty(max(packed), dtype)
        self.scratch.zero_()
        for u in kept:
            if self.units[u].packed is not None:
                self.kept[u] = device_empty(self.units[u].layout.numel, dtype)
                self.kept[u].zero_()
        bufs = [self.scratch, *self.kept.values()]
        return wide + sum(b.numel() * b.element_size() for b in bufs)

    def weights(self, unit: str, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A loaded unit's tensors by name: a packed one dequantized into the scratch buffer first
        (a kept layer: into its own), a narrow one upcast (state.widen)."""
        if PACKED not in w:
            return self.widen(unit, w)
        out = self.kept.get(unit, self.scratch)
        assert out is not None
        return self.dequantize(unit, w[PACKED], out)

    def dequantize(self, unit: str, raw: torch.Tensor, out: torch.Tensor) -> dict[str, torch.Tensor]:
        """A packed unit's bytes on the device -> its tensors, dense, in `out` ((numel,), compute
        dtype; padding elements are left as they are). Runs on the device, before the compute."""
        st = self.units[unit]
        assert st.packed is not None
        sd = self.store_dtype
        for p in st.packed.slots:
            src = raw[p.offset : p.offset + p.nbytes]
            dst = out[p.dense : p.dense + p.numel]
            if p.quant:
                if sd == out.dtype:
                    nf4.dequantize_packed(src, p.numel, sd, dst)
                else:
                    dst.copy_(
                        nf4.dequantize_packed(
                            src, p.numel, sd, torch.empty(p.numel, dtype=sd, device=out.device)
                        )
                    )
            else:
                dst.copy_(src.view(sd))
        return {q.name: out[q.offset : q.offset + q.numel].view(q.shape) for q in st.layout.tensors}

    def nbytes(self) -> dict[str, int]:
        n = sum(u.stream.numel() * u.stream.element_size() for u in self.units.values())
        return {"base (frozen)": n}
