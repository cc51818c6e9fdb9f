"""Generation on the streamed engine: a prefill sweep, then one sweep of the layers per new token,
each sweep serving every micro-batch of the batch (each layer's weights cross the link once per
sweep, whatever the batch size: decoding is link-bound, and a large batch makes it cheap).

    DecodePass        the pass of a generation sweep (engine.seams.LayerPass, run by the engine's
                      sweep): the layer's cached K/V bound before its compute and kept after it
                      (host mode: they ride with its load)
    open(dbs, host)   the KV cache of a batch of left-padded micro-batches (generate.kvcache), on
                      the device or between sweeps on the host
    across(n)         every rank's n (a sharded engine's ranks decode in lock step)
    step(dbs, kv)     one sweep: the layers over every micro-batch with its cache, then the head on
                      each row's newest position -> per micro-batch (b, V) fp32 logits on the device

The engine knows nothing of generation: `Generation` builds on its public parts (`engine.p`, the
parts; `engine.sweep`, the sweep) and runs each operation under the engine's guard, as the
engine's own operations run. Left padding puts every row's newest token at the same index, so the
head reads one position and the caches grow by one position per sweep for all rows alike
(model.masks / model.generic mask the padding out, as transformers' generate does).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..data.batch import DecodeBatch
from ..engine import Engine
from ..engine.parts import Parts
from ..engine.passes import ForwardPass
from ..engine.sweep import Sweep
from ..errors import InputError
from ..runtime.events import Event
from . import kvprobe
from .kvcache import KVCache, kv_bytes
from .resident import ResidentLoader


class DecodePass(ForwardPass):
    """A generation sweep: the layer computes with its KV cache, which keeps the new positions."""

    def __init__(self, p: Parts, kv: KVCache):
        super().__init__(p)
        self.kv = kv

    def extras(self, i: int) -> tuple[list[torch.Tensor], list[Event]]:
        return self.kv.extras(i)

    def bind(self, i: int, extras: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.kv.bind(i, extras)  # the params' extras remain

    def after(self, i: int) -> None:
        self.kv.keep(i)


class Generation:
    def __init__(self, engine: Engine, weights: ResidentLoader | None = None):
        """weights: where the sweep's layers come from in place of the engine's streaming loader
        (generate.resident: a copy on the device)."""
        self.p, self.sweep, self.guard = engine.p, engine.sweep, engine.guard
        if weights is not None:  # the same parts and sweep, the layers read from the copy
            self.p = replace(engine.p, loader=weights)  # type: ignore[arg-type]
            self.sweep = Sweep(self.p)
        self.ranks, self.sum_over_ranks = engine.ranks, engine.sum_over_ranks

    def across(self, n: int) -> list[int]:
        """Every rank's n, in rank order ([n] on one process): a sharded engine's ranks decode in
        lock step (generate.decoder). One small all-reduce on the collective thread."""
        r = self.ranks
        if r.world == 1:
            return [n]
        v = torch.zeros(r.world, dtype=torch.float64)
        v[r.rank] = n
        return [int(x) for x in self.sum_over_ranks(v).tolist()]

    def per_layer(self) -> list[tuple[int, int | None]]:
        """Per layer: cached elements per position of a row, most positions kept (generate.kvprobe)."""
        return kvprobe.per_layer(self.p.tmpl)

    def cache_bytes(self, rows: list[tuple[int, int]]) -> int:
        """Bytes of the KV cache of micro-batches of (rows, positions reached)."""
        return kv_bytes(rows, self.per_layer(), self.p.dtype.itemsize)

    def open(self, dbs: list[DecodeBatch], new_tokens: int, host: bool) -> KVCache:
        """A KV cache for these micro-batches, each growing by up to `new_tokens` positions (host:
        kept in host memory between sweeps). Host mode sizes the loader's extra buffers once for
        the largest layer's cache."""
        with self.guard():
            return self._open(dbs, new_tokens, host)

    def _open(self, dbs: list[DecodeBatch], new_tokens: int, host: bool) -> KVCache:
        p = self.p
        positions = [db.input_ids.shape[1] + new_tokens for db in dbs]
        kv = KVCache(p.t, [p.tmpl.new_cache() for _ in dbs], host and not p.t.shares_host, positions)
        if kv.host and p.tmpl.calls != list(
            range(len(p.layers))
        ):  # a loop (arch.calls): cache layers per call
            raise InputError(
                "engine.kv_cache: host: the KV cache on the host is not supported for a model that runs its layers in a loop"
            )
        if kv.host:
            rows = [(db.input_ids.shape[0], s) for db, s in zip(dbs, positions, strict=True)]
            largest = max(kv_bytes(rows, [layer], 1) for layer in self.per_layer())
            p.loader.reserve_extra(largest + p.params.extra_numel(), p.dtype)
            p.t.memory.set("kv in flight", p.loader.extra_bytes())
        return kv

    def step(self, dbs: list[DecodeBatch], kv: KVCache) -> list[torch.Tensor]:
        """One sweep (prefill or one new token per row) over the active micro-batches `dbs`
        (kv.active, in order): their new tokens through every layer, appended to the caches; the
        logits (b, V) fp32 of each row's newest position, on the device."""
        with self.guard():
            return self._step(dbs, kv)

    @torch.no_grad()
    def _step(self, dbs: list[DecodeBatch], kv: KVCache) -> list[torch.Tensor]:
        p = self.p
        p.tmpl.begin_step()  # MoE router statistics are a training step's; none accumulate here
        caches = kv.live()
        ctxs = [  # positions: the embedding stage's for a prefill with images (Qwen2-VL's rope index)
            p.tmpl.gen_context(p.embedding.positioned(db), c, p.dtype, p.t.device)
            for db, c in zip(dbs, caches, strict=True)
        ]
        passes = [DecodePass(p, kv)] * len(p.tmpl.calls)
        x = self.sweep.start(dbs, self.sweep.loads(passes))
        x = self.sweep.layers(x, ctxs, passes)
        head = self.sweep.acquire_head()
        if p.spec.streams:  # the modules after the last layer merge the streams, on the newest position
            d = p.spec.tokens_dim
            last = [head.norm(xm.narrow(d, xm.shape[d] - 1, 1), head.norm_w)[:, -1] for xm in x]
        else:
            last = [head.norm(xm[:, -1], head.norm_w) for xm in x]
        out = [head.logits(h, head.lm).float() for h in last]
        self.sweep.release_head()
        if not kv.host:
            p.t.memory.set("kv cache", kv.device_bytes())
        return out
