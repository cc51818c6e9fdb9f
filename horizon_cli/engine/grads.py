"""Gradient sums on the device and their trip to the host: the output side of the backward stage.

Per step the training step (engine.step) accumulates each trained unit's parameter gradients of
every micro-batch in fp32 on the device and sends the sum to the unit's host grad once:

    layers     two ping-pong fp32 buffers (n_layer,): the D2H of one overlaps the next layer's
               backward; a buffer is zeroed again only once its previous copy has landed
    head       its own fp32 buffer, once per step; with a tied (or sharded) embedding the
               embedding's too, which the LM head's gradient then goes into
    wire       in bf16-gradient runs two narrow (n_layer,) copies carry the sums over the link
    loops      a unit a loop calls more than once (arch.calls) sums the gradients of all its calls
               in an fp32 buffer of its own, sent once after its earliest call's backward
    direct     when the transport shares host memory (`device: cpu` without an emulated link)
               and gradients stay fp32, sums accumulate straight into the host buffers: no copy
    release    (optim.grad_release) one rank: a unit's sum crosses in chunks (`send_chunks`),
               each into the next of the pool's few fixed-size host buffers (state.pool), and is
               handed to its update as it lands (engine.release); sums then stay on the device
               (no `direct`). Several ranks: the reduce-scatter's slice lands in a pool buffer

Sharded runs size the buffers for the whole padded unit (parallel.shard.padded_numel); the
reduce-scatter there sends each rank's slice to the host instead of `send`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..parallel.shard import padded_numel
from ..runtime.events import READY, Event
from ..runtime.transport import Transport
from ..state.host import HostState
from ..state.slices import spans

Views = dict[str, torch.Tensor]  # a gradient buffer's views by tensor name
# a release run's taker of one chunk of a unit's gradient: (a, b, host buffer, its landing) -> the
# event of its reader being done with the buffer (engine.release)
Chunk = Callable[[int, int, torch.Tensor, Event], Event]
Chunks = Callable[[str, list[torch.Tensor]], Chunk]  # (unit, its norm's pieces) -> its taker


class GradSums:
    """The device's fp32 gradient accumulators of a step, and their copies to the host."""

    def __init__(
        self,
        transport: Transport,
        host: HostState,
        trained: list[str | None],
        grad_dtype: torch.dtype,
        *,
        world: int = 1,
        full: bool = True,
        embed_on_device: bool = False,
        repeated: list[str] | None = None,
    ):
        """trained: per layer the unit whose gradient it produces (None: none). world: ranks of a
        sharded run (buffers padded for the scatter). full: the head and embedding are trained (not
        LoRA). embed_on_device: the embedding's gradient is summed on the device (tied or sharded).
        repeated: the units a loop calls more than once (each gets a buffer of its own)."""
        self.t, self.host, self.world, self.full = transport, host, world, full
        self.sharded = world > 1
        n_layer = max((self.numel(u) for u in trained if u is not None), default=0)
        narrow = grad_dtype != torch.float32
        # accumulate into the host buffers (a sharded rank's host holds only its slice; a release
        # run's hold none per unit)
        self.chunked = host.chunks is not None
        self.direct = transport.shares_host and not narrow and not self.sharded and not self.chunked
        self.acc = [] if self.direct else [transport.device_empty(n_layer, torch.float32) for _ in range(2)]
        self.free: list[Event] = [READY, READY]  # per accumulator: the copy that last read it
        self._views: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        share = narrow and not transport.shares_host and not self.sharded
        self.wire = [transport.device_empty(n_layer, grad_dtype) for _ in range(2)] if share else None
        self.head: torch.Tensor | None = None
        self.embed: torch.Tensor | None = None
        self.loop = {
            u: self.host[u].grad if self.direct else transport.device_empty(self.numel(u), torch.float32)
            for u in repeated or []
        }
        self.loop_free: dict[str, Event] = {}  # per loop buffer: the copy that last read it
        if full:
            self._alloc_head(embed_on_device)

    def numel(self, unit: str) -> int:
        """Elements of a unit's fp32 gradient sum on the device (sharded: padded for the scatter;
        a LoRA run's adapters are whole on every rank and not padded)."""
        n = self.host[unit].layout.numel
        return padded_numel(n, self.world) if self.sharded and self.full else n

    def _alloc_head(self, embed_on_device: bool) -> None:
        self.head = (
            self.host["head"].grad if self.direct else self.t.device_empty(self.numel("head"), torch.float32)
        )
        self.shared_embed = embed_on_device and self.t.shares_host and not self.sharded
        if embed_on_device:  # the embedding's host grad is always fp32
            self.embed = (
                self.host["embed"].grad
                if self.shared_embed
                else self.t.device_empty(self.numel("embed"), torch.float32)
            )

    def nbytes(self) -> int:
        """Device bytes of the accumulators (those that are not the host's own buffers)."""
        hosts = {id(st.grad) for st in self.host.units.values()}
        own = [
            g
            for g in [*self.acc, *(self.wire or []), self.head, self.embed, *self.loop.values()]
            if g is not None
        ]
        return sum(g.numel() * g.element_size() for g in own if id(g) not in hosts)

    def buffer(self, unit: str | None, k: int) -> tuple[torch.Tensor | None, Views | None]:
        """A trained unit's fp32 gradient sum (accumulator k, or its host buffer), zeroed, and its
        views by tensor name."""
        if unit is None:
            return None, None
        if self.wire is None:
            self.t.wait(self.free[k])  # its previous contents have reached the host
        g = self.host.take(unit) if self.direct else self.acc[k][: self.numel(unit)]
        g.zero_()
        gv = self._views.get((k, unit))
        if gv is None:
            gv = self._views[(k, unit)] = self.host[unit].views(g)
        return g, gv

    def loop_buffer(self, unit: str | None, fresh: bool) -> tuple[torch.Tensor | None, Views | None]:
        """The fp32 gradient sum of a unit a loop calls more than once, and its views: zeroed at
        its first call in the backward (`fresh`), added to by the others."""
        if unit is None:
            return None, None
        g = self.loop[unit]
        if fresh:
            self.t.wait(self.loop_free.get(unit, READY))  # the last step's sum has reached the host
            g.zero_()
        gv = self._views.get((-1, unit))
        if gv is None:
            gv = self._views[(-1, unit)] = self.host[unit].views(g)
        return g, gv

    def send(self, unit: str, g: torch.Tensor, k: int | None) -> Event:
        """Copy a unit's fp32 gradient sum to its host buffer, narrowed to grad_dtype on the device
        first (through wire buffer k; the head, once per step, through a temporary)."""
        dst = self.host.take(unit)
        if g is dst:  # accumulated in place (shared host memory)
            return READY
        if self.t.shares_host:  # no link: narrow straight into the host buffer
            dst.copy_(g)
            return READY
        if dst.dtype != g.dtype:
            if k is None:
                g = g.to(dst.dtype)
            else:
                assert self.wire is not None
                self.t.wait(self.free[k])  # the wire buffer's previous copy has landed
                g = self.wire[k][: g.numel()].copy_(g)
        return self.t.d2h([(dst, g)], [self.t.record()], label=f"g-{unit}")

    def send_chunks(self, unit: str, g: torch.Tensor, k: int | None, each: Chunk) -> Event:
        """A release run on one rank: copy a unit's fp32 gradient sum to the host chunk by chunk
        (state.slices.spans), narrowed to grad_dtype on the device first as `send` does; `each`
        is told every chunk as it is queued (a, b, the host buffer, its landing) and returns when
        its reader is done with the buffer. Over a link each copy waits for its buffer's last
        reader on the copy thread, so this returns at once and the backward goes on (the device
        has the next layer to compute while AdamW reads this one's chunks). Returns the last
        chunk's landing (the sum, and the wire buffer, are then free)."""
        pool = self.host.chunks
        assert pool is not None
        st, dtype = self.host[unit], self.host.grad_dtype
        if not self.t.shares_host and dtype != g.dtype:
            if k is None:
                g = g.to(dtype)
            else:
                assert self.wire is not None
                self.t.wait(self.free[k])  # the wire buffer's previous copy has landed
                g = self.wire[k][: g.numel()].copy_(g)
        computed = READY if self.t.shares_host else self.t.record()
        landed: Event = READY
        for a, b in spans(st.segments, pool.elems):
            c, buf, free = pool.chunk(b - a)
            if self.t.shares_host:  # no link: narrow straight into the host buffer
                free.host_wait()
                buf.copy_(g[a:b])
            else:  # the copy thread waits for the buffer's last reader: the backward goes on;
                # and for the chunk before (the last landing then means every one has landed)
                landed = self.t.d2h([(buf, g[a:b])], [computed, free, landed], label=f"g-{unit}")
            pool.give_chunk(c, each(a, b, buf, landed))
        return landed


def sumsq(g: torch.Tensor, chunk: int = 1 << 18, one_pass: bool | None = None) -> list[torch.Tensor]:
    """Pieces of the squared L2 norm of a flat fp32 buffer, to be summed in fp64: one fp32 dot over
    10^8 elements (an embedding, an MoE layer) is off by ~1e-2 relative, over 2^18 by ~1e-7.

    one_pass (default: on CUDA): one reduction accumulating in fp64 (the fp32 elements widened as
    they are read, no copy), the norm squared: one launch per buffer where the chunks took ~830
    per 8B layer (~3,300 per 70B layer), and more exact. The CPU keeps the chunked dots, so its
    numbers are what they were, bitwise."""
    if one_pass if one_pass is not None else g.is_cuda:
        return [torch.linalg.vector_norm(g, dtype=torch.float64).square()] if g.numel() else []
    return [torch.dot(g[a : a + chunk], g[a : a + chunk]) for a in range(0, g.numel(), chunk)]


def sumsq64(g: torch.Tensor) -> float:
    """Squared L2 norm of a flat fp32 buffer: `sumsq`'s pieces summed in fp64, on the host."""
    return float(torch.stack(sumsq(g)).double().sum()) if g.numel() else 0.0
