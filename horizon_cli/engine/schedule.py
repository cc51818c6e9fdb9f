"""One optimizer step, layer by layer: the heart of horizon.

    forward   for each layer i: load W_i once; save its input x_i to the host; x = layer(W_i, x) for
              every micro-batch
    head      final norm + LM head + chunked cross-entropy, backward at once (head weights load once)
    backward  for each layer i from the top: load W_i again with the saved x_i; recompute the layer
              under autograd (the only graph, one layer deep), backpropagate every micro-batch,
              accumulate parameter grads in fp32 and send them to the host (engine.grads)
    embed     scatter-add the input gradient into the embedding's fp32 grad on the host
              (engine.embed, which also gathers the input rows at the step's start)
    optimize  with the global grad norm known, AdamW runs on the CPU unit by unit, overlapped
              with the next step's forward (which waits per unit, in the same order)

Each decoder layer's weights cross host -> device exactly twice per step, whatever the number
of micro-batches (invariant 2). See docs/engine.md.

LoRA (`lora`): the base is frozen (engine.frozen: a streaming copy only, NF4 layers dequantized
on the device); each layer's adapters (engine.adapters) travel with its weights and are the only
tensors with gradients; the head and the embedding get none, so the head computes only its input
gradient and the embedding's backward is skipped, as is layer 0's input gradient.

Sharded (`dist`, several ranks): the host holds this rank's slice of every unit; loads are
all-gathered on the device (engine.loader), gradients reduce-scattered back to the slices and the
embedding runs on the device (engine.sharded, engine.embed); the loss and grad norm are global. docs/engine.md.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..config.schema import EngineConfig, OptimConfig
from ..data.batch import MicroBatch
from ..dist.comm import Dist
from ..errors import HorizonError
from ..optim.adamw import AdamWHyper
from ..store import DTYPES, Store
from .adapters import LoraSetup, layer_lora, lora_state
from .embed import Embedding
from .events import READY, Event, Poison, Promise
from .frozen import FrozenState
from .grads import GradSums, sumsq
from .head import head_forward_backward, head_loss, label_index
from .host import HostState
from .loader import Load, Loader
from .lora_plan import adapter_work_bytes
from .optimizer import OptimizerWorker
from .plan import head_work_bytes, layer_work_bytes
from .sharded import ShardedGrads
from .template import make_template
from .trace import Tracer


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
    # MoE (engine.moe): the step's load-balancing loss, and per routed layer max/mean tokens per expert
    aux_loss: float | None = None
    expert_imbalance: list[float] = field(default_factory=list)


def resolve_device(cfg: EngineConfig) -> str:
    """engine.device with `auto` decided: CUDA when present, unless a link is to be emulated."""
    if cfg.device != "auto":
        return cfg.device
    return "cuda" if torch.cuda.is_available() and not cfg.link_gbps else "cpu"


def make_transport(cfg: EngineConfig, tracer: Tracer):
    dev = resolve_device(cfg)
    if dev.startswith("cuda"):
        from .cuda import CudaTransport

        return CudaTransport(torch.device(dev), tracer=tracer)
    from .transport import CpuTransport

    return CpuTransport(cfg.link_gbps, tracer=tracer)


class Engine:
    def __init__(
        self,
        store: Store,
        engine: EngineConfig,
        optim: OptimConfig,
        *,
        tracer: Tracer | None = None,
        progress=lambda n: None,
        max_tokens: int = 0,
        transport=None,
        lora: LoraSetup | None = None,
        dist: Dist | None = None,
    ):
        """max_tokens: the most tokens a step will hold (train.batch_size x data.max_seq_len); the
        buffers for saved inputs are then sized once (0: they grow with the longest step seen).
        transport: one made by the caller (tests), instead of the one engine.device names.
        lora: train LoRA adapters on the frozen store (engine.adapters.lora_setup).
        dist: this rank's place in a sharded run (dist.launch); None: one process, as ever."""
        self.spec, self.cfg, self.ocfg = store.arch, engine, optim
        self.dtype = DTYPES[engine.dtype]
        self.grad_dtype = self.dtype if engine.grad_dtype == "auto" else DTYPES[engine.grad_dtype]
        self.tracer = tracer or Tracer(enabled=False)
        self.t = transport or make_transport(engine, self.tracer)
        self.poison = Poison()  # an error anywhere fails every pending promise (engine/events.py)
        self.layers = [f"layer.{i}" for i in range(self.spec.n_layers)]
        self.lora = lora
        self.dist = dist if dist is not None and dist.world > 1 else None
        if self.dist is not None:  # the collective thread on this rank's device (CUDA)
            self.dist.start(self.t.thread_init)
        shard = (self.dist.world, self.dist.rank) if self.dist else (1, 0)
        # host state; per layer the unit whose gradient it produces (LoRA: its adapters, or None)
        self.base: FrozenState | None = None
        self.trained: list[str | None] = list(self.layers)
        if lora is None:  # every unit is trained: host state in full
            self.host = HostState(
                store, self.dtype, self.t.host_empty, progress, self.grad_dtype, optim.memory, shard
            )
        else:  # a frozen base (streaming copies only) and the adapters, trained
            self.base, self.host, self.trained = lora_state(
                store, lora, self.dtype, self.grad_dtype, self.t.host_empty, progress, shard
            )
        units: dict = {**(self.base.units if self.base else {}), **self.host.units}
        self.units = units
        tied = self.spec.tie_embeddings
        step_numel = max_tokens * self.spec.hidden  # one layer's inputs, whole step (0: unknown)
        adapters = max((st.layout.numel for st in self.host.units.values()), default=0) if lora else 0
        self.loader = Loader(
            self.t,
            units,
            self.layers,
            ["head"] + (["embed"] if tied or self.dist else []),  # sharded: the embedding on the device
            engine.prefetch,
            extra_numel=step_numel + adapters if step_numel else 0,
            extra_dtype=self.dtype,
            dist=self.dist,
        )
        self.optimizer = OptimizerWorker(self.host, optim.kernel, self.tracer, self.t.thread_init)
        # native functional layer, or transformers' own (with LoRA hooks on its linear modules)
        self.tmpl = make_template(self.spec, self.t.device, lora.targets if lora else None)
        self.sharded = (
            ShardedGrads(self.dist, self.t, self.host, self.grad_dtype, replicated=lora is not None)
            if self.dist
            else None
        )
        world = self.dist.world if self.dist else 1
        self.grads = GradSums(
            self.t, self.host, self.trained, self.grad_dtype, world=world, full=lora is None,
            embed_on_device=tied or self.dist is not None,
        )  # fmt: skip
        rs = self.sharded.nbytes() if self.sharded else 0
        self.t.memory.set("grad_acc", self.grads.nbytes() + rs)
        self.embedding = Embedding(
            self.t, self.loader, units, self.host, self.spec, self.dtype, self.tmpl.embed_scale, self.sharded
        )
        moe = getattr(self.tmpl, "moe", None)  # MoE router statistics: the global batch's
        if moe is not None and self.sharded is not None:
            moe.reduce = self.sharded.all_sum_tensor
        # per trained unit: the tensors that get gradients (frozen buffers such as a routing bias do not)
        self._trained = {
            u: [p.name for p in self.host[u].layout.tensors if p.trainable] for u in self.host.units
        }
        if self.base is not None and (n := self.base.attach(self.t.device_empty, self.dtype)):
            self.t.memory.set("dequantized layer", n)  # NF4: one layer, dequantized on the device
        self.ckpt: list[torch.Tensor] = []  # per layer: saved inputs of every micro-batch, flat, on the host
        if step_numel:  # sized once: pinning and unpinning L buffers mid-run doubles them for a while
            self._ensure_ckpt(step_numel)
            self.embedding.reserve(step_numel, grad=lora is None)  # LoRA: the embedding gets no gradient
        self.adam_step = 0
        self.mb_base = 0  # sharded runs: the global index of this rank's first micro-batch
        self.grad_ready: dict[str, Event] = {}  # unit -> its gradient is on the host (this step)
        self.t.memory.set("weights", self.loader.weight_bytes())

    # -- public ------------------------------------------------------------------------------
    def step(self, mbs: list[MicroBatch], lr: float, tokens: int | None = None) -> StepResult:
        """Forward, backward and (unless non-finite) the AdamW update for one global batch.
        Sharded: `mbs` is this rank's share, `tokens` the global batch's label count."""
        t0 = time.perf_counter()
        with self._guard():
            self.t.mark()
            self.t.stats.reset()
            self.t.reset_peak()
            self.loader.layer_loads = 0
            loss_sum, tokens, sq = self.forward_backward(mbs, tokens)
            aux, imbalance = self.tmpl.step_stats()
            loss = loss_sum / tokens if tokens else float("nan")
            norm = math.sqrt(sq) if sq >= 0 else float("nan")
            skipped = not (math.isfinite(loss) and math.isfinite(norm))
            if not skipped:
                self.apply_update(lr, norm)
            self.t.synchronize()
            self.t.flush_trace()
        self.tracer.add("step", f"step {self.adam_step}", t0, time.perf_counter())
        return StepResult(
            loss=loss,
            tokens=tokens,
            grad_norm=norm,
            skipped=skipped,
            step_s=time.perf_counter() - t0,
            h2d_bytes=self.t.stats.h2d_bytes,
            d2h_bytes=self.t.stats.d2h_bytes,
            weight_loads=self.loader.layer_loads,
            device_peak_bytes=self.t.device_peak_bytes(),
            aux_loss=aux,
            expert_imbalance=imbalance,
        )

    def apply_update(self, lr: float, norm: float) -> None:
        o = self.ocfg
        clip = o.grad_clip
        scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0  # torch.nn.utils.clip_grad_norm_
        self.adam_step += 1
        h = AdamWHyper(lr, o.betas[0], o.betas[1], o.eps, o.weight_decay, self.adam_step, scale)
        # the order the next forward needs them; layer 0 first, so its transfer can start while the
        # embedding (needed only on the host, for the gather) is still being updated
        order = [self.layers[0], "embed", *self.layers[1:], "head"]
        if self.lora is not None:
            order = [u for u in self.trained if u is not None]
        self.loader.ready.update(self.optimizer.submit(order, h, self.grad_ready))

    def wait(self) -> None:
        """Block until every queued update has landed in the host store (before eval or save)."""
        with self._guard():
            if self.sharded is not None:
                self.sharded.drain()
            self.optimizer.wait()
            self.t.synchronize()

    def close(self) -> None:
        """Let queued updates land, stop the workers and release pinned memory. After an error the
        pipeline is already poisoned: queued copies fail fast, and nothing new is raised here, so
        the error that stopped the engine is the one the user sees."""
        try:
            if self.poison.error is None:
                self.wait()
        finally:
            self.optimizer.close()
            if self.poison.error is None:
                self.t.close()
            else:
                with contextlib.suppress(Exception):  # e.g. a sticky CUDA error raised again
                    self.t.close()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Around every public operation: an error (or Ctrl-C) poisons the pipeline, so no worker
        waits for ever on work the main thread will now never issue; a device out-of-memory
        becomes one line. The engine is unusable afterwards."""
        if self.poison.error is not None:
            raise HorizonError(f"the engine stopped at an earlier error ({self.poison.error!r})")
        try:
            yield
        except BaseException as e:
            self.poison.poison(e)
            if isinstance(e, torch.cuda.OutOfMemoryError):
                raise HorizonError(oom_message(e)) from e
            raise

    # -- the step ----------------------------------------------------------------------------
    def forward_backward(self, mbs: list[MicroBatch], tokens: int | None = None) -> tuple[float, int, float]:
        """Fill every unit's host grad with d(mean loss)/dW. Returns (loss sum, label tokens,
        squared global grad norm). tokens: the global label count (sharded runs)."""
        tokens = sum(mb.label_tokens for mb in mbs) if tokens is None else tokens
        self.mb_base = self.dist.rank * len(mbs) if self.dist else 0  # this rank's first micro-batch
        inv_n = 1.0 / tokens if tokens else 0.0
        ctxs = [self.tmpl.context(mb, self.dtype, self.t.device) for mb in mbs]
        targets = self._targets(mbs)
        shapes = [(*mb.input_ids.shape, self.spec.hidden) for mb in mbs]
        total = sum(math.prod(s) for s in shapes)
        self._ensure_ckpt(total)
        saved = self.poison.promises(len(self.layers))
        self._account(shapes)
        self.grad_ready = {}
        sq: list[torch.Tensor] = []
        if self.sharded is not None:
            self.sharded.begin_step()

        self.tmpl.begin_step()
        x = self.embedding.scale(self._start(mbs, self._sequence(total, saved)))
        x = self._forward_layers(x, ctxs, saved)
        self.tmpl.end_forward()  # MoE: every layer's routing is known, the aux loss with it
        loss_sum, dx = self._head(x, targets, inv_n, sq)
        dx = self._backward_layers(dx, ctxs, shapes, sq)
        if self.sharded is not None:
            with self.tracer.span("host", "embed grad + norm"):
                if self.lora is None:  # LoRA: the embedding gets no gradient
                    assert self.grads.embed is not None
                    dx = self.embedding.scale(dx)
                    self.embedding.backward_sharded(dx, mbs, self.grads.embed, self.grad_ready)
                loss, sq_all = self.sharded.total(loss_sum)
            return loss, tokens, sq_all
        with self.tracer.span("host", "embed grad + norm"):
            host_sq = (
                self.embedding.backward(self.embedding.scale(dx), mbs, self.grad_ready)
                if self.lora is None
                else 0.0
            )
            dev_sq = torch.stack(sq).double().sum().item() if sq else 0.0
            loss = float(loss_sum.item())
        return loss, tokens, dev_sq + host_sq

    def _sequence(self, total: int = 0, saved: list[Promise] | None = None) -> list[Load]:
        """The step's loads: forward layers, the head, then (with `saved`) the backward layers
        with the first `total` elements of their saved inputs. LoRA: each layer's adapters come
        along (the first extra tensor), once the optimizer has updated them."""
        seq = [Load(f"f{i}", u, *self._adapters(i)) for i, u in enumerate(self.layers)]
        if self.dist is not None:  # the embedding table, gathered on the device first
            seq.insert(0, Load("embed-in", "embed"))
        seq.append(Load("head", "head"))
        if self.spec.tie_embeddings:
            seq.append(Load("embed", "embed"))
        if saved is not None:
            for i in reversed(range(len(self.layers))):
                extra, deps = self._adapters(i)
                seq.append(Load(f"b{i}", self.layers[i], [*extra, self.ckpt[i][:total]], [*deps, saved[i]]))
        return seq

    def _adapters(self, i: int) -> tuple[list[torch.Tensor], list[Event]]:
        """Layer i's adapters as a load's extra tensor, and the update they wait for (LoRA)."""
        u = self.trained[i] if self.lora is not None else None
        if u is None:
            return [], []
        return [self.host[u].stream], [self.loader.ready.get(u, READY)]

    def _weights(self, i: int, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A layer's weights by name: an NF4 layer is dequantized on the device first."""
        return w if self.base is None else self.base.weights(self.layers[i], w)

    def _layer_lora(self, i: int, extras: list[torch.Tensor], train: bool, grad: bool = False):
        """(LayerLora or None, its leaf tensors). train: dropout on; grad: A and B as autograd leaves."""
        u = self.trained[i] if self.lora is not None else None
        if u is None or self.lora is None:
            return None, []
        return layer_lora(self.lora, self.host[u], i, extras[0], self.adam_step, train, grad)

    def _start(self, mbs: list[MicroBatch], seq: list[Load]) -> list[torch.Tensor]:
        """Begin the step's loads and send the embedded inputs. Layer 0's compute needs only its
        weights and the embedding rows, so the rows' copy is queued right behind W_0, before W_1
        (whose load waits for layer 1's update, which the CPU optimizer runs after the
        embedding's): on the in-order copy queue it must not wait for that update."""
        self.loader.begin(seq, ahead=1 if self.dist is None else 2)
        with self.tracer.span("host", "embed"):
            x = self.embedding.forward(mbs)
        self.loader.fill()
        return x

    @torch.no_grad()
    def _forward_layers(self, x, ctxs, saved: list[Promise] | None) -> list[torch.Tensor]:
        """Every layer over every micro-batch; with `saved`, each layer's input goes to the host
        first for the backward recompute (async, overlapping the compute)."""
        for i in range(len(self.layers)):
            if saved is not None:
                pairs, off = [], 0
                for xm in x:
                    pairs.append((self.ckpt[i][off : off + xm.numel()], xm.reshape(-1)))
                    off += xm.numel()
                ev = self.t.d2h(pairs, [self.t.record()], label=f"save{i}")
                saved[i].set(ev)  # the transport keeps x alive until the copy has read it
            w, extras = self.loader.acquire(f"f{i}")
            with self.t.compute_span(f"fwd {i}"):
                w = self._weights(i, w)
                lora, _ = self._layer_lora(i, extras, train=saved is not None)
                out = []
                for m, (xm, c) in enumerate(zip(x, ctxs, strict=True)):
                    if lora is not None:
                        lora.mb = self.mb_base + m  # the global micro-batch: dropout masks as on one rank
                    out.append(self.tmpl.forward(i, w, xm, c, lora))
                x = out
            self.loader.release(f"f{i}")
        return x

    def _targets(self, mbs: list[MicroBatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Labelled positions and their targets per micro-batch, sent before any compute is queued
        (copies from pageable memory would otherwise wait for the device)."""
        out = []
        for mb in mbs:
            idx, tgt = label_index(mb.labels)
            out.append((idx.to(self.t.device), tgt.to(self.t.device)))
        return out

    def _acquire_head(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The final norm's weights (by name) and the LM-head matrix (the embedding's, when tied)."""
        w, _ = self.loader.acquire("head")
        lm = self.loader.acquire("embed")[0]["embed"] if self.spec.tie_embeddings else w["lm_head"]
        return {k: v for k, v in w.items() if k != "lm_head"}, lm

    def _release_head(self) -> None:
        self.loader.release("head")
        if self.spec.tie_embeddings:
            self.loader.release("embed")

    def _head(self, x, targets, inv_n: float, sq: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
        w, lm = self._acquire_head()
        gh, g_lm = None, None
        if self.grads.head is not None:  # a trained head (not LoRA)
            gh = self.host["head"].views(self.grads.head)
            self.grads.head.zero_()
            if self.spec.tie_embeddings and self.grads.embed is not None:  # the LM head is the embedding
                g_lm = self.host["embed"].views(self.grads.embed)["embed"]
            else:
                g_lm = gh["lm_head"]
            if self.grads.embed is not None:
                self.grads.embed.zero_()
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.t.device)
        dx = []
        with self.t.compute_span("head"):
            for xm, (idx, tgt) in zip(x, targets, strict=True):
                ls, dh = head_forward_backward(
                    xm,
                    self.tmpl.final_norm,
                    w,
                    lm,
                    idx,
                    tgt,
                    inv_n,
                    self.cfg.loss_chunk,
                    gh,
                    g_lm,
                    self.tmpl.logits,
                )
                loss_sum += ls
                dx.append(dh)
        self._release_head()
        if self.grads.head is None:
            return loss_sum, dx
        if self.sharded is not None:  # a tied LM head's gradient goes with the embedding's
            self.grad_ready["head"] = self.sharded.reduce("head", self.grads.head, "head")
            return loss_sum, dx
        if self.spec.tie_embeddings and not self.t.shares_host:
            ev = self.t.d2h([(self.host["embed"].grad, self.grads.embed)], [self.t.record()], "g-lm")
            self.grad_ready["embed"] = ev
        sq.extend(sumsq(self.grads.head))
        self.grad_ready["head"] = self.grads.send("head", self.grads.head, None)
        return loss_sum, dx

    def _backward_layers(self, dx, ctxs, shapes, sq: list) -> list[torch.Tensor]:
        for i in reversed(range(len(self.layers))):
            unit = self.trained[i]  # the unit whose gradient this layer produces (None: no adapters)
            w, extras = self.loader.acquire(f"b{i}")
            saved = extras[-1]
            k = i % 2
            g, gv = self.grads.buffer(unit, k)
            with self.t.compute_span(f"bwd {i}"):
                w = self._weights(i, w)
                lora, leaves = self._layer_lora(i, extras, train=True, grad=True)
                if lora is None and unit is not None:  # full fine-tuning: the layer's own weights
                    names = self._trained[unit]
                    leaves = [w[k_].detach().requires_grad_(True) for k_ in names]
                    w = {**w, **dict(zip(names, leaves, strict=True))}  # frozen ones as they are
                # LoRA: nothing below layer 0 needs its input gradient
                want_dx = self.lora is None or i > 0
                if want_dx or leaves:
                    self._backward_layer(i, w, lora, leaves, saved, dx, ctxs, shapes, want_dx, gv, unit)
            self.loader.release(f"b{i}")
            if unit is not None and self.sharded is not None:
                self.grads.free[k] = self.grad_ready[unit] = self.sharded.reduce(unit, g, k)
            elif unit is not None:
                sq.extend(sumsq(g))
                self.grads.free[k] = self.grad_ready[unit] = self.grads.send(unit, g, k)
        return dx

    def _backward_layer(self, i, w, lora, leaves, saved, dx, ctxs, shapes, want_dx, gv, unit) -> None:
        """Recompute layer i under autograd for every micro-batch: its input gradient into dx, the
        leaves' gradients added (fp32) into gv."""
        names = self._trained[unit] if unit is not None else []
        off = 0
        for m, (shape, c) in enumerate(zip(shapes, ctxs, strict=True)):
            n = math.prod(shape)
            xi = saved[off : off + n].view(shape).detach().requires_grad_(want_dx)
            off += n
            if lora is not None:
                lora.mb = self.mb_base + m  # the global micro-batch: dropout masks as on one rank
            with torch.enable_grad():
                y, extra = self.tmpl.objective(i, w, xi, c, lora)
                outs, seeds = (
                    ([y], [dx[m]]) if extra is None else ([y, extra], [dx[m], torch.ones_like(extra)])
                )
                inputs = [xi, *leaves] if want_dx else list(leaves)
                grads = torch.autograd.grad(outs, inputs, seeds, allow_unused=True)
            if want_dx:
                dx[m], grads = grads[0], grads[1:]
            for name, gw in zip(names, grads, strict=True):
                if gw is not None:  # None: a tensor this micro-batch never reached (an unrouted expert bias)
                    gv[name].add_(gw)  # fp32 accumulation across micro-batches

    # -- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def forward_hidden(self, mbs: list[MicroBatch]) -> tuple[list[torch.Tensor], dict, torch.Tensor]:
        """Forward only, streaming each layer once: (last hidden states per micro-batch, head
        weights, LM-head matrix). The caller must `_release_head()` afterwards."""
        ctxs = [self.tmpl.context(mb, self.dtype, self.t.device) for mb in mbs]
        x = self._forward_layers(self.embedding.scale(self._start(mbs, self._sequence())), ctxs, saved=None)
        w, lm = self._acquire_head()
        return x, w, lm

    @torch.no_grad()
    def eval_loss(self, mbs: list[MicroBatch]) -> tuple[float, int]:
        """(summed cross-entropy, label tokens) of a forward pass; logits bounded by a chunk."""
        with self._guard():
            targets = self._targets(mbs)
            x, w, lm = self.forward_hidden(mbs)
            total = torch.zeros((), dtype=torch.float32, device=self.t.device)
            for xm, (idx, tgt) in zip(x, targets, strict=True):
                total += head_loss(
                    xm, self.tmpl.final_norm, w, lm, idx, tgt, self.cfg.loss_chunk, self.tmpl.logits
                )
            self._release_head()
            tokens = sum(mb.label_tokens for mb in mbs)
            if self.sharded is not None:  # this rank's share: the sums over every rank's
                loss, n = self.sharded.sum_all(lambda: [float(total), float(tokens)])
                return loss, int(n)
            return float(total.item()), tokens

    @torch.no_grad()
    def logits(self, mb: MicroBatch) -> torch.Tensor:
        """Full (b, T, V) fp32 logits of one small micro-batch — for tests and spot checks only."""
        with self._guard():
            (x,), w, lm = self.forward_hidden([mb])
            out = self.tmpl.logits(self.tmpl.final_norm(x, w), lm).float().cpu()
            self._release_head()
            return out

    # -- buffers -----------------------------------------------------------------------------
    def _ensure_ckpt(self, total: int) -> None:
        """Host buffers for each layer's saved inputs: sized once from max_tokens, else grow-only."""
        if self.ckpt and self.ckpt[0].numel() >= total:
            return
        for old in self.ckpt:
            self.t.host_release(old)
        self.ckpt = [self.t.host_empty(total, self.dtype) for _ in self.layers]

    def _account(self, shapes) -> None:
        """Device memory by category for this step's shapes (the CPU has no allocator to ask)."""
        item = self.dtype.itemsize
        acts = sum(math.prod(sh) for sh in shapes) * item
        lent = self.loader.lend  # saved inputs are read where they lie
        self.t.memory.set("ckpt", 0 if lent else self.loader.extra_bytes() or acts * len(self.loader.ring))
        self.t.memory.set("activations", 2 * acts)
        rows, T = max(sh[0] for sh in shapes), max(sh[1] for sh in shapes)
        tok = max(sh[0] * sh[1] for sh in shapes)
        work = layer_work_bytes(self.spec, tok, rows, T, item)
        if self.lora is not None:  # the adapters' outputs, held for the backward
            work += adapter_work_bytes(self.lora.targets, self.lora.cfg.r, tok, item)
        self.t.memory.set("layer_work", work)
        self.t.memory.set("head_work", head_work_bytes(self.spec, tok, self.cfg.loss_chunk, item))


def oom_message(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
    return (
        f"device out of memory during the step ({first}); lower train.micro_batch_size, "
        "data.max_seq_len or engine.prefetch (`horizon train CONFIG --dry-run` shows the device plan)"
    )
