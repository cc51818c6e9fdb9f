"""LoRA adapters in the engine: their host training state, and their arithmetic on the device.

Where they live (docs/engine.md, "LoRA on a streamed base", says why): on the host, one unit `lora.{i}` per adapted decoder
layer, with the full training state of a unit (streaming copy, exact fp32 master, AdamW moments,
gradient: engine.host's UnitState), streamed to the device *with their layer* (a load's extra
tensors) and updated by the CPU AdamW worker like any unit. So the device holds one layer's
adapters at a time (invariant 1: device memory does not grow with depth) and they cost the link
r * (in + out) elements per adapted linear layer, well under 1 % of the layer's weights.

    unit lora.{i}   for each adapted linear layer t of decoder layer i, in module order:
                    <t.weight>.lora_A (r, in) then <t.weight>.lora_B (out, r), each ALIGN aligned

The arithmetic is PEFT's Linear.forward: y = base(x) + lora_B(lora_A(dropout(x))) * scaling, with
scaling = alpha / r (alpha / sqrt(r) with use_rslora). Dropout masks come from a generator seeded
by (seed, optimizer step, layer, micro-batch, target), so the backward recompute draws the same
masks as the forward did.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..arch import ArchSpec
from ..config.schema import LoraConfig
from ..errors import InputError
from ..lora import peft
from ..lora.targets import Target, peft_note, resolve_targets, scale
from ..store.layout import ALIGN, Param, Slot, UnitLayout
from .frozen import FrozenState
from .host import HostState, UnitState, exact_state, segments


@dataclass
class LoraSetup:
    """A run's LoRA settings, resolved against the model."""

    cfg: LoraConfig
    targets: list[list[Target]]  # per decoder layer (empty: no adapter in that layer)
    scale: float
    seed: int
    init: dict[str, torch.Tensor] | None = None  # PEFT key -> fp32, from lora.init
    note: str = ""  # a warning for the user: the adapter does not load whole into peft (targets.peft_note)

    @property
    def r(self) -> int:
        return self.cfg.r

    def expected(self) -> dict[str, tuple[int, int]]:
        return peft.expected_shapes(self.targets, self.cfg.r)


def lora_setup(cfg: LoraConfig, spec: ArchSpec, seed: int = 0, read_init: bool = True) -> LoraSetup:
    """Resolve lora.targets (InputError naming what is wrong) and read lora.init (strictly), unless
    read_init is False: a resume starts from its checkpoint's adapters and needs no lora.init."""
    targets = resolve_targets(cfg.targets, spec)
    setup = LoraSetup(
        cfg, targets, scale(cfg.alpha, cfg.r, cfg.use_rslora), seed, note=peft_note(spec, targets)
    )
    if read_init:
        load_init(setup)
    return setup


def load_init(setup: LoraSetup) -> None:
    """setup.init from lora.init (when given), checked against the config and the targets."""
    cfg = setup.cfg
    if cfg.init and setup.init is None:
        init = Path(cfg.init)
        pcfg = peft.read_config(init)
        peft.check_config(pcfg, init, cfg.r, cfg.alpha, cfg.use_rslora)
        setup.init = peft.read_weights(init, setup.expected())


def lora_for(lora: LoraConfig | None, store, seed: int = 0, read_init: bool = True) -> LoraSetup | None:
    """A run's lora section resolved against its store (None: full fine-tuning). A 4-bit store
    cannot be fully fine-tuned: without a lora section it is refused."""
    if lora is None:
        if store.quant:
            raise InputError(
                f"model.path: {store.root} is a 4-bit ({store.quant}) store, which cannot be fully "
                "fine-tuned: add a lora: section (or convert without --quantize)"
            )
        return None
    return lora_setup(lora, store.arch, seed, read_init)


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
    for layer in setup.targets:
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
        self.dtype, self.grad_dtype, self.memory = dtype, grad_dtype, "exact"
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
                lay.name, lay, "exact", alloc(n, dtype), grad, segments(lay, "exact"), state
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


def lora_state(
    store, setup: LoraSetup, dtype, grad_dtype, alloc, progress, shard: tuple[int, int] = (1, 0)
) -> tuple[FrozenState, AdapterState, list]:
    """A LoRA run's host state: the frozen base, the adapters, and per decoder layer its adapter
    unit (None where no linear layer is adapted). Sharded runs (shard): the base is sharded, the
    adapters (under 1 % of the parameters) are whole on every rank."""
    base = FrozenState(store, dtype, alloc, progress, shard)
    host = AdapterState(setup, dtype, alloc, grad_dtype)
    trained = [u if u in host.units else None for u in map(unit_name, range(store.arch.n_layers))]
    return base, host, trained


class LayerLora:
    """One decoder layer's adapters on the device, called on each adapted linear layer's output."""

    def __init__(
        self,
        ab: dict[str, tuple[torch.Tensor, torch.Tensor]],
        scaling: float,
        dropout: float = 0.0,
        seed: int | None = None,
    ):
        """ab: weight name -> (A (r, in), B (out, r)); seed None: no dropout (evaluation)."""
        self.ab, self.scaling, self.p, self.seed = ab, scaling, dropout, seed
        self.order = {name: k for k, name in enumerate(ab)}
        self.mb = 0  # the micro-batch being computed (the schedule sets it)

    def __call__(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pair = self.ab.get(name)
        if pair is None:
            return y
        a, b = pair
        return y + F.linear(F.linear(self._dropout(name, x), a), b) * self.scaling

    def _dropout(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if not self.p or self.seed is None:
            return x
        g = torch.Generator(device=x.device)
        g.manual_seed(hash((self.seed, self.mb, self.order[name])) & ((1 << 63) - 1))
        keep = torch.rand(x.shape, generator=g, device=x.device) >= self.p
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    @staticmethod
    def from_views(views: dict[str, torch.Tensor], targets: list[Target], **kw) -> LayerLora:
        ab = {t.weight: (views[f"{t.weight}.lora_A"], views[f"{t.weight}.lora_B"]) for t in targets}
        return LayerLora(ab, **kw)


def layer_lora(
    setup: LoraSetup, st: UnitState, i: int, flat: torch.Tensor, step: int, train: bool, grad: bool
) -> tuple[LayerLora, list[torch.Tensor]]:
    """Layer i's adapters on the device (flat: unit lora.{i} as loaded), with their autograd leaves
    in layout order when `grad`; dropout only when `train` (seeded by the optimizer step)."""
    views = st.views(flat)
    leaves: list[torch.Tensor] = []
    if grad:  # autograd.grad never fills .grad: leaves of their own, views of the loaded buffer
        views = {k: v.detach().requires_grad_(True) for k, v in views.items()}
        leaves = [views[p.name] for p in st.layout.tensors]
    seed = step_seed(setup.seed, step, i) if train else None
    lora = LayerLora.from_views(
        views, setup.targets[i], scaling=setup.scale, dropout=setup.cfg.dropout, seed=seed
    )
    return lora, leaves


def step_seed(seed: int, step: int, layer: int) -> int:
    """A dropout seed per (run seed, optimizer step, layer): the same in forward and recompute."""
    return hash((seed, step, layer)) & ((1 << 62) - 1)
