"""The engine's parts, assembled once from a store and the run's settings.

    transport   the device: copies and ordering (runtime.transport on the CPU, runtime.cuda)
    params      what is trained: every unit, or adapters on a frozen base (engine.params)
    loader      streams units host -> device through `prefetch` buffers (runtime.loader)
    optimizer   the CPU AdamW worker, unit by unit (state.optimizer)
    tmpl        the layer template: native functional layer or transformers' own (model.template)
    grads       the device's fp32 gradient sums and their trip to the host (engine.grads)
    reduce      where gradients go: this process's host, or every rank's slice (engine.reduce)
    embedding   the embedding stage: on the host, or gathered on the device (engine.embed)
    objective   what the loss head computes (engine.objective)
    head        the head's and the embedding's gradients, or none (engine.headgrad)
    dropout     the training passes' dropout: seeded per call and micro-batch, or off (engine.dropout)

Each difference decided here (full or LoRA, one process or sharded, the objective) is one object
chosen once; the passes that use them (engine.step, engine.infer) never branch on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..arch import ArchSpec
from ..arch.calls import is_loop
from ..config.schema import EngineConfig, OptimConfig
from ..errors import InputError
from ..lora.setup import LoraSetup
from ..model.template import make_template
from ..parallel.comm import Dist
from ..runtime.device import make_transport
from ..runtime.dtype import grad_dtype_for
from ..runtime.dtype import resolve as resolve_dtype
from ..runtime.events import Poison
from ..runtime.loader import Loader
from ..runtime.trace import Tracer
from ..state.optimizer import OptimizerWorker
from ..store import DTYPES, Store
from ..store.manifest import DTYPE_NAMES
from .dropout import NoDropout, SeededDropout, dropout_for
from .embed import HostEmbedding, ShardedEmbedding, TextStage
from .grads import GradSums
from .objective import TokenCE
from .params import make_params
from .ranks import Ranks, ranks_for
from .reduce import LocalReduce, ShardedReduce
from .seams import (
    Embedding,
    EmbeddingTable,
    HeadGrads,
    LayerTemplate,
    LossObjective,
    Params,
    Reduce,
    Transport,
)
from .sharded import ShardedGrads

Stage = Callable[[EmbeddingTable, Transport, torch.dtype], Embedding]  # a stage around the table


@dataclass
class Parts:
    spec: ArchSpec
    cfg: EngineConfig
    ocfg: OptimConfig
    dtype: torch.dtype
    grad_dtype: torch.dtype
    t: Transport  # runtime.transport.CpuTransport or runtime.cuda.CudaTransport
    tracer: Tracer
    poison: Poison
    dist: Dist | None
    params: Params  # engine.params: FullParams, LoraParams or FrozenParams
    loader: Loader
    optimizer: OptimizerWorker
    tmpl: LayerTemplate  # model.template.NativeTemplate or model.generic.GenericTemplate
    grads: GradSums
    reduce: Reduce  # engine.reduce: LocalReduce or ShardedReduce
    embedding: Embedding  # the stage before layer 0: the table alone (TextStage) or a vision stage
    objective: LossObjective
    head: HeadGrads  # the head's and the embedding's gradients, or none (engine.headgrad)
    ranks: Ranks  # one process, or this rank of a sharded run (engine.ranks)
    keep: int = 0  # K: the last K layers keep graph and weights from forward to backward (engine.kept_layers)
    adam_step: int = 0  # optimizer steps applied (dropout masks are seeded by it)
    dropout: NoDropout | SeededDropout = field(default_factory=NoDropout)

    @property
    def layers(self) -> list[str]:
        return self.params.layers


def assemble(
    store: Store,
    engine: EngineConfig,
    optim: OptimConfig,
    *,
    tracer: Tracer | None = None,
    progress: Callable[[int], None] = lambda n: None,
    transport: Transport | None = None,
    lora: LoraSetup | None = None,
    dist: Dist | None = None,
    objective: LossObjective | None = None,
    step_numel: int = 0,
    keep: int = 0,
    forward_only: bool = False,
    dropout_seed: int | None = None,
    stage: Stage | None = None,
) -> Parts:
    """step_numel: one layer's inputs of the largest step (0: unknown), which sizes the loader's
    buffers for the saved inputs once. keep: K, the kept layers (the last K): each gets weight
    buffers of its own. forward_only: every unit frozen, nothing trained (engine.params.FrozenParams:
    generation, evaluation), and nothing kept. dropout_seed: the run's seed when it trains with the
    model's dropout (engine.dropout), None: dropout off. stage: what wraps the embedding stage (vision.embed:
    the image merge before layer 0)."""
    assert not (forward_only and keep), "a forward-only engine keeps no graphs"
    spec = store.arch
    dtype = DTYPES[resolve_dtype(engine, optim.mode).dtype]  # resolved already by train/profile
    grad_dtype = DTYPES[grad_dtype_for(engine.grad_dtype, DTYPE_NAMES[dtype], optim.mode)]
    tracer = tracer or Tracer(enabled=False)
    t = transport or make_transport(engine, tracer)
    dist = dist if dist is not None and dist.world > 1 else None
    if dist is not None:  # the collective thread on this rank's device (CUDA)
        dist.start(t.thread_init)
    shard = (dist.world, dist.rank) if dist else (1, 0)
    # with a link to cross, a frozen base narrower than the compute dtype crosses it as stored
    params = make_params(
        store,
        lora,
        dtype,
        grad_dtype,
        t.host_empty,
        progress,
        optim.mode,
        shard,
        forward_only,
        narrow=not t.shares_host,
    )
    tied = spec.tie_embeddings
    extra = params.extra_numel()
    loader = Loader(
        t,
        params.units,
        params.layers,
        ["head"] + (["embed"] if tied or dist else []),  # sharded: the embedding on the device
        engine.prefetch,
        extra_numel=step_numel + extra if step_numel else 0,
        extra_dtype=dtype,
        dist=dist,
        keep=keep,
        keep_extra_numel=extra,
    )
    optimizer = OptimizerWorker(params.host, optim.kernel, tracer, t.thread_init)
    # native functional layer, or transformers' own (with LoRA hooks on its linear modules)
    tile = engine.seq_tile if isinstance(engine.seq_tile, int) else 0  # auto: the plan's (train)
    tmpl: LayerTemplate = make_template(spec, t.device, lora.targets if lora else None, dtype, tile)
    calls = tmpl.calls  # the layer of each call (arch.calls: a loop calls some more than once)
    if is_loop(calls):
        name = f"{spec.family} runs its layers in a loop ({len(calls)} calls for {spec.n_layers} layers)"
        if dist is not None:
            raise InputError(f"{name}: sharded runs (torchrun) of such a model are not supported yet")
        if keep:
            raise InputError(
                f"engine.keep_activations: {keep}: {name}: kept layers are not supported; set 0 or auto"
            )
    repeated = sorted({u for i in calls if calls.count(i) > 1 and (u := params.trained[i]) is not None})
    sharded = ShardedGrads(dist, t, params.host, grad_dtype, replicated=lora is not None) if dist else None
    grads = GradSums(
        t,
        params.host,
        params.trained,
        grad_dtype,
        world=dist.world if dist else 1,
        full=params.trains_head,
        embed_on_device=tied or dist is not None,
        repeated=repeated,
    )
    t.memory.set("grad_acc", grads.nbytes() + (sharded.nbytes() if sharded else 0))
    table: EmbeddingTable
    if sharded is None:
        reduce: Reduce = LocalReduce(t, params.host, grads, tied)
        table = HostEmbedding(t, loader, params.units, params.host, spec, dtype, tmpl.embed_scale)
    else:
        reduce = ShardedReduce(sharded, objective.reductions if objective is not None else None)
        table = ShardedEmbedding(
            t, loader, params.units, params.host, spec, dtype, tmpl.embed_scale, sharded, grads
        )
        tmpl.across_ranks(sharded.all_sum_tensor)  # MoE router statistics: the global batch's
        if objective is not None:  # a statistic of the global batch (KTO's KL estimate)
            objective.across_ranks(sharded.all_sum_tensor)
    embedding: Embedding = TextStage(table)
    if stage is not None:  # the tower whole on every rank; a trained part's gradients summed over them
        embedding = stage(table, t, dtype)
        if sharded is not None:
            embedding.across_ranks(sharded)
    kept = params.layers[len(params.layers) - keep :] if keep else []
    own = ["head"] + (["embed"] if tied else [])  # the head's units, upcast where narrow
    if n := params.attach(t.device_empty, dtype, kept, own):
        # NF4: one layer dequantized on the device (+ each kept one); narrow units: their upcast
        t.memory.set("dequantized layer", n)
    return Parts(
        spec,
        engine,
        optim,
        dtype,
        grad_dtype,
        t,
        tracer,
        Poison(),
        dist,
        params,
        loader,
        optimizer,
        tmpl,
        grads,
        reduce,
        embedding,
        objective or TokenCE(),
        params.head_grads(grads, tmpl, reduce, embedding, tied),
        ranks_for(dist),
        keep,
        0,
        dropout_for(tmpl, None if forward_only else dropout_seed, t.device),
    )
