"""Units streamed narrower than the compute dtype: a bf16 copy computed with in fp32.

Two kinds of unit stream in bf16 while the run computes in fp32: `optim.memory: lean`'s trained
units (their bf16 weight is the storage format: state.host) and, where there is a link to cross
(CUDA, or an emulated one: runtime.transport), the dense units of a frozen base read from a bf16
store (state.frozen). Their bytes cross the link as held and are upcast on the device, just
before the compute that reads them, into a buffer of the compute dtype, as state.frozen expands
NF4 layers. bf16 -> fp32 is exact, so a layer computes with the very weights a host-side
conversion would have given it; its weight gradients are the fp32 leaves' (engine.params), summed
and sent as before.

The buffers (`attach`): one the size of the largest narrow decoder layer, which each layer is
upcast into in turn (a layer's graph is given up before the next layer's upcast: invariant 3),
one of its own for each kept layer (its graph holds its weights until its backward, while the
shared buffer serves the other layers) and for the head and a tied embedding (the loss head reads
them between the forward and the backward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch

from ..store import UnitLayout


class Narrow(Protocol):
    """A unit as held on the host (state.host.UnitState, state.frozen.FrozenUnit)."""

    @property
    def stream(self) -> torch.Tensor: ...
    @property
    def layout(self) -> UnitLayout: ...
    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]: ...


def is_narrow(stream: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a streaming copy is a narrower float than the compute dtype (bf16 under fp32)."""
    return stream.dtype.is_floating_point and stream.dtype.itemsize < dtype.itemsize


class Widen:
    def __init__(self, units: Mapping[str, Narrow], dtype: torch.dtype):
        self.units, self.dtype = units, dtype
        self.narrow = {u for u, st in units.items() if is_narrow(st.stream, dtype)}
        self.scratch: torch.Tensor | None = None  # the decoder layers' shared buffer
        self.own: dict[str, torch.Tensor] = {}  # kept layers, the head, a tied embedding
        self._views: dict[str, dict[str, torch.Tensor]] = {}

    def attach(
        self,
        device_empty: Callable[[int, torch.dtype], torch.Tensor],
        layers: Iterable[str],
        own: Iterable[str] = (),
    ) -> int:
        """Allocate the device buffers (zeroed: padding is never written): the shared one for
        `layers`, one each for `own` (kept layers, the head, a tied embedding); their bytes."""
        shared = [self.units[u].layout.numel for u in layers if u in self.narrow]
        if shared:
            self.scratch = device_empty(max(shared), self.dtype)
            self.scratch.zero_()
        for u in own:
            if u in self.narrow:
                self.own[u] = device_empty(self.units[u].layout.numel, self.dtype)
                self.own[u].zero_()
        bufs = ([self.scratch] if self.scratch is not None else []) + list(self.own.values())
        return sum(b.numel() * b.element_size() for b in bufs)

    def __call__(self, unit: str, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A loaded unit's tensors by name in the compute dtype: a narrow unit's upcast on the
        device into its buffer (each tensor copied: exact), any other's as they are."""
        if unit not in self.narrow:
            return w
        out = self._views.get(unit)
        if out is None:
            buf = self.own.get(unit, self.scratch)
            assert buf is not None, f"{unit}: no upcast buffer attached"
            out = self._views[unit] = self.units[unit].views(buf)
        for name, dst in out.items():
            dst.copy_(w[name])
        return out
