"""Weight streaming: units move host -> device through `prefetch` buffers, in a known order.

Each step's loads are known in advance (forward: layers 0..L-1, the head; backward: layers
L-1..0, each with its saved inputs), so the loader issues up to `prefetch` of them ahead of the
compute that needs them (2 = double buffering). A load waits for (a) its buffer to be released
by the compute that last used it and (b) the host copy being current: the optimizer's update of
that unit from the previous step. The head (and, when tied, the embedding it reuses) has its own
buffers, because it is much larger than a layer in small models and loads once per step.

A kept layer (engine.keep_activations: the last K layers of the forward) loads once per step, into
a buffer of its own (`keep` of them, beside the ring), which it holds until the compute releases it
after its backward: its graph reads those weights then, while the ring's slots serve other loads.

When the transport shares host memory (`device: cpu` with no emulated link) a load lends the host
buffers instead of copying them: the same sequence, slots and dependency waits, no bytes moved.

Sharded runs (`dist`): a unit's host state is this rank's slice; a load copies the slice into
its place in a whole-unit device buffer (every rank's piece padded to the shard size) and then
all-gathers the buffer on the collective thread (parallel.comm), so the slot is "loaded" once the
gather is done. Nothing is lent then: the gathered unit exists only on the device.

`host` maps unit names to their host state: state.host's trained units, and in LoRA runs the
frozen base's (state.frozen), whose streaming copy may be packed NF4 bytes: a slot holds whatever
the unit's `stream` is, in its dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..parallel.comm import Dist
from ..parallel.shard import padded_numel
from .events import READY, Event, FutureEvent
from .transport import Transport


class Streamed(Protocol):
    """A unit as the loader streams it (state.host.UnitState, state.frozen.FrozenUnit)."""

    @property
    def stream(self) -> torch.Tensor: ...  # the flat host copy (a sharded rank's slice)
    @property
    def full_numel(self) -> int: ...  # the whole unit's stream length
    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]: ...


@dataclass
class Load:
    """One unit's transfer: its weights, plus host tensors (saved activations) to bring along."""

    key: str  # unique in the step, e.g. "f3", "b3", "head"
    unit: str
    extra: list[torch.Tensor] = field(default_factory=list)
    deps: list[Event] = field(default_factory=list)  # e.g. the copy that saved `extra` to the host
    kept: bool = False  # a kept layer's: into a buffer of its own, held until its backward


@dataclass
class Slot:
    flat: torch.Tensor  # device weight buffer (numel,) in the compute dtype
    name: str = ""  # ring index, or the unit that owns it (for traces)
    extra: torch.Tensor | None = None  # device buffer for the saved activations
    key: str | None = None
    free: Event = READY  # compute done with the previous contents
    loaded: Event = READY


class Loader:
    def __init__(
        self,
        transport: Transport,
        host: Mapping[str, Streamed],
        ring_units: list[str],
        own_units: list[str],
        prefetch: int,
        extra_numel: int = 0,
        extra_dtype: torch.dtype | None = None,
        dist: Dist | None = None,
        keep: int = 0,
        keep_extra_numel: int = 0,
    ):
        """host: unit name -> state with `stream`, `layout` and `views` (state.host, state.frozen).
        extra_numel: elements of the extra tensors one load brings at most (the saved inputs of a
        whole step, a layer's adapters), so their device buffers are allocated once; 0: they grow
        on demand. keep: buffers for kept layers (their extras: keep_extra_numel, a layer's
        adapters)."""
        self.t, self.host, self.dist = transport, host, dist
        # with shared memory (CPU, no emulated link) a load lends the host buffers: no device copies
        self.lend = transport.shares_host and dist is None
        ring_dtype = host[ring_units[0]].stream.dtype
        numel = 0 if self.lend else max(self.device_numel(u) for u in ring_units)
        self.ring = [Slot(transport.device_empty(numel, ring_dtype), str(i)) for i in range(prefetch)]
        if extra_numel and not self.lend:
            for s in self.ring:
                s.extra = transport.device_empty(extra_numel, extra_dtype or ring_dtype)
        self.kept = [Slot(transport.device_empty(numel, ring_dtype), f"k{j}") for j in range(keep)]
        if keep_extra_numel and not self.lend:
            for s in self.kept:
                s.extra = transport.device_empty(keep_extra_numel, extra_dtype or ring_dtype)
        self.own = {}
        for u in own_units:
            st = host[u].stream
            self.own[u] = Slot(transport.device_empty(0 if self.lend else self.device_numel(u), st.dtype), u)
        self.ready: dict[str, Event] = {}  # unit -> host copy is current (the optimizer is done with it)
        self.seq: list[Load] = []
        self.pos = 0
        self.by_key: dict[str, tuple[Slot, Load]] = {}
        self.layer_loads = 0  # decoder-layer weight transfers (the step's `weight_loads`)
        self._views: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (slot, unit) -> views

    def device_numel(self, unit: str) -> int:
        """Elements of the unit's device buffer: the unit, or in sharded runs every rank's piece."""
        st = self.host[unit]
        if self.dist is None:
            return st.stream.numel()
        return padded_numel(st.full_numel, self.dist.world)

    def weight_bytes(self) -> int:
        """The weight buffers: the ring's, the kept layers' (with their extras: adapters), the own."""
        slots = self.ring + self.kept + list(self.own.values())
        kept_extra = sum(s.extra.numel() * s.extra.element_size() for s in self.kept if s.extra is not None)
        return sum(s.flat.numel() * s.flat.element_size() for s in slots) + kept_extra

    def reserve_extra(self, numel: int, dtype: torch.dtype) -> None:
        """Size every buffer's extra tensors for loads bringing up to `numel` elements (a
        generation's host KV cache), once, rather than growing them load by load."""
        if self.lend:
            return
        for s in self.ring:
            if s.extra is None or s.extra.numel() < numel:
                assert s.key is None, "reserve_extra between sequences of loads"
                s.extra = None
                s.extra = self.t.device_empty(numel, dtype)

    def extra_bytes(self) -> int:
        return sum(s.extra.numel() * s.extra.element_size() for s in self.ring if s.extra is not None)

    def begin(self, seq: list[Load], ahead: int | None = None) -> None:
        """Start a new sequence of loads (the previous one must be fully consumed), issuing at most
        `ahead` of them for now (`fill` issues the rest as buffers allow)."""
        self.seq, self.pos, self.by_key = seq, 0, {}
        self._issue(ahead)

    def fill(self) -> None:
        """Issue loads up to the free buffers."""
        self._issue()

    def _free_slot(self, load: Load) -> Slot | None:
        if load.unit in self.own:
            s = self.own[load.unit]
            return s if s.key is None else None
        for s in self.kept if load.kept else self.ring:
            if s.key is None:
                return s
        return None

    def _issue(self, limit: int | None = None) -> None:
        while self.pos < len(self.seq) and (limit is None or len(self.by_key) < limit):
            load = self.seq[self.pos]
            slot = self._free_slot(load)
            if slot is None:
                return
            st = self.host[load.unit]
            piece = self._piece(slot, load.unit)
            pairs = [] if self.lend else [(piece[: st.stream.numel()], st.stream)]
            if load.extra and not self.lend:
                total = sum(x.numel() for x in load.extra)
                if slot.extra is None or slot.extra.numel() < total:
                    slot.extra = None
                    slot.extra = self.t.device_empty(total, load.extra[0].dtype)
                off = 0
                for x in load.extra:
                    pairs.append((slot.extra[off : off + x.numel()], x.reshape(-1)))
                    off += x.numel()
            deps = [slot.free, self.ready.get(load.unit, READY), *load.deps]
            slot.key = load.key
            slot.loaded = self.t.h2d(pairs, deps, label=f"{load.key}@{slot.name}")
            if self.dist is not None:
                slot.loaded = self._gather(slot, load.unit, piece, slot.loaded)
            self.by_key[load.key] = (slot, load)
            self.layer_loads += load.unit.startswith("layer.")
            self.pos += 1

    def _piece(self, slot: Slot, unit: str) -> torch.Tensor:
        """Where this rank's slice of `unit` goes in the slot (the whole buffer when unsharded)."""
        if self.dist is None:
            return slot.flat
        n = self.device_numel(unit) // self.dist.world
        return slot.flat[self.dist.rank * n : (self.dist.rank + 1) * n]

    def _gather(self, slot: Slot, unit: str, piece: torch.Tensor, copied: Event) -> Event:
        """All-gather the unit into the slot once this rank's slice has arrived."""
        assert self.dist is not None
        d, full = self.dist, slot.flat[: self.device_numel(unit)]

        def job() -> None:
            copied.host_wait()
            d.all_gather(full, piece)

        return FutureEvent(d.submit(job))

    def acquire(self, key: str) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Weights of `key` as named device views, and its extra tensors (shaped like the host ones)."""
        slot, load = self.by_key[key]
        self.t.wait(slot.loaded)  # also, when lending, the load's dependencies
        st = self.host[load.unit]
        if self.lend:
            source, where, extras = st.stream, "host", list(load.extra)
        else:
            source, where, extras, off = slot.flat, slot.name, [], 0
            for x in load.extra:
                assert slot.extra is not None
                extras.append(slot.extra[off : off + x.numel()].view(x.shape))
                off += x.numel()
        views = self._views.get((where, load.unit))
        if views is None:
            views = self._views[(where, load.unit)] = st.views(source)
        return views, extras

    def release(self, key: str) -> None:
        """Compute is done with `key`'s buffer: it may be refilled once that compute completes."""
        slot, _ = self.by_key.pop(key)
        slot.key, slot.free = None, self.t.record()
        self._issue()
