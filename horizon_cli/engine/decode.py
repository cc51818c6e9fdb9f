"""Generation on the streamed engine: a prefill sweep, then one sweep of the layers per new token,
each sweep serving every micro-batch of the batch (each layer's weights cross the link once per
sweep, whatever the batch size: decoding is link-bound, and a large batch makes it cheap).

    open(dbs, host)   the KV cache of a batch of left-padded micro-batches (engine.kvcache), on the
                      device or between sweeps on the host
    step(dbs, kv)     one sweep: the layers over every micro-batch with its cache, then the head on
                      each row's newest position -> per micro-batch (b, V) fp32 logits on the device

Left padding puts every row's newest token at the same index, so the head reads one position and
the caches grow by one position per sweep for all rows alike (model.masks / model.generic mask the
padding out, as transformers' generate does).
"""

from __future__ import annotations

import torch

from ..data.batch import DecodeBatch
from ..errors import InputError
from .kvcache import KVCache, kv_bytes
from .parts import Parts
from .passes import DecodePass
from .sweep import Sweep


class Generation:
    def __init__(self, p: Parts, sweep: Sweep):
        self.p, self.sweep = p, sweep
        self._per_layer: list[tuple[int, int | None]] | None = None

    def per_layer(self) -> list[tuple[int, int | None]]:
        """Per layer: cached elements per position of a row, most positions kept (the template's)."""
        if self._per_layer is None:
            self._per_layer = self.p.tmpl.kv_row_numel()
        return self._per_layer

    def cache_bytes(self, rows: list[tuple[int, int]]) -> int:
        """Bytes of the KV cache of micro-batches of (rows, positions reached)."""
        return kv_bytes(rows, self.per_layer(), self.p.dtype.itemsize)

    def open(self, dbs: list[DecodeBatch], new_tokens: int, host: bool) -> KVCache:
        """A KV cache for these micro-batches, each growing by up to `new_tokens` positions. Host
        mode sizes the loader's extra buffers once for the largest layer's cache."""
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

    @torch.no_grad()
    def step(self, dbs: list[DecodeBatch], kv: KVCache) -> list[torch.Tensor]:
        """One sweep over the active micro-batches `dbs` (kv.active, in order): their new tokens
        through every layer, appended to the caches; the logits (b, V) fp32 of each row's newest
        position."""
        p = self.p
        p.tmpl.begin_step()  # MoE router statistics are a training step's; none accumulate here
        caches = kv.live()
        ctxs = [p.tmpl.gen_context(db, c, p.dtype, p.t.device) for db, c in zip(dbs, caches, strict=True)]
        passes = [DecodePass(p, kv)] * len(p.tmpl.calls)
        x = self.sweep.start(dbs, self.sweep.loads(passes))  # type: ignore[arg-type]
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
