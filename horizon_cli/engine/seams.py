"""The typed seams between the engine's parts: what each part asks of the others (engine.parts
assembles them; every implementation is chosen once, at build time).

    Transport      the device: copies, events, memory (runtime.transport; CPU and CUDA)
    LayerTemplate  the layer template: one architecture's layer, head and step hooks
                   (model.template.NativeTemplate, model.generic.GenericTemplate), tiled by its
                   `seq_tile` (engine.seq_tile, given when it is made)
    LayerCall      one call of a layer over one micro-batch, handed to the template as a frozen
                   value (model.call: call, layer, micro-batch, step, train or eval, tile, adapters)
    EmbeddingTable the embedding's rows and gradient (engine.embed: HostEmbedding, ShardedEmbedding)
    Embedding      the stage before layer 0 (engine.embed.TextStage; vision.embed.VisionEmbedding)
    Params         what is trained (engine.params: FullParams, LoraParams, FrozenParams)
    HeadGrads      whether and how the head and the embedding get gradients (engine.headgrad)
    Reduce         where gradients go (engine.reduce: LocalReduce, ShardedReduce)
    LossObjective  what the loss head computes (engine.objective; each recipe's loss, recipes/)
    LayerPass      what one call of a layer does in a sweep (engine.passes, generate.decode)

The template's per-micro-batch context, its generation cache and what a kept layer's forward
holds are the template's own: the engine only hands them back (`Context`, `Cache`, `Held`, typed
`object` here). The templates annotate them with their own types (model.layer.AttnContext,
model.generic_context.GenericContext), narrower than the protocol's, which a strict structural check
reports; the engine never builds or reads one, so only the template's own methods see them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from ..data.batch import DecodeBatch, MicroBatch
from ..lora.linear import LayerLora
from ..lora.setup import LoraSetup
from ..model.call import LayerCall
from ..model.head import LM
from ..optim.adamw import AdamWHyper
from ..runtime.events import Event
from ..runtime.loader import Load
from ..runtime.transport import Transport
from ..state.frozen import FrozenState, FrozenUnit
from ..state.host import HostState, UnitState
from .grads import Chunks, GradSums
from .objective import Head, HeadOut, Targets
from .sharded import ShardedGrads
from .stats import Kinds

__all__ = [
    "Transport",
    "LayerTemplate",
    "LayerCall",
    "Embedding",
    "EmbeddingTable",
    "Params",
    "HeadGrads",
    "Reduce",
    "LossObjective",
    "LayerPass",
]

Weights = dict[str, torch.Tensor]  # a loaded unit's tensors by name
Context = object  # per micro-batch: the template's positions, masks, rotary tables
Cache = object  # per micro-batch: the template's generation cache (transformers' Cache)
Held = object  # what a kept layer's forward holds for its backward (the template's)
Stats = dict[str, torch.Tensor]  # an objective's sums over this rank's data
B = TypeVar("B", MicroBatch, DecodeBatch)  # a training micro-batch or a generation's
Inputs = Sequence[MicroBatch | DecodeBatch]  # what a sweep embeds: a step's or a generation's


class LayerTemplate(Protocol):
    calls: list[int]  # the layer of each call (arch.calls: a loop calls some more than once)
    embed_scale: float | None
    stochastic: bool  # its model drops (or adds router noise) in train mode (engine.dropout)
    dropout_on: bool  # this run trains with it: set once by engine.dropout
    seq_tile: int  # tokens per tile of its layers' token-local parts (engine.seq_tile; 0: untiled)

    def train_mode(self, on: bool, call: int) -> None: ...  # inside a training call's dropout scope
    def across_ranks(self, all_sum: Callable[[torch.Tensor], None]) -> None: ...  # sharded: sum in place

    def context(self, mb: MicroBatch, dtype: torch.dtype, device: torch.device) -> Context: ...
    def gen_context(
        self, db: DecodeBatch, cache: Cache, dtype: torch.dtype, device: torch.device
    ) -> Context: ...
    def forward(self, w: Weights, x: torch.Tensor, ctx: Context, call: LayerCall) -> torch.Tensor: ...
    def objective(
        self, w: Weights, x: torch.Tensor, ctx: Context, call: LayerCall
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def forward_held(
        self, w: Weights, x: torch.Tensor, ctx: Context, call: LayerCall
    ) -> tuple[torch.Tensor, Held]: ...
    def held_objective(self, held: Held, ctx: Context) -> torch.Tensor | None: ...
    def add_side_grads(self, j: int, dx: list[torch.Tensor], ctxs: list[Context]) -> None: ...
    def side_inputs(self, i: int, ctx: Context) -> list[torch.Tensor]: ...
    def side_grads(self, i: int, ctx: Context, grads: tuple[torch.Tensor | None, ...]) -> None: ...
    def new_cache(self) -> Cache: ...
    def kv_row_numel(self) -> list[tuple[int, int | None]]: ...
    def begin_step(self) -> None: ...
    def end_forward(self) -> None: ...
    def step_stats(self) -> tuple[float | None, list[float]]: ...
    def head_tensors(self, w: Weights, embed: torch.Tensor | None) -> tuple[Weights, LM]: ...
    def final_norm(self, h: torch.Tensor, w: Weights) -> torch.Tensor: ...
    def logits(self, x: torch.Tensor, lm: LM) -> torch.Tensor: ...


class EmbeddingTable(Protocol):
    """The embedding's rows at a step's start and its gradient at its end (engine.embed)."""

    ahead: int  # loads begun before the rows are sent (layer 0's; a sharded table's gather first)

    def loads(self) -> list[Load]: ...  # loads before layer 0's (a sharded table's gather)
    def reserve(self, numel: int, grad: bool) -> None: ...  # host staging, sized once
    def forward(self, mbs: Inputs) -> list[torch.Tensor]: ...  # (b, T, H) each, not yet scaled
    def backward(self, dx: list[torch.Tensor], mbs: list[MicroBatch], ready: dict[str, Event]) -> float: ...
    def scale(self, x: list[torch.Tensor]) -> list[torch.Tensor]: ...  # the family's (Gemma: sqrt(H))


class Embedding(EmbeddingTable, Protocol):
    """The stage before layer 0: the table's rows and gradient, and what a stage in front of
    layer 0 adds (engine.embed.TextStage: nothing; vision.embed.VisionEmbedding: the image merge,
    its positions, its trained part), so neither the sweep nor the step asks which it is."""

    stage_trained: bool  # it trains something besides the table (layer 0 computes its input gradient)

    def positioned(self, mb: B) -> B: ...  # the micro-batch its layer context is built from
    def stage_backward(self, dx: list[torch.Tensor]) -> float: ...  # a frozen base: its trained part's
    def across_ranks(self, sharded: ShardedGrads) -> None: ...  # its trained part summed over ranks
    def update(self, h: AdamWHyper) -> None: ...  # its trained part's AdamW step
    def save_state(self, ck: Path) -> dict[str, int]: ...  # ... into a checkpoint (-> CRC32s)
    def load_state(self, ck: Path, sums: dict[str, int]) -> None: ...


class HeadGrads(Protocol):
    """The head's side of a training step: full fine-tuning trains the head and the embedding;
    adapters on a frozen base compute only the head's input gradient (engine.headgrad)."""

    def reserve(self, step_numel: int) -> None: ...
    def bind(self, head: Head) -> None: ...
    def send(self, ready: dict[str, Event], sq: list[torch.Tensor], chunks: Chunks) -> None: ...
    def embed_backward(
        self, dx: list[torch.Tensor], mbs: list[MicroBatch], ready: dict[str, Event]
    ) -> float: ...


class Params(Protocol):
    @property
    def layers(self) -> list[str]: ...
    @property
    def trained(self) -> list[str | None]: ...  # per layer, the unit its backward produces a gradient for
    @property
    def host(self) -> HostState: ...  # the trained units' state
    @property
    def units(self) -> dict[str, UnitState | FrozenUnit]: ...  # every unit's streaming copy
    @property
    def base(self) -> FrozenState | None: ...  # the frozen base (adapters on it), or None
    @property
    def lora(self) -> LoraSetup | None: ...  # the adapters computed with, or None
    @property
    def trains_head(self) -> bool: ...

    def head_grads(
        self, grads: GradSums, tmpl: LayerTemplate, reduce: Reduce, embedding: Embedding, tied: bool
    ) -> HeadGrads: ...

    def extras(self, i: int, ready: dict[str, Event]) -> tuple[list[torch.Tensor], list[Event]]: ...
    def extra_numel(self) -> int: ...
    def weights(self, i: int, w: Weights) -> Weights: ...
    def unit_weights(self, unit: str, w: Weights) -> Weights: ...  # the head, a tied embedding
    def layer_lora(self, i: int, extras: list[torch.Tensor], step: int, train: bool) -> LayerLora | None: ...
    def adapters(self, on: bool) -> contextlib.AbstractContextManager[None]: ...
    def leaves(
        self, i: int, w: Weights, extras: list[torch.Tensor], step: int
    ) -> tuple[Weights, LayerLora | None, list[torch.Tensor], list[str]]: ...
    def wants_dx(self, i: int) -> bool: ...
    def order(self) -> list[str]: ...
    def work_bytes(self, tokens: int, item: int) -> int: ...
    def transient_bytes(self, tokens: int, item: int, tile: int) -> int: ...
    def kept_bytes(self, tokens: int, item: int) -> int: ...
    def attach(self, device_empty: Alloc, dtype: torch.dtype, kept: list[str], own: list[str]) -> int: ...


class Alloc(Protocol):
    def __call__(self, numel: int, dtype: torch.dtype, /) -> torch.Tensor: ...


class Reduce(Protocol):
    def begin_step(self) -> None: ...
    def layer(self, unit: str, g: torch.Tensor, k: int, sq: list[torch.Tensor], chunks: Chunks) -> Event: ...
    def head(
        self, grads: GradSums, ready: dict[str, Event], sq: list[torch.Tensor], chunks: Chunks
    ) -> None: ...
    def total(
        self, loss_sum: torch.Tensor, sq: list[torch.Tensor], host_sq: float, stats: Stats
    ) -> tuple[float, float, dict[str, float]]: ...
    def eval_total(
        self, total: torch.Tensor, tokens: int, stats: Stats
    ) -> tuple[float, int, dict[str, float]]: ...
    def sum_vector(self, v: torch.Tensor) -> torch.Tensor: ...
    def drain(self) -> None: ...
    def unit_sq(self, unit: str, pieces: list[torch.Tensor]) -> float: ...


class LossObjective(Protocol):
    name: str

    @property
    def reductions(self) -> Kinds: ...  # its stats that are not sums (engine.stats)

    def targets(self, mbs: list[MicroBatch], device: torch.device) -> list[Targets]: ...
    def divisor(self, mbs: list[MicroBatch]) -> int: ...
    def across_ranks(self, all_sum: Callable[[torch.Tensor], None]) -> None: ...
    def train(self, head: Head, xs: list[torch.Tensor], targets: list[Targets], inv: float) -> HeadOut: ...
    def evaluate(
        self, head: Head, xs: list[torch.Tensor], targets: list[Targets]
    ) -> tuple[torch.Tensor, Stats]: ...


class LayerPass(Protocol):
    """One call of a layer in a sweep (engine.passes): what its load carries, and its compute."""

    kept: bool  # its forward load stays acquired for the backward (a kept layer)

    def extras(self, i: int) -> tuple[list[torch.Tensor], list[Event]]: ...
    def backward_load(self, j: int) -> Load | None: ...
    def run(self, j: int, i: int, x: list[torch.Tensor], ctxs: list[Context]) -> list[torch.Tensor]: ...
    def backward(
        self, j: int, dx: list[torch.Tensor], ctxs: list[Context], gv: Weights | None
    ) -> None: ...  # gv: the trained unit's gradient views (None: the layer trains nothing)
