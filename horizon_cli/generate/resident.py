"""A resident copy of the policy for generation: every layer's weights (and the head) held on the
device in a weight-only format (quant.weight_only: full, fp8, int8, nf4), so a decode sweep reads
them from device memory instead of streaming each layer over the link.

    ResidentCopy.refresh(engine, fmt)   the copy of the host weights as they are now: each unit's
                                        stream crosses the link once (in the compute dtype, into a
                                        staging buffer, two of them in flight) and is quantized on
                                        the device as it arrives (full: copied into place). The
                                        link carries the model once per refresh, not once per token
    ResidentCopy.loader()               a loader for generate.decode's sweep (the runtime.loader
                                        interface the sweep and its passes use: begin, fill,
                                        acquire, release): a layer's narrowed tensors are
                                        dequantized into one device buffer of the compute dtype
                                        when the layer runs; full: views of the copy itself
    ResidentCopy.close()                the device memory handed back (before the training step)

The head (and a tied embedding) stays in the compute dtype, as vLLM keeps lm_head unquantized.
The device's own accounting (transport.memory) holds "resident copy" and "resident staging" while
the copy lives. Not for sharded engines or LoRA runs (the rollout engine streams those).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..engine import Engine
from ..quant.weight_only import QTensor, quantize
from ..runtime.loader import Load, Streamed

STAGING = 2  # units in flight over the link during a refresh


def copy_units(engine: Engine) -> list[str]:
    """The units a resident copy holds: every layer, the head, a tied head's embedding."""
    p = engine.p
    return [*p.layers, "head", *(["embed"] if p.spec.tie_embeddings else [])]


@dataclass
class Unit:
    """One unit of the copy: full: its flat stream on the device; else its tensors by name."""

    flat: torch.Tensor | None
    tensors: dict[str, QTensor]

    def nbytes(self) -> int:
        if self.flat is not None:
            return self.flat.numel() * self.flat.element_size()
        return sum(q.nbytes() for q in self.tensors.values())


class ResidentCopy:
    def __init__(self, engine: Engine, fmt: str):
        self.engine, self.fmt = engine, fmt
        self.t = engine.p.t
        self.host: Mapping[str, Streamed] = engine.p.loader.host
        self.units: dict[str, Unit] = {}
        self.scratch: torch.Tensor | None = None  # a layer dequantized, the compute dtype
        self.refresh_s = 0.0
        self.refresh_bytes = 0  # bytes the refresh moved over the link

    @classmethod
    def refresh(cls, engine: Engine, fmt: str) -> ResidentCopy:
        """The copy of the host weights now (the optimizer's queued updates landed first)."""
        engine.wait()
        c = cls(engine, fmt)
        with engine.guard():
            c._fill()
        return c

    def _fill(self) -> None:
        t0, h2d0 = time.perf_counter(), self.t.stats.h2d_bytes
        names = copy_units(self.engine)
        full = [u for u in names if self.fmt == "full" or not u.startswith("layer.")]
        narrow = [u for u in names if u not in full]
        for u in full:  # straight into place
            st = self.host[u]
            flat = self.t.device_empty(st.stream.numel(), st.stream.dtype)
            self.t.wait(self.t.h2d([(flat, st.stream)], label=f"resident {u}"))
            self.units[u] = Unit(flat, {})
            self._account()
        if narrow:
            self._quantize_all(narrow)
        self.t.synchronize()
        self.refresh_s = time.perf_counter() - t0
        self.refresh_bytes = self.t.stats.h2d_bytes - h2d0

    def _quantize_all(self, names: list[str]) -> None:
        """Each unit over the link into a staging buffer, quantized there as it arrives; the next
        units' copies in flight meanwhile."""
        numel = max(self.host[u].stream.numel() for u in names)
        dtype = self.host[names[0]].stream.dtype
        stage = [self.t.device_empty(numel, dtype) for _ in range(min(STAGING, len(names)))]
        self.t.memory.set("resident staging", sum(s.numel() * s.element_size() for s in stage))
        sent = []
        for k, u in enumerate(names[: len(stage)]):
            sent.append(self._send(u, stage[k]))
        for k, u in enumerate(names):
            buf = stage[k % len(stage)]
            self.t.wait(sent[k])
            st = self.host[u]
            views = st.views(buf[: st.stream.numel()])
            self.units[u] = Unit(None, {n: quantize(v, self.fmt) for n, v in views.items()})
            self._account()
            if k + len(stage) < len(names):  # the buffer is free once this compute is done
                sent.append(self._send(names[k + len(stage)], buf))
        self.t.synchronize()
        stage.clear()
        self.t.memory.set("resident staging", 0)
        self.scratch = self.t.device_empty(numel, dtype)
        self.t.memory.set("resident dequantized layer", numel * dtype.itemsize)

    def _send(self, unit: str, buf: torch.Tensor):
        st = self.host[unit]
        return self.t.h2d(
            [(buf[: st.stream.numel()], st.stream)], [self.t.record()], label=f"resident {unit}"
        )

    def _account(self) -> None:
        self.t.memory.set("resident copy", self.nbytes())

    def nbytes(self) -> int:
        return sum(u.nbytes() for u in self.units.values())

    def weights(self, unit: str) -> dict[str, torch.Tensor]:
        """The unit's tensors by name on the device, in the stream's dtype (a narrowed layer:
        dequantized into the scratch buffer, valid until the next layer's)."""
        st, u = self.host[unit], self.units[unit]
        if u.flat is not None:
            return st.views(u.flat)
        assert self.scratch is not None
        views = st.views(self.scratch[: st.stream.numel()])
        for n, q in u.tensors.items():
            q.dequantize(views[n])
        return views

    def loader(self) -> ResidentLoader:
        return ResidentLoader(self)

    def close(self) -> None:
        """The copy's device memory back (on CUDA: to the caching allocator, for the step)."""
        self.units.clear()
        self.scratch = None
        for k in ("resident copy", "resident staging", "resident dequantized layer"):
            self.t.memory.set(k, 0)

    def __enter__(self) -> ResidentCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ResidentLoader:
    """runtime.loader.Loader's interface over a resident copy: nothing crosses the link; a load is
    its unit's weights from the copy when the compute acquires it."""

    def __init__(self, copy: ResidentCopy):
        self.copy = copy
        self.host = copy.host
        self.ready: dict = {}  # every host copy is current: the refresh waited for the optimizer
        self.by_key: dict[str, Load] = {}
        self.layer_loads = 0  # decoder-layer weight transfers: none

    def begin(self, seq: list[Load], ahead: int | None = None) -> None:
        assert all(not load.extra for load in seq), "a resident copy's loads carry no extras"
        self.by_key = {load.key: load for load in seq}

    def fill(self) -> None:
        pass

    def acquire(self, key: str) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        return self.copy.weights(self.by_key[key].unit), []

    def release(self, key: str) -> None:
        self.by_key.pop(key)

    def extra_bytes(self) -> int:
        return 0

    def reserve_extra(self, numel: int, dtype: torch.dtype) -> None:
        raise AssertionError("a resident copy decodes with its KV cache on the device")
