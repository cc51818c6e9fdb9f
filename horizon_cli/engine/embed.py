"""The embedding stage of a step: the input rows at its start, the embedding's gradient at its end.

    one rank   forward: rows gathered on the host from the streaming copy (the table never crosses
               the link) and sent as the step's first activations; backward: the input gradient
               (n, H) comes back to the host and is scatter-added into the fp32 (V, H) grad there
    sharded    the host holds a slice of the table, so it is all-gathered on the device like any
               unit and the rows picked there; its gradient is summed densely on the device and
               reduce-scattered (engine.sharded)

Families that scale the embedding output (Gemma: by sqrt(hidden)) scale both directions alike.
"""

from __future__ import annotations

import torch

from ..arch import ArchSpec
from ..data.batch import MicroBatch
from .events import READY, Event
from .grads import sumsq64
from .loader import Loader
from .sharded import ShardedGrads


class Embedding:
    """Host staging for the rows and their gradient, and the embedding's forward and backward."""

    def __init__(
        self,
        transport,
        loader: Loader,
        units: dict,
        host,
        spec: ArchSpec,
        dtype: torch.dtype,
        scale: float | None,
        sharded: ShardedGrads | None,
    ):
        """units: every unit's streaming copy (LoRA: the frozen base's); host: the trained units'
        state (the embedding's grad, when trained). scale: the family's embedding scale, or None."""
        self.t, self.loader, self.units, self.host = transport, loader, units, host
        self.spec, self.dtype, self.sharded = spec, dtype, sharded
        # the scale in the compute dtype, on the device once: a per-step copy from pageable memory
        # would make the host wait for the device (twice a step, the second after the backward)
        self._scale = (
            None if scale is None else torch.tensor(scale, dtype=torch.float32).to(dtype).to(transport.device)
        )
        self.staging: dict[str, torch.Tensor] = {}

    def reserve(self, numel: int, grad: bool) -> None:
        """Size the host staging once (one rank; grad: the embedding is trained)."""
        if self.sharded is not None:
            return
        self._stage("embed_rows", numel)
        if grad:
            self._stage("embed_dx", numel)

    def _stage(self, name: str, numel: int) -> torch.Tensor:
        buf = self.staging.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != self.dtype:
            if buf is not None:
                self.t.host_release(buf)
            buf = self.staging[name] = self.t.host_empty(numel, self.dtype)
        return buf[:numel]

    def scale(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        """Families that scale the embedding output (Gemma: by sqrt(hidden), in the compute dtype)
        scale its gradient by the same factor."""
        s = self._scale
        return x if s is None else [xm * s for xm in x]

    def forward(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """The input rows per micro-batch, (b, T, H) on the device (not yet scaled)."""
        return self._gather(mbs) if self.sharded is None else self._pick(mbs)

    def _gather(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """Gather embedding rows on the host (no weight transfer) and send the activations."""
        self.loader.ready.get("embed", READY).host_wait()
        embed = self.units["embed"]
        table = embed.views(embed.stream)["embed"]  # (V, H)
        ids = torch.cat([mb.input_ids.reshape(-1) for mb in mbs])
        rows = self._stage("embed_rows", ids.numel() * self.spec.hidden)
        torch.index_select(table, 0, ids, out=rows.view(-1, self.spec.hidden))
        dev = self.t.device_empty(rows.numel(), self.dtype)
        self.t.wait(self.t.h2d([(dev, rows)], label="embed"))
        out, off = [], 0
        for mb in mbs:
            n = mb.input_ids.numel() * self.spec.hidden
            out.append(dev[off : off + n].view(*mb.input_ids.shape, self.spec.hidden))
            off += n
        return out

    def _pick(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """Pick the input rows from the embedding table all-gathered on the device."""
        w, _ = self.loader.acquire("embed-in")
        ids = torch.cat([mb.input_ids.reshape(-1) for mb in mbs])
        rows = embed_rows(w["embed"], ids)  # (n, H)
        self.loader.release("embed-in")
        out, off = [], 0
        for mb in mbs:
            n = mb.input_ids.numel()
            out.append(rows[off : off + n].view(*mb.input_ids.shape, self.spec.hidden))
            off += n
        return out

    def backward_sharded(
        self, dx: list[torch.Tensor], mbs: list[MicroBatch], embed_g: torch.Tensor, ready: dict[str, Event]
    ) -> None:
        """The embedding's gradient on the device (a tied head's already in `embed_g`),
        reduce-scattered; `ready["embed"]` is set to its slice having landed on the host."""
        assert self.sharded is not None
        if not self.spec.tie_embeddings:
            embed_g.zero_()
        ids = torch.cat([mb.input_ids.reshape(-1) for mb in mbs]).to(embed_g.device)
        rows = torch.cat([d.reshape(-1, self.spec.hidden) for d in dx])  # (n, H)
        embed_grad(self.host["embed"].views(embed_g)["embed"], ids, rows, self.spec.padding_idx)
        ready["embed"] = self.sharded.reduce("embed", embed_g, "embed")

    def backward(self, dx: list[torch.Tensor], mbs: list[MicroBatch], ready: dict[str, Event]) -> float:
        """Scatter-add the input gradient into the embedding's fp32 grad, on the host (after a tied
        LM head's dense gradient, `ready["embed"]`). Returns the grad's squared norm."""
        st = self.host["embed"]
        n = sum(d.numel() for d in dx)
        host_dx = self._stage("embed_dx", n)
        pairs, off = [], 0
        for d in dx:
            pairs.append((host_dx[off : off + d.numel()], d.reshape(-1)))
            off += d.numel()
        ev = self.t.d2h(pairs, [self.t.record()], label="g-embed-rows")
        if self.spec.tie_embeddings:
            ready.get("embed", READY).host_wait()  # the LM head's dense grad came first
        else:
            st.grad.zero_()
        ev.host_wait()
        ids = torch.cat([mb.input_ids.reshape(-1) for mb in mbs])
        embed_grad(st.views(st.grad)["embed"], ids, host_dx.view(-1, self.spec.hidden), self.spec.padding_idx)
        ready["embed"] = READY
        return sumsq64(st.grad)


def embed_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The input rows (n, H) of the gathered (V, H) table on the device."""
    return table.index_select(0, ids.to(table.device))


def embed_grad(table_g: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, padding_idx: int | None) -> None:
    """Scatter-add the input gradient's rows (n, H) into the dense fp32 (V, H) embedding gradient
    where it lies (the host's, or a sharded run's on the device); the padding row, as
    nn.Embedding(padding_idx), gets none. `rows` may be overwritten (an fp32 one is used as is)."""
    rows = rows.to(torch.float32)
    if padding_idx is not None:
        rows[ids == padding_idx] = 0.0
    table_g.index_add_(0, ids, rows)
