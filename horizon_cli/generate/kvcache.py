"""A generation's KV cache: per micro-batch one transformers Cache, kept on the device or, between
sweeps, in host memory.

    device  the caches' tensors stay on the device from sweep to sweep (what the plan prefers)
    host    between sweeps each layer's K/V tensors live in host buffers. Layer i's load brings
            them with its weights (the loader's extra tensors, prefetched like the weights), they
            are bound into the cache's layer for the compute, which appends the sweep's positions,
            and the layer's tensors go back to the host (D2H) before the next sweep loads them
            again. The link then carries the cache twice per sweep besides the weights, and the
            device holds only the layers in flight.

The caches are transformers' own (`DynamicCache`: the template makes them, model.template /
model.generic), so the generic path's layers and masks use them exactly as transformers'
generate does; between sweeps a host-mode layer holds meta tensors of the right shape, which
its mask sizes read and which fail loudly if anything computed with them.
"""

from __future__ import annotations

import math

import torch

from ..runtime.events import READY, Event
from ..runtime.transport import Transport

STATES = ("keys", "values")


def kv_bytes(rows: list[tuple[int, int]], per_layer: list[tuple[int, int | None]], item: int) -> int:
    """Bytes of a whole batch's cache: rows = per micro-batch (rows, positions it reaches);
    per_layer = the template's kv_row_numel (elements per position of a row, positions kept)."""
    total = 0
    for b, S in rows:
        for numel, keep in per_layer:
            total += b * (S if keep is None else min(S, keep)) * numel
    return total * item


class KVCache:
    def __init__(self, t: Transport, caches: list, host: bool, positions: list[int]):
        """caches: per micro-batch a fresh transformers Cache (template.new_cache()); positions: per
        micro-batch the most positions it will hold (prompt + new tokens); host: host mode."""
        self.t, self.caches, self.host = t, caches, host
        self.positions = positions
        self.active = list(range(len(caches)))  # the micro-batches still generating
        self._buf: dict[tuple[int, int, str], torch.Tensor] = {}  # (layer, mb, state) -> flat host buffer
        self._shape: dict[tuple[int, int, str], torch.Size] = {}
        self._written: dict[int, Event] = {}  # layer -> its last write-back

    def live(self) -> list:
        return [self.caches[m] for m in self.active]

    def keep_only(self, active: list[int]) -> None:
        """Stop carrying the micro-batches that finished (their caches are dropped). A buffer is
        unpinned and dropped only once its layer's last write-back has landed: the D2H may still
        be in flight (on CUDA: DMA into pages already unregistered, or freed)."""
        for m in set(self.active) - set(active):
            self.caches[m] = None
            for key in [k for k in self._buf if k[1] == m]:
                self._written.get(key[0], READY).host_wait()
                self.t.host_release(self._buf.pop(key))
                self._shape.pop(key, None)
        self.active = list(active)

    # -- host mode: the pass's hooks (generate.decode) --------------------------------------------
    def _keys(self, i: int) -> list[tuple[int, int, str]]:
        return [(i, m, s) for m in self.active for s in STATES if (i, m, s) in self._shape]

    def extras(self, i: int) -> tuple[list[torch.Tensor], list[Event]]:
        """Layer i's cached tensors on the host (what its load brings), and their last write-back."""
        if not self.host:
            return [], []
        keys = self._keys(i)
        out = [self._buf[k][: math.prod(self._shape[k])].view(self._shape[k]) for k in keys]
        return out, [self._written.get(i, READY)]

    def bind(self, i: int, extras: list[torch.Tensor]) -> list[torch.Tensor]:
        """Before layer i's compute: its loaded K/V into the caches; returns the other extras."""
        if not self.host:
            return extras
        keys = self._keys(i)
        mine = extras[len(extras) - len(keys) :]
        for (_, m, s), tensor in zip(keys, mine, strict=True):
            setattr(self.caches[m].layers[i], s, tensor)
        return extras[: len(extras) - len(keys)]

    def keep(self, i: int) -> None:
        """After layer i's compute: its K/V (now with this sweep's positions) back to the host."""
        if not self.host:
            return
        pairs = []
        for m in self.active:
            layers = self.caches[m].layers
            lay = layers[i] if i < len(layers) else None
            if lay is None or not getattr(lay, "is_initialized", False):
                continue
            for s in STATES:
                dev = getattr(lay, s).contiguous()
                key = (i, m, s)
                buf = self._host_buffer(key, dev)
                pairs.append((buf[: dev.numel()], dev.reshape(-1)))
                self._shape[key] = dev.shape
                setattr(lay, s, torch.empty(dev.shape, dtype=dev.dtype, device="meta"))
        if pairs:
            self._written[i] = self.t.d2h(pairs, [self.t.record()], label=f"kv{i}")

    def _host_buffer(self, key: tuple[int, int, str], dev: torch.Tensor) -> torch.Tensor:
        """The (pinned) host buffer of one layer's state for a micro-batch, sized once for every
        position it will reach."""
        buf = self._buf.get(key)
        if buf is None:
            per_position = dev.numel() // max(dev.shape[-2], 1)
            buf = self._buf[key] = self.t.host_empty(per_position * self.positions[key[1]], dev.dtype)
        return buf

    # -- what it holds ---------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Bytes the caches hold on the device between sweeps (host mode: none)."""
        if self.host:
            return 0
        n = 0
        for c in self.live():
            for lay in c.layers:
                for s in STATES:
                    x = getattr(lay, s, None)
                    if isinstance(x, torch.Tensor) and x.device.type != "meta":
                        n += x.numel() * x.element_size()
        return n

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buf.values())

    def close(self) -> None:
        self.keep_only([])
        self.t.memory.set("kv cache", 0)
