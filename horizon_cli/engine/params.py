"""What a run trains, decided once: every unit (full fine-tuning) or adapters on a frozen base (LoRA).

The step (engine.step) asks its strategy, never `if lora`:

    host         the trained units' state (state.host: streaming copy, gradient, optimizer state)
    units        every unit's streaming copy by name, what the loader streams (LoRA: the frozen
                 base's too)
    trained      per decoder layer, the unit whose gradient its backward produces (None: none)
    extras(i)    host tensors that travel with layer i's weights (LoRA: its adapters), and the
                 updates they wait for
    weights(i)   a loaded layer's tensors by name (NF4 layers dequantized on the device first,
                 narrow ones upcast: state.widen); unit_weights(name) the same for the head and a
                 tied embedding
    layer_lora   the adapters a layer computes with (None in full fine-tuning)
    adapters(on) a forward with the adapters on or off (LoRA: off is the base alone, a preference
                 run's reference; full fine-tuning has none to switch)
    leaves       what the backward recompute differentiates: the layer's trainable weights, or
                 its adapters
    trains_head  the head and the embedding get gradients (full) or not (LoRA: the head computes
                 only its input gradient, the embedding's backward is skipped)
    wants_dx(i)  the backward needs layer i's input gradient (LoRA: not below layer 0)
    order        the units in the order the CPU optimizer updates them (the next forward's)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ..lora.linear import LayerLora, layer_lora
from ..lora.setup import LoraSetup
from ..lora.sizes import adapter_kept_bytes, adapter_work_bytes
from ..lora.state import lora_state
from ..optim.modes import MemoryMode
from ..planning.transients import backward_transient_bytes
from ..runtime.events import READY, Event
from ..state.frozen import FrozenState, FrozenUnit
from ..state.host import HostState, UnitState
from ..state.widen import Widen
from ..store import Store
from ..store.layout import layouts
from .grads import GradSums
from .headgrad import FrozenHead, TrainedHead
from .seams import Embedding, HeadGrads, LayerTemplate, Params, Reduce

Alloc = Callable[[int, torch.dtype], torch.Tensor]
Progress = Callable[[int], None]  # bytes read so far
Shard = tuple[int, int]  # (world, rank)
Weights = dict[str, torch.Tensor]
Leaves = tuple[Weights, LayerLora | None, list[torch.Tensor], list[str]]


class FullParams:
    """Full fine-tuning: every unit is trained; the host holds its whole training state."""

    lora: LoraSetup | None = None
    base: FrozenState | None = None
    trains_head = True

    def __init__(
        self,
        store: Store,
        dtype: torch.dtype,
        grad_dtype: torch.dtype,
        alloc: Alloc,
        progress: Progress,
        mode: MemoryMode,
        shard: Shard,
    ) -> None:
        self.host = HostState(store, dtype, alloc, progress, grad_dtype, mode, shard)
        self.widen = Widen(self.host.units, dtype)  # lean computing in fp32: its bf16 weight upcast
        self.spec = store.arch
        self.layer_max = max(lay.numel for lay in layouts(store.arch) if lay.name.startswith("layer."))
        self.layers = [f"layer.{i}" for i in range(store.arch.n_layers)]
        self.trained: list[str | None] = list(self.layers)
        self.units: dict[str, UnitState | FrozenUnit] = dict(self.host.units)
        # per unit: the tensors that get gradients (frozen buffers such as a routing bias do not)
        self.names = {
            u: [p.name for p in st.layout.tensors if p.trainable] for u, st in self.host.units.items()
        }

    def extras(self, i: int, ready: dict[str, Event]) -> tuple[list[torch.Tensor], list[Event]]:
        return [], []

    def extra_numel(self) -> int:
        return 0

    def weights(self, i: int, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.widen(self.layers[i], w)

    def unit_weights(self, unit: str, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.widen(unit, w)

    def layer_lora(self, i: int, extras: list[torch.Tensor], step: int, train: bool) -> LayerLora | None:
        return None

    def adapters(self, on: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def leaves(self, i: int, w: Weights, extras: list[torch.Tensor], step: int) -> Leaves:
        """(weights to compute with, LayerLora or None, autograd leaves, their names): the layer's
        trainable weights as leaves of their own (views of the loaded buffer), frozen ones as
        they are."""
        names = self.names[self.layers[i]]
        leaves = [w[k].detach().requires_grad_(True) for k in names]
        return {**w, **dict(zip(names, leaves, strict=True))}, None, leaves, names

    def wants_dx(self, i: int) -> bool:
        return True

    def order(self) -> list[str]:
        # layer 0 first, so its transfer can start while the embedding (needed only on the host,
        # for the gather) is still being updated
        return [self.layers[0], "embed", *self.layers[1:], "head"]

    def work_bytes(self, tokens: int, item: int) -> int:
        return 0

    def transient_bytes(self, tokens: int, item: int, tile: int) -> int:
        """What a layer's backward holds beside its working set (planning.transients)."""
        return backward_transient_bytes(self.spec, tokens, self.layer_max, item, tile)

    def kept_bytes(self, tokens: int, item: int) -> int:
        return 0

    def attach(self, device_empty: Alloc, dtype: torch.dtype, kept: list[str], own: list[str]) -> int:
        """lean computing in fp32: the buffers its bf16 weights are upcast into (state.widen)."""
        return self.widen.attach(device_empty, self.layers, [*kept, *own])

    def head_grads(
        self, grads: GradSums, tmpl: LayerTemplate, reduce: Reduce, embedding: Embedding, tied: bool
    ) -> HeadGrads:
        """The head and the embedding are trained."""
        return TrainedHead(self.host, grads, tmpl, reduce, embedding, tied)


class _OnFrozenBase:
    """Adapters (or none) riding on a frozen base (streaming copies only; NF4 layers dequantized
    on the device): what LoRA training and a forward-only engine share."""

    trains_head = False

    def __init__(
        self,
        store: Store,
        setup: LoraSetup | None,
        dtype: torch.dtype,
        grad_dtype: torch.dtype,
        alloc: Alloc,
        progress: Progress,
        shard: Shard,
        narrow: bool = False,
    ) -> None:
        self.lora = setup
        self.base, self.host, self.trained = lora_state(
            store, setup, dtype, grad_dtype, alloc, progress, shard, narrow
        )
        self.layers = [f"layer.{i}" for i in range(store.arch.n_layers)]
        self.spec = store.arch
        self.units: dict[str, UnitState | FrozenUnit] = {**self.base.units, **self.host.units}
        self.names = {
            u: [p.name for p in st.layout.tensors if p.trainable] for u, st in self.host.units.items()
        }
        self.off = False  # adapters switched off: forwards run the base alone

    def extras(self, i: int, ready: dict[str, Event]) -> tuple[list[torch.Tensor], list[Event]]:
        """Layer i's adapters as a load's extra tensor, and the update they wait for."""
        u = self.trained[i]
        if u is None:
            return [], []
        return [self.host[u].stream], [ready.get(u, READY)]

    def extra_numel(self) -> int:
        return max((st.layout.numel for st in self.host.units.values()), default=0)

    def weights(self, i: int, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A layer's weights by name: an NF4 layer is dequantized on the device first."""
        assert self.base is not None
        return self.base.weights(self.layers[i], w)

    def unit_weights(self, unit: str, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The head's (a tied embedding's) tensors: upcast first where the base is narrow."""
        assert self.base is not None
        return self.base.weights(unit, w)

    def _lora(
        self, i: int, extras: list[torch.Tensor], step: int, train: bool, grad: bool
    ) -> tuple[LayerLora | None, list[torch.Tensor], list[str]]:
        u = self.trained[i]
        if u is None:
            return None, [], []
        st = self.host[u]
        names = [p.name for p in st.layout.tensors]
        assert self.lora is not None  # a lora.{i} unit exists only with a setup
        lora, leaves = layer_lora(self.lora, st.views(extras[0]), names, i, step, train, grad)
        return lora, leaves, names

    def layer_lora(self, i: int, extras: list[torch.Tensor], step: int, train: bool) -> LayerLora | None:
        """Layer i's adapters for a forward (dropout only when `train`), or None (switched off)."""
        return None if self.off else self._lora(i, extras, step, train, grad=False)[0]

    @contextlib.contextmanager
    def adapters(self, on: bool) -> Iterator[None]:
        was, self.off = self.off, not on
        try:
            yield
        finally:
            self.off = was

    def leaves(self, i: int, w: Weights, extras: list[torch.Tensor], step: int) -> Leaves:
        """(weights, adapters, their autograd leaves in layout order, their names): the base's
        weights are constants of the recompute."""
        lora, leaves, names = self._lora(i, extras, step, train=True, grad=True)
        return w, lora, leaves, names

    def wants_dx(self, i: int) -> bool:
        return i > 0  # nothing below layer 0 needs its input gradient

    def order(self) -> list[str]:
        return [u for u in self.trained if u is not None]

    def transient_bytes(self, tokens: int, item: int, tile: int) -> int:
        """What a layer's backward holds beside its working set (planning.transients): the
        adapters' weight gradients (a forward-only engine: none), attention's dQ and grouped dK/dV."""
        return backward_transient_bytes(self.spec, tokens, self.extra_numel(), item, tile)

    def work_bytes(self, tokens: int, item: int) -> int:
        """The adapters' outputs in a layer's working set, held for the backward."""
        assert self.lora is not None
        return adapter_work_bytes(self.lora.targets, self.lora.cfg.r, tokens, item)

    def kept_bytes(self, tokens: int, item: int) -> int:
        """What the adapters add to a kept layer's graph for one micro-batch (lora.sizes)."""
        assert self.lora is not None
        c = self.lora.cfg
        return adapter_kept_bytes(self.lora.targets, c.r, c.dropout, tokens, item)

    def attach(self, device_empty: Alloc, dtype: torch.dtype, kept: list[str], own: list[str]) -> int:
        """NF4: the device buffer one layer is dequantized into, and one of its own for each kept
        layer; a narrow base's upcast buffers likewise, and the head's (`own`); their bytes (0:
        nothing is packed or narrow)."""
        assert self.base is not None
        return self.base.attach(device_empty, dtype, kept, own)

    def head_grads(
        self, grads: GradSums, tmpl: LayerTemplate, reduce: Reduce, embedding: Embedding, tied: bool
    ) -> HeadGrads:
        """The head computes its input gradient only; the embedding's backward is skipped."""
        return FrozenHead(embedding)


class LoraParams(_OnFrozenBase):
    """LoRA: a frozen base and the adapters, units of their own (lora.{i}) that travel with their
    layer and alone get gradients."""

    def __init__(
        self,
        store: Store,
        setup: LoraSetup,
        dtype: torch.dtype,
        grad_dtype: torch.dtype,
        alloc: Alloc,
        progress: Progress,
        shard: Shard,
        narrow: bool = False,
    ) -> None:
        super().__init__(store, setup, dtype, grad_dtype, alloc, progress, shard, narrow)


class FrozenParams(_OnFrozenBase):
    """Forward only (generation, evaluation, a reference pass): every unit frozen — its streaming
    copy only, no master, moments or gradients (an NF4 store's layers stay packed and are
    dequantized on the device); with a LoRA setup (its `init`: the adapters to apply) the
    adapters ride with their layers as in training, dropout off; without one, no lora.{i} unit
    exists."""


def make_params(
    store: Store,
    lora: LoraSetup | None,
    dtype: torch.dtype,
    grad_dtype: torch.dtype,
    alloc: Alloc,
    progress: Progress,
    mode: MemoryMode,
    shard: Shard,
    forward_only: bool = False,
    narrow: bool = False,
) -> Params:
    """narrow: a frozen base read from a store narrower than `dtype` stays as stored on the host
    and is upcast on the device (state.frozen: where there is a link to cross)."""
    if forward_only:
        return FrozenParams(store, lora, dtype, grad_dtype, alloc, progress, shard, narrow)
    if lora is None:
        return FullParams(store, dtype, grad_dtype, alloc, progress, mode, shard)
    return LoraParams(store, lora, dtype, grad_dtype, alloc, progress, shard, narrow)
