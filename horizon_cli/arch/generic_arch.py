"""The generic path's architecture description as typed, frozen data (what arch.generic derives).

    GenericArch   the model: its transformers class, config and attention, the tensor tables of
                  `embed`, every layer kind and `head` (TensorRow, DiskPart), which kind each layer
                  is, the tensors carried untouched, routing (Moe), the recurrent mixers' measured
                  working sets (Mixer) and the forward's structure (Stack, arch.probe)
    (the forward's structure, Stack and Crossing: arch.structure; their common base: arch.record)

The store manifest holds it as JSON (`to_dict` / `from_dict`) with a `version` in its section.
Manifests written before the version (version 0) hold the same keys without it; older ones lack
some keys (stores from before the probe: no `model`, `class`, `carried`, ...; their pre-probe
keys are kept as `legacy`). `from_dict` reads every form; `to_dict` writes back exactly what was
read, so the JSON a model fingerprint hashes (`to_dict(versioned=False)`) is unchanged for a
store converted before (store.ckpt.model_fingerprint).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .record import Record, missing
from .structure import Dim, Stack

VERSION = 1  # 0: the same JSON without a version (stores converted before it)


@dataclass(frozen=True)
class DiskPart:
    """A checkpoint tensor filling part of an in-memory tensor, from element `at` of its region."""

    hf: str
    shape: tuple[int, ...]
    at: int

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> DiskPart:
        return DiskPart(d["hf"], tuple(d["shape"]), d["at"])

    def to_dict(self) -> dict[str, Any]:
        return {"hf": self.hf, "shape": list(self.shape), "at": self.at}


@dataclass(frozen=True)
class TensorRow:
    """One in-memory tensor of a unit (arch.generic._entry): its engine name, in-memory name
    (`{i}` for the layer index in a kind), shape, whether it trains, the disk tensors that fill
    it; `after`: the tensor it follows in one region (a split of one disk tensor, no parts of its
    own); `dtype`: an integer buffer's dtype (held as floats in the unit)."""

    name: str
    hf: str
    shape: tuple[int, ...]
    trainable: bool
    parts: tuple[DiskPart, ...]
    after: str | None = None
    dtype: str | None = None

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> TensorRow:
        parts = tuple(DiskPart.from_dict(p) for p in d["parts"])
        return TensorRow(
            d["name"], d["hf"], tuple(d["shape"]), d["trainable"], parts, d.get("after"), d.get("dtype")
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "hf": self.hf,
            "shape": list(self.shape),
            "trainable": self.trainable,
            "parts": [p.to_dict() for p in self.parts],
        }
        if self.after is not None:
            out["after"] = self.after
        if self.dtype is not None:
            out["dtype"] = self.dtype
        return out

    def at_layer(self, i: int) -> TensorRow:
        """The row of layer i: `{i}` filled in its names."""
        fill = str(i)
        return replace(
            self,
            hf=self.hf.replace("{i}", fill),
            parts=tuple(replace(p, hf=p.hf.replace("{i}", fill)) for p in self.parts),
            after=None if self.after is None else self.after.replace("{i}", fill),
        )


Table = tuple[TensorRow, ...]


def _table(rows: list[Mapping[str, Any]]) -> Table:
    return tuple(TensorRow.from_dict(r) for r in rows)


def _rows(table: Table) -> list[dict[str, Any]]:
    return [r.to_dict() for r in table]


@dataclass(frozen=True)
class Units:
    """The tables of the model-level units (the layers' are kinds)."""

    embed: Table
    head: Table

    def of(self, unit: str) -> Table:
        if unit not in ("embed", "head"):
            raise KeyError(unit)
        return self.embed if unit == "embed" else self.head


@dataclass(frozen=True)
class Moe:
    """Routing (arch.generic._moe): the router class, which of its outputs are the logits, experts,
    top-k, the routed layers, the auxiliary loss coefficient (None: reported, not trained)."""

    router: str
    logits_index: int
    n_experts: int
    top_k: int
    layers: tuple[int, ...]
    aux_coef: float | None

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Moe:
        return Moe(
            d["router"], d["logits_index"], d["n_experts"], d["top_k"], tuple(d["layers"]), d["aux_coef"]
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "logits_index": self.logits_index,
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "layers": list(self.layers),
            "aux_coef": self.aux_coef,
        }


@dataclass(frozen=True)
class Mixer:
    """A layer kind's recurrent mixer (arch.workset): its path in the layer, and per dtype name
    the bytes it saves for its backward as (fixed per row, per token)."""

    module: str
    saved: Mapping[str, tuple[float, float]]

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Mixer:
        return Mixer(d["module"], {k: (v[0], v[1]) for k, v in d.items() if k != "module"})

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, **{k: list(v) for k, v in self.saved.items()}}


GENERIC_KEYS = (
    "config",
    "class",
    "attn",
    "family",
    "layer_class",
    "prefix",
    "model",
    "units",
    "kinds",
    "layer_kinds",
    "carried",
    "moe",
    "recurrent",
    "workset",
    "embed_scale",
    "softcap",
)


@dataclass(frozen=True)
class GenericArch(Record):
    """A generic architecture (arch.generic's module doc). `config`: config.json as transformers'
    config class reads it; `cls`: the transformers class (None: what the causal-LM mapping builds,
    a store from before it was recorded); `prefix`: the stack's path and a dot; `model`: the
    forward's structure (None: a store from before the probe, probed from its config when loaded);
    `embed_scale`, `softcap`: what such a store recorded of its embedding scale and logit cap;
    `legacy`: its other keys, which nothing reads."""

    config: Mapping[str, Any]
    attn: str
    family: str
    layer_class: str
    prefix: str
    units: Units
    kinds: Mapping[str, Table]
    layer_kinds: tuple[str, ...]
    cls: str | None = None
    model: Stack | None = None
    carried: tuple[str, ...] = ()
    moe: Moe | None = None
    recurrent: tuple[str, ...] = ()
    workset: Mapping[str, Mixer] = field(default_factory=dict)
    embed_scale: float | None = None
    softcap: float | None = None
    legacy: Mapping[str, Any] = field(default_factory=dict)
    version: int = field(default=VERSION, compare=False)  # the form it was read from

    # -- reading ---------------------------------------------------------------------------------
    def layer_table(self, i: int) -> Table:
        """Layer i's table, `{i}` as in its kind."""
        return self.kinds[self.layer_kinds[i]]

    @property
    def boundary(self) -> tuple[Dim, ...] | None:
        """The dims of what crosses layers (None: (b, T, hidden))."""
        return None if self.model is None else self.model.boundary

    def __getitem__(self, key: str) -> Any:
        """The manifest's JSON form of one key (readers written against the dict it once was)."""
        return self.to_dict(versioned=False)[key]

    # -- the manifest ----------------------------------------------------------------------------
    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> GenericArch:
        """Any manifest form (module doc); ValueError for one written by a newer horizon."""
        version = d.get("version", 0)
        if not isinstance(version, int) or not 0 <= version <= VERSION:
            raise ValueError(
                f"arch.generic.version {version!r}: this horizon reads versions 0 to {VERSION} (a newer one wrote it?)"
            )
        model, moe = d.get("model"), d.get("moe")
        units = d["units"]
        return GenericArch(
            config=copy.deepcopy(dict(d["config"])),
            attn=d["attn"],
            family=d["family"],
            layer_class=d["layer_class"],
            prefix=d["prefix"],
            units=Units(_table(units["embed"]), _table(units["head"])),
            kinds={k: _table(rows) for k, rows in d["kinds"].items()},
            layer_kinds=tuple(d["layer_kinds"]),
            cls=d.get("class"),
            model=None if model is None else Stack.from_dict(model),
            carried=tuple(d.get("carried", ())),
            moe=None if moe is None else Moe.from_dict(moe),
            recurrent=tuple(d.get("recurrent", ())),
            workset={k: Mixer.from_dict(v) for k, v in (d.get("workset") or {}).items()},
            embed_scale=d.get("embed_scale"),
            softcap=d.get("softcap"),
            legacy={k: copy.deepcopy(v) for k, v in d.items() if k not in (*GENERIC_KEYS, "version")},
            absent=missing(d, GENERIC_KEYS),
            version=version,
        )

    def to_dict(self, versioned: bool = True) -> dict[str, Any]:
        """The manifest's JSON form; versioned=False: without the version (a fingerprint's)."""
        d: dict[str, Any] = {
            "config": copy.deepcopy(dict(self.config)),
            "class": self.cls,
            "attn": self.attn,
            "family": self.family,
            "layer_class": self.layer_class,
            "prefix": self.prefix,
            "model": None if self.model is None else self.model.to_dict(),
            "units": {"embed": _rows(self.units.embed), "head": _rows(self.units.head)},
            "kinds": {k: _rows(rows) for k, rows in self.kinds.items()},
            "layer_kinds": list(self.layer_kinds),
            "carried": list(self.carried),
            "moe": None if self.moe is None else self.moe.to_dict(),
            "recurrent": list(self.recurrent),
            "workset": {k: m.to_dict() for k, m in self.workset.items()},
        }
        if self.model is None:  # a store from before the probe: its keys of that time
            d.pop("model")
            d.update(embed_scale=self.embed_scale, softcap=self.softcap)
        d = self._written(d)
        d.update(copy.deepcopy(dict(self.legacy)))
        if versioned:
            d["version"] = VERSION
        return d
