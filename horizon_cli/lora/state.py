"""The host state of a LoRA run's adapters: one trained unit `lora.{i}` per adapted decoder layer.

Where they live (docs/engine.md, "LoRA on a streamed base", says why): on the host, with the full
training state of a unit (streaming copy, exact fp32 master, AdamW moments, gradient: state.host's
UnitState), streamed to the device *with their layer* (a load's extra tensors) and updated by the
CPU AdamW worker like any unit. So the device holds one layer's adapters at a time (invariant 1)
and they cost the link r * (in + out) elements per adapted linear layer.

    unit lora.{i}   for each adapted linear layer t of decoder layer i, in module order:
                    <t.weight>.lora_A (r, in) then <t.weight>.lora_B (out, r), each ALIGN aligned
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..optim.modes import EXACT
from ..state.frozen import FrozenState
from ..state.host import HostState, UnitState
from ..state.layout import WholeExact, exact_state
from ..store.layout import ALIGN, Param, Slot, UnitLayout
from . import peft
from .setup import LoraSetup
from .targets import Target


def unit_name(i: int) -> str:
    return f"lora.{i}"


def adapter_layout(i: int, targets: list[Target], r: int) -> UnitLayout:
    slots, off = [], 0
    for t in targets:
        for which, shape in (("A", (r, t.in_features)), ("B", (t.out_features, r))):
            n = shape[0] * shape[1]
            slots.append(Slot(f"{t.weight}.lora_{which}", peft.key(t.module, which), shape, off, n))
            off = (off + n + ALIGN - 1) // ALIGN * ALIGN
    numel = max(off, ALIGN)
    params = tuple(Param(s.name, s.hf, s.shape, s.offset, s.numel) for s in slots)
    return UnitLayout(unit_name(i), tuple(slots), numel, params, numel)


def initial_adapters(setup: LoraSetup) -> dict[str, torch.Tensor]:
    """PEFT key -> fp32: lora.init's tensors, or PEFT's default init (A Kaiming-uniform as
    nn.Linear's, from a generator seeded with train.seed; B zero, so training starts at the base)."""
    if setup.init is not None:
        return setup.init
    g = torch.Generator().manual_seed(setup.seed)
    out = {}
    for layer in [*setup.targets, setup.tower]:  # the tower's (a projector's) last
        for t in layer:
            a = torch.empty(setup.r, t.in_features)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
            out[peft.key(t.module, "A")] = a
            out[peft.key(t.module, "B")] = torch.zeros(t.out_features, setup.r)
    return out


class AdapterState(HostState):
    """The trained units of a LoRA run (lora.{i}); the same UnitState as full fine-tuning's units."""

    def __init__(
        self,
        setup: LoraSetup,
        dtype: torch.dtype,
        alloc: Callable[[int, torch.dtype], torch.Tensor],
        grad_dtype: torch.dtype = torch.float32,
    ):
        self.dtype, self.grad_dtype, self.mode, self.scheme = dtype, grad_dtype, EXACT, WholeExact()
        self.units: dict[str, UnitState] = {}
        for i, targets in enumerate(setup.targets):
            if not targets:
                continue
            lay = adapter_layout(i, targets, setup.r)
            n = lay.numel
            grad = alloc(n, grad_dtype)
            grad.zero_()
            state = exact_state(n, dtype == torch.bfloat16)  # adapters are small: always exact
            self.units[lay.name] = UnitState(
                lay.name, lay, self.scheme, alloc(n, dtype), grad, self.scheme.segments(lay), state
            )
        self.set_tensors(initial_adapters(setup))

    def set_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set every adapter's fp32 master (streaming copy and remainder with it), PEFT keys."""
        for st in self.units.values():
            master = torch.zeros(st.layout.numel, dtype=torch.float32)
            for s in st.layout.slots:
                master[s.offset : s.offset + s.numel] = tensors[s.hf].reshape(-1)
            st.set_master(master)

    def tensors(self) -> dict[str, torch.Tensor]:
        """PEFT key -> the fp32 master of every adapter matrix."""
        out = {}
        for st in self.units.values():
            master = st.master()
            for s in st.layout.slots:
                out[s.hf] = master[s.offset : s.offset + s.numel].view(s.shape).clone()
        return out


class NoAdapters(AdapterState):
    """A frozen base computed alone (a forward-only engine without adapters): no lora.{i} unit."""

    def __init__(self, dtype: torch.dtype, grad_dtype: torch.dtype = torch.float32):
        self.dtype, self.grad_dtype, self.mode, self.scheme = dtype, grad_dtype, EXACT, WholeExact()
        self.units = {}


def lora_state(
    store,
    setup: LoraSetup | None,
    dtype,
    grad_dtype,
    alloc,
    progress,
    shard: tuple[int, int] = (1, 0),
    narrow: bool = False,
) -> tuple[FrozenState, AdapterState, list[str | None]]:
    """A LoRA run's host state: the frozen base, the adapters, and per decoder layer its adapter
    unit (None where no linear layer is adapted). Sharded runs (shard): the base is sharded, the
    adapters (under 1 % of the parameters) are whole on every rank. setup None: the base alone.
    narrow: the base stays in a narrower store dtype, upcast on the device (state.frozen)."""
    base = FrozenState(store, dtype, alloc, progress, shard, narrow)
    host = NoAdapters(dtype, grad_dtype) if setup is None else AdapterState(setup, dtype, alloc, grad_dtype)
    trained = [u if u in host.units else None for u in map(unit_name, range(store.arch.n_layers))]
    return base, host, trained
