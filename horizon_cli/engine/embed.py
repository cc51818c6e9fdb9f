"""The embedding stage of a step: the input rows at its start, the embedding's gradient at its end.

Two tables (engine.seams.EmbeddingTable), chosen once (engine.parts):

    HostEmbedding     one rank. forward: rows gathered on the host from the streaming copy (the
                      table never crosses the link) and sent as the step's first activations
                      (in the copy's dtype: a narrower one, lean's bf16 or a bf16 base computing
                      in fp32, is upcast on the device, state.widen);
                      backward: the input gradient (n, H) comes back to the host and is
                      scatter-added into the fp32 (V, H) grad there
    ShardedEmbedding  several ranks: the host holds a slice of the table, so it is all-gathered
                      on the device like any unit and the rows picked there; its gradient is
                      summed densely on the device and reduce-scattered (engine.sharded)

Families that scale the embedding output (Gemma: by sqrt(hidden)) scale both directions alike.

The engine's parts hold the stage before layer 0 (engine.seams.Embedding): `TextStage`, the table
with nothing in front of it, or a stage that wraps the table (vision.embed.VisionEmbedding).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..arch import ArchSpec
from ..data.batch import MicroBatch
from ..optim.adamw import AdamWHyper
from ..runtime.events import READY, Event
from ..runtime.loader import Load, Loader
from ..runtime.transport import Transport
from ..state.frozen import FrozenUnit
from ..state.host import HostState, UnitState
from .grads import GradSums, sumsq64
from .seams import B, EmbeddingTable, Inputs
from .sharded import ShardedGrads

Units = dict[str, UnitState | FrozenUnit]  # every unit's streaming copy


class TableEmbedding:
    """What both tables share: the family's scale, and the rows' split into micro-batches."""

    ahead = 1  # loads begun before the embedding's rows are sent (layer 0's)

    def loads(self) -> list[Load]:
        """Loads before layer 0's: none (the rows are gathered on the host)."""
        return []

    def __init__(
        self,
        transport: Transport,
        loader: Loader,
        units: Units,
        host: HostState,
        spec: ArchSpec,
        dtype: torch.dtype,
        scale: float | None,
    ):
        """units: every unit's streaming copy (LoRA: the frozen base's); host: the trained units'
        state (the embedding's grad, when trained). scale: the family's embedding scale, or None."""
        self.t, self.loader, self.units, self.host = transport, loader, units, host
        self.spec, self.dtype = spec, dtype
        # the scale in the compute dtype, on the device once: a per-step copy from pageable memory
        # would make the host wait for the device (twice a step, the second after the backward)
        self._scale = (
            None if scale is None else torch.tensor(scale, dtype=torch.float32).to(dtype).to(transport.device)
        )

    def reserve(self, numel: int, grad: bool) -> None:
        """Size any host staging once (grad: the embedding is trained)."""

    def scale(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        """Families that scale the embedding output (Gemma: by sqrt(hidden), in the compute dtype)
        scale its gradient by the same factor."""
        s = self._scale
        return x if s is None else [xm * s for xm in x]

    def _split(self, rows: torch.Tensor, mbs: Inputs) -> list[torch.Tensor]:
        """Rows of every micro-batch, flat or (n, H) -> (b, T, H) per micro-batch."""
        flat, out, off = rows.reshape(-1), [], 0
        for mb in mbs:
            n = mb.input_ids.numel() * self.spec.hidden
            out.append(flat[off : off + n].view(*mb.input_ids.shape, self.spec.hidden))
            off += n
        return out


class HostEmbedding(TableEmbedding):
    """One rank: host staging for the rows and their gradient."""

    def __init__(
        self,
        transport: Transport,
        loader: Loader,
        units: Units,
        host: HostState,
        spec: ArchSpec,
        dtype: torch.dtype,
        scale: float | None,
    ):
        super().__init__(transport, loader, units, host, spec, dtype, scale)
        self.staging: dict[str, torch.Tensor] = {}

    def reserve(self, numel: int, grad: bool) -> None:
        self._stage("embed_rows", numel, self.units["embed"].stream.dtype)
        if grad:
            self._stage("embed_dx", numel)
            self._compact(numel // self.spec.hidden)

    def _compact(self, rows: int) -> torch.Tensor:
        """A compact embedding gradient (UnitState.rows) of at least `rows` rows (at most the
        vocabulary's; grow-only, sized once from the step's tokens), its first `rows` rows."""
        st, width = self.host["embed"], self.spec.hidden
        cap = min(rows, self.spec.vocab) * width
        if st.grad.numel() < cap:
            st.grad = torch.zeros(cap, dtype=torch.float32)
        return st.grad[: rows * width]

    def _stage(self, name: str, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        buf = self.staging.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            if buf is not None:
                self.t.host_release(buf)
            buf = self.staging[name] = self.t.host_empty(numel, dtype)
        return buf[:numel]

    def forward(self, mbs: Inputs) -> list[torch.Tensor]:
        """The input rows per micro-batch, (b, T, H) on the device (not yet scaled): gathered on
        the host (no weight transfer) and sent."""
        self.loader.ready.get("embed", READY).host_wait()
        embed = self.units["embed"]
        table = embed.views(embed.stream)["embed"]  # (V, H)
        ids = torch.cat([mb.input_ids.reshape(-1) for mb in mbs])
        rows = self._stage("embed_rows", ids.numel() * self.spec.hidden, table.dtype)
        torch.index_select(table, 0, ids, out=rows.view(-1, self.spec.hidden))
        dev = self.t.device_empty(rows.numel(), table.dtype)
        self.t.wait(self.t.h2d([(dev, rows)], label="embed"))
        return self._split(dev if dev.dtype == self.dtype else dev.to(self.dtype), mbs)  # exact upcast

    def backward(self, dx: list[torch.Tensor], mbs: list[MicroBatch], ready: dict[str, Event]) -> float:
        """Scatter-add the input gradient into the embedding's fp32 grad, on the host (after a tied
        LM head's dense gradient, `ready["embed"]`). Returns the grad's squared norm."""
        st = self.host["embed"]
        self.host.take("embed")  # a release run's too is its own buffer on one rank (state.pool)
        n = sum(d.numel() for d in dx)
        host_dx = self._stage("embed_dx", n)
        pairs, off = [], 0
        for d in dx:
            pairs.append((host_dx[off : off + d.numel()], d.reshape(-1)))
            off += d.numel()
        ev = self.t.d2h(pairs, [self.t.record()], label="g-embed-rows")
        if self.spec.tie_embeddings:
            ready.get("embed", READY).host_wait()  # the LM head's dense grad came first
        elif st.rows is None:  # a table with more in its unit: zeroed whole
            st.grad.zero_()
        ev.host_wait()
        ids = torch.cat([mb.input_ids.reshape(-1) for mb in mbs])
        dx_rows = host_dx.view(-1, self.spec.hidden)
        if st.rows is not None:  # compact: the rows this step touched, in order (UnitState.rows;
            # issue 42's full-vocabulary zero and norm: a step's few thousand rows, not 10^5)
            rows, at = ids.unique(sorted=True, return_inverse=True)
            g = self._compact(rows.numel()).zero_()
            embed_grad(g.view(-1, self.spec.hidden), ids, dx_rows, self.spec.padding_idx, at)
            st.rows = rows
            ready["embed"] = READY
            return sumsq64(g)
        embed_grad(st.views(st.grad)["embed"], ids, dx_rows, self.spec.padding_idx)
        ready["embed"] = READY
        return sumsq64(st.grad)


class ShardedEmbedding(TableEmbedding):
    """Several ranks: the table gathered on the device, its gradient reduce-scattered."""

    ahead = 2  # the table's gather and layer 0's

    def loads(self) -> list[Load]:
        """The embedding table, gathered on the device first."""
        return [Load("embed-in", "embed")]

    def __init__(
        self,
        transport: Transport,
        loader: Loader,
        units: Units,
        host: HostState,
        spec: ArchSpec,
        dtype: torch.dtype,
        scale: float | None,
        sharded: ShardedGrads,
        grads: GradSums,
    ):
        super().__init__(transport, loader, units, host, spec, dtype, scale)
        self.sharded: ShardedGrads = sharded
        self.grads: GradSums = grads

    def forward(self, mbs: Inputs) -> list[torch.Tensor]:
        """Pick the input rows from the embedding table all-gathered on the device."""
        w, _ = self.loader.acquire("embed-in")
        ids = torch.cat([mb.input_ids.reshape(-1) for mb in mbs])
        rows = embed_rows(w["embed"], ids).to(self.dtype)  # (n, H); a narrow table's: upcast
        self.loader.release("embed-in")
        return self._split(rows, mbs)

    def backward(self, dx: list[torch.Tensor], mbs: list[MicroBatch], ready: dict[str, Event]) -> float:
        """The embedding's gradient on the device (a tied head's already in the buffer),
        reduce-scattered; `ready["embed"]` is set to its slice having landed on the host. Its
        squared norm is counted with the other slices' (engine.sharded): 0.0 here."""
        embed_g = self.grads.embed
        assert embed_g is not None
        if not self.spec.tie_embeddings:
            embed_g.zero_()
        ids = torch.cat([mb.input_ids.reshape(-1) for mb in mbs]).to(embed_g.device)
        rows = torch.cat([d.reshape(-1, self.spec.hidden) for d in dx])  # (n, H)
        embed_grad(self.host["embed"].views(embed_g)["embed"], ids, rows, self.spec.padding_idx)
        self.host.take("embed")  # release: its slice's host buffer (state.pool)
        ready["embed"] = self.sharded.reduce("embed", embed_g, "embed")
        return 0.0


class TextStage:
    """The stage before layer 0 with nothing in front of the table (no images): the table's rows
    and gradient as they are, the micro-batch's own positions, nothing else trained or saved."""

    stage_trained = False

    def __init__(self, table: EmbeddingTable) -> None:
        self.table = table
        self.ahead = table.ahead

    def loads(self) -> list[Load]:
        return self.table.loads()

    def reserve(self, numel: int, grad: bool) -> None:
        self.table.reserve(numel, grad)

    def forward(self, mbs: Inputs) -> list[torch.Tensor]:
        return self.table.forward(mbs)

    def backward(self, dx: list[torch.Tensor], mbs: list[MicroBatch], ready: dict[str, Event]) -> float:
        return self.table.backward(dx, mbs, ready)

    def scale(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.table.scale(x)

    def positioned(self, mb: B) -> B:
        return mb

    def stage_backward(self, dx: list[torch.Tensor]) -> float:
        return 0.0  # nothing trained besides the table

    def across_ranks(self, sharded: ShardedGrads) -> None:
        pass  # nothing to sum over the ranks

    def update(self, h: AdamWHyper) -> None:
        pass  # the table is a unit: the optimizer worker updates it

    def save_state(self, ck: Path) -> dict[str, int]:
        return {}

    def load_state(self, ck: Path, sums: dict[str, int]) -> None:
        pass


def embed_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The input rows (n, H) of the gathered (V, H) table on the device."""
    return table.index_select(0, ids.to(table.device))


def embed_grad(
    table_g: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    padding_idx: int | None,
    at: torch.Tensor | None = None,
) -> None:
    """Scatter-add the input gradient's rows (n, H) into the dense fp32 (V, H) embedding gradient
    where it lies (the host's, or a sharded run's on the device), or into a compact one at `at`
    (each id's row there); the padding row, as nn.Embedding(padding_idx), gets none. `rows` may
    be overwritten (an fp32 one is used as is)."""
    rows = rows.to(torch.float32)
    if padding_idx is not None:
        rows[ids == padding_idx] = 0.0
    table_g.index_add_(0, ids if at is None else at, rows)
