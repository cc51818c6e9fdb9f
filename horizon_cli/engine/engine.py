"""The engine: its parts assembled once (engine.parts), a training step (engine.step) and
forward-only passes (engine.infer) over them, and the guard that stops the pipeline cleanly.

    step(mbs, lr)      forward, backward and (unless non-finite) the AdamW update of one global batch
    eval_loss(mbs)     summed loss and label tokens, forward only (evaluate: with the objective's stats)
    sequence_logps     each row's summed log-prob, forward only (a preference run's reference pass)
    logits(mb)         full logits of a small micro-batch
    wait() / close()   let queued updates land / stop the workers

Every public operation runs under `guard`: an error (or Ctrl-C) poisons the pipeline so no worker
waits for ever on work the main thread will never issue (runtime.events), a device out-of-memory
becomes one line, and the engine refuses further work. Generation is no part of the engine: it
lives in generate/ and runs on the engine's public parts (`p`, `sweep`), each of its operations
under `guard` too. docs/engine.md draws the whole.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..config.schema import EngineConfig, OptimConfig
from ..data.batch import MicroBatch
from ..errors import HorizonError
from ..lora.setup import LoraSetup
from ..parallel.comm import Dist
from ..runtime.trace import Tracer
from ..store import Store
from .infer import Inference
from .parts import Stage, assemble
from .ranks import Placement
from .seams import LossObjective, Transport
from .step import TrainStep
from .sweep import Sweep
from .tuning import tuning_for


@dataclass
class StepResult:
    loss: float
    tokens: int
    grad_norm: float
    skipped: bool  # non-finite loss or gradient: no update was applied
    step_s: float
    h2d_bytes: int
    d2h_bytes: int
    weight_loads: int
    device_peak_bytes: int
    kept_layers: int = 0  # K: the last K layers were neither recomputed nor loaded again
    # MoE (model.moe): the step's load-balancing loss, and per routed layer max/mean tokens per expert
    aux_loss: float | None = None
    expert_imbalance: list[float] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)  # the objective's, summed over this rank's data


class Engine:
    def __init__(
        self,
        store: Store,
        engine: EngineConfig,
        optim: OptimConfig,
        *,
        tracer: Tracer | None = None,
        progress: Callable[[int], None] = lambda n: None,
        max_tokens: int = 0,
        transport: Transport | None = None,
        lora: LoraSetup | None = None,
        dist: Dist | None = None,
        objective: LossObjective | None = None,
        keep: int | None = None,
        forward_only: bool = False,
        dropout_seed: int | None = None,
        stage: Stage | None = None,
    ) -> None:
        """max_tokens: the most tokens a step will hold (train.batch_size x data.max_seq_len); the
        buffers for saved inputs are then sized once (0: they grow with the longest step seen).
        transport: one made by the caller (tests), instead of the one engine.device names.
        lora: train LoRA adapters on the frozen store (lora.setup.lora_setup).
        dist: this rank's place in a sharded run (parallel.launch); None: one process, as ever.
        objective: what the loss head computes (engine.objective; default: SFT's cross-entropy).
        keep: the last K layers keep graph and weights from forward to backward (engine.kept_layers); None:
        `engine.keep_activations` when it is a number, none for `auto`, which is a plan's decision
        (engine.build passes the plan's K).
        forward_only: nothing is trained (generation, evaluation): the store's units frozen, no
        optimizer state (engine.params.FrozenParams); `lora` then names adapters to apply. Such an
        engine keeps nothing (K applies to training steps only).
        dropout_seed: train with the model's dropout and router noise, masks seeded from it
        (engine.dropout; engine.build passes train.seed unless model.dropout is 0); None: off.
        stage: what wraps the embedding stage (vision.embed: a vision tower's image merge)."""
        step_numel = 0 if forward_only else max_tokens * store.arch.boundary_width  # one layer's inputs
        if forward_only:
            keep = 0
        elif keep is None:
            keep = engine.keep_activations if isinstance(engine.keep_activations, int) else 0
        p = assemble(
            store,
            engine,
            optim,
            tracer=tracer,
            progress=progress,
            transport=transport,
            lora=lora,
            dist=dist,
            objective=objective,
            step_numel=step_numel,
            keep=min(keep, store.arch.n_layers),
            forward_only=forward_only,
            dropout_seed=dropout_seed,
            stage=stage,
        )
        self.p = p
        self.tuning = tuning_for(lora)  # what train/ asks of a run's training (engine.tuning)
        self.ranks = p.ranks  # ... and of its processes (engine.ranks)
        self.sweep = Sweep(p)
        self.trainer = TrainStep(p, self.sweep)
        self.infer = Inference(p, self.sweep)
        if step_numel:
            self.trainer.reserve(step_numel)
        p.t.memory.set("weights", p.loader.weight_bytes())

    # -- what other stages read --------------------------------------------------------------
    spec = property(lambda self: self.p.spec)
    cfg = property(lambda self: self.p.cfg)
    dtype = property(lambda self: self.p.dtype)
    t = property(lambda self: self.p.t)
    tracer = property(lambda self: self.p.tracer)
    host = property(lambda self: self.p.params.host)  # the trained units' host state
    base = property(lambda self: self.p.params.base)  # LoRA: the frozen base (None otherwise)
    units = property(lambda self: self.p.params.units)  # every unit's streaming copy
    layers = property(lambda self: self.p.layers)
    kept_layers = property(lambda self: self.p.keep)  # K: the last K layers are kept (engine.kept_layers)
    lora = property(lambda self: self.p.params.lora)
    dist = property(lambda self: self.p.dist)
    optimizer = property(lambda self: self.p.optimizer)
    tmpl = property(lambda self: self.p.tmpl)
    objective = property(lambda self: self.p.objective)

    @property
    def placement(self) -> Placement:
        """How the trained state lies over the ranks (what a checkpoint's writers follow)."""
        return self.tuning.placement(self.ranks)

    @property
    def adam_step(self) -> int:
        return self.p.adam_step

    @adam_step.setter
    def adam_step(self, n: int) -> None:  # a resumed checkpoint's
        self.p.adam_step = n

    @property
    def releases(self) -> bool:
        """Each unit's update runs inside the backward (engine.release; optim.modes.in_backward)."""
        o = self.p.ocfg
        return o.mode.in_backward(o.grad_clip, self.lora is not None)

    @property
    def passes(self) -> int:
        """A step's forward and backward passes: 2 norm-first (optim.modes.passes), else 1."""
        o = self.p.ocfg
        return o.mode.passes(o.grad_clip, self.lora is not None)

    # -- public ------------------------------------------------------------------------------
    def step(self, mbs: list[MicroBatch], lr: float, tokens: int | None = None) -> StepResult:
        """Forward, backward and (unless non-finite) the AdamW update for one global batch.
        Sharded: `mbs` is this rank's share, `tokens` the global batch's divisor."""
        p = self.p
        t0 = time.perf_counter()
        with self.guard():
            p.t.mark()
            p.t.stats.reset()
            p.t.reset_peak()
            p.loader.layer_loads = 0
            if self.releases:  # each unit's update inside the backward (engine.release)
                loss, tokens, norm, stats, skipped = self.trainer.released_step(mbs, lr, tokens)
                aux, imbalance = p.tmpl.step_stats()
            else:
                loss_sum, tokens, sq, stats = self.trainer.forward_backward(mbs, tokens)
                aux, imbalance = p.tmpl.step_stats()
                loss = loss_sum / tokens if tokens else float("nan")
                norm = math.sqrt(sq) if sq >= 0 else float("nan")
                skipped = not (math.isfinite(loss) and math.isfinite(norm))
                if not skipped:
                    self.trainer.apply_update(lr, norm)
            p.t.synchronize()
            p.t.flush_trace()
        p.tracer.add("step", f"step {p.adam_step}", t0, time.perf_counter())
        return StepResult(
            loss=loss,
            tokens=tokens,
            grad_norm=norm,
            skipped=skipped,
            step_s=time.perf_counter() - t0,
            h2d_bytes=p.t.stats.h2d_bytes,
            d2h_bytes=p.t.stats.d2h_bytes,
            weight_loads=p.loader.layer_loads,
            device_peak_bytes=p.t.device_peak_bytes(),
            kept_layers=p.keep,
            aux_loss=aux,
            expert_imbalance=imbalance,
            stats=stats,
        )

    def forward_backward(self, mbs: list[MicroBatch], tokens: int | None = None) -> tuple[float, int, float]:
        """Gradients only (no update): (loss sum, divisor, squared global grad norm)."""
        if self.releases:
            raise HorizonError("optim.grad_release: a release run keeps no whole-model gradients to return")
        with self.guard():
            loss_sum, tokens, sq, _ = self.trainer.forward_backward(mbs, tokens)
            return loss_sum, tokens, sq

    def eval_loss(self, mbs: list[MicroBatch]) -> tuple[float, int]:
        """(summed cross-entropy, label tokens) of a forward pass; logits bounded by a chunk."""
        loss, n, _ = self.evaluate(mbs)
        return loss, n

    def evaluate(self, mbs: list[MicroBatch]) -> tuple[float, int, dict[str, float]]:
        """(the objective's summed loss, its divisor, its stat sums) of a forward pass, over every rank."""
        with self.guard():
            return self.infer.evaluate(mbs)

    def sequence_logps(self, mbs: list[MicroBatch], adapters: bool = True) -> list[torch.Tensor]:
        """Per micro-batch (b,) fp32 on the host: each row's summed log-prob of its labelled tokens,
        forward only, each layer loaded once for all of `mbs`. adapters=False: LoRA's base alone
        (the reference of a preference run)."""
        with self.guard():
            return self.infer.sequence_logps(mbs, adapters)

    def sum_over_ranks(self, v: torch.Tensor) -> torch.Tensor:
        """A small host vector summed over the ranks (itself on one process)."""
        with self.guard():
            return self.p.reduce.sum_vector(v)

    def scores(self, mbs: list[MicroBatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per micro-batch: each label's log-prob and whether it is the argmax (engine.infer)."""
        with self.guard():
            return self.infer.scores(mbs)

    def logits(self, mb: MicroBatch) -> torch.Tensor:
        """Full (b, T, V) fp32 logits of one small micro-batch — for tests and spot checks only."""
        with self.guard():
            return self.infer.logits(mb)

    def wait(self) -> None:
        """Block until every queued update has landed in the host store (before eval or save)."""
        with self.guard():
            self.p.reduce.drain()
            self.p.optimizer.wait()
            self.p.t.synchronize()

    def close(self) -> None:
        """Let queued updates land, stop the workers and release pinned memory. After an error the
        pipeline is already poisoned: queued copies fail fast, and nothing new is raised here, so
        the error that stopped the engine is the one the user sees."""
        p = self.p
        try:
            if p.poison.error is None:
                self.wait()
        finally:
            p.optimizer.close()
            if p.poison.error is None:
                p.t.close()
            else:
                with contextlib.suppress(Exception):  # e.g. a sticky CUDA error raised again
                    p.t.close()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around every public operation: an error (or Ctrl-C) poisons the pipeline, so no worker
        waits for ever on work the main thread will now never issue; a device out-of-memory
        becomes one line. The engine is unusable afterwards."""
        poison = self.p.poison
        if poison.error is not None:
            raise HorizonError(f"the engine stopped at an earlier error ({poison.error!r})")
        try:
            yield
        except BaseException as e:
            poison.poison(e)
            if isinstance(e, torch.cuda.OutOfMemoryError):
                raise HorizonError(oom_message(e)) from e
            raise


def oom_message(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
    return (
        f"device out of memory during the step ({first}); lower train.micro_batch_size, "
        "data.max_seq_len, engine.keep_activations or engine.prefetch (`horizon train CONFIG --dry-run` shows the device plan)"
    )
