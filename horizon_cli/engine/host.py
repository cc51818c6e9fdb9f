"""Host training state: per unit, the streaming copy, the fp32 master, AdamW moments, gradients.

Every buffer is flat and mirrors the unit's layout element for element, in anonymous memory
(pinned on CUDA) that the kernel never writes back to a file on its own (invariant 7):

  stream  (numel,) compute dtype   what the device streams; in fp32 runs it *is* the master
  lo      (numel,) int16           bf16 runs: the master's low half (optim.split), else None
  m, v    (numel,) fp32            AdamW moments
  grad    (numel,) grad dtype      gradients of the step, kept whole until the clip norm is known:
                                   accumulated in fp32 on the device, sent in `engine.grad_dtype`
                                   (bf16 runs: bf16, half the device->host traffic); the embedding's
                                   grad is always fp32, because the host accumulates it row by row

Host bytes per parameter: bf16 2 + 2 + 4 + 4 + 2 = 14; fp32 4 + 4 + 4 + 4 = 16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..optim.split import join, split_
from ..store import Store, UnitLayout


@dataclass
class UnitState:
    name: str
    layout: UnitLayout
    stream: torch.Tensor
    lo: torch.Tensor | None
    m: torch.Tensor
    v: torch.Tensor
    grad: torch.Tensor

    def master(self) -> torch.Tensor:
        """The fp32 master weights (a copy in bf16 runs, the stream itself in fp32 runs)."""
        return join(self.stream, self.lo) if self.lo is not None else self.stream

    def set_master(self, master: torch.Tensor) -> None:
        if self.lo is None:
            self.stream.copy_(master)
        else:
            split_(master, self.stream, self.lo)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of the tensors the engine computes with (layout.tensors), into any buffer
        laid out like this unit (host or device)."""
        return {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.layout.tensors}

    def buffers(self) -> dict[str, torch.Tensor]:
        out = {"stream": self.stream, "m": self.m, "v": self.v, "grad": self.grad}
        if self.lo is not None:
            out["lo"] = self.lo
        return out


class HostState:
    def __init__(
        self,
        store: Store,
        dtype: torch.dtype,
        alloc: Callable[[int, torch.dtype], torch.Tensor],
        progress: Callable[[int], None] = lambda n: None,
        grad_dtype: torch.dtype = torch.float32,
    ):
        self.dtype, self.grad_dtype = dtype, grad_dtype
        self.units: dict[str, UnitState] = {}
        for u in store.units:
            lay = store.layout(u.name)
            self.units[u.name] = self._load_unit(store, lay, alloc)
            progress(u.nbytes)

    def _load_unit(self, store: Store, lay: UnitLayout, alloc) -> UnitState:
        n = lay.numel
        lo = torch.zeros(n, dtype=torch.int16) if self.dtype == torch.bfloat16 else None
        m, v = torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32)
        grad = alloc(n, torch.float32 if lay.name == "embed" else self.grad_dtype)  # pinned on CUDA
        grad.zero_()
        st = UnitState(lay.name, lay, alloc(n, self.dtype), lo, m, v, grad)
        if store.dtype == self.dtype:
            store.read_unit(lay.name, st.stream)  # e.g. a bf16 store: the master is exactly it, lo = 0
        else:
            src = torch.empty(n, dtype=store.dtype)
            store.read_unit(lay.name, src)
            st.set_master(src.to(torch.float32))
        return st

    def __getitem__(self, unit: str) -> UnitState:
        return self.units[unit]

    def nbytes(self) -> dict[str, int]:
        """Bytes by category, for the memory report."""
        out: dict[str, int] = {}
        for st in self.units.values():
            for k, t in st.buffers().items():
                out[k] = out.get(k, 0) + t.numel() * t.element_size()
        return out
