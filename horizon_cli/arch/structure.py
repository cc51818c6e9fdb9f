"""The forward's structure as typed, frozen data (arch.probe finds it; arch.generic_arch.GenericArch
holds it as its `model`):

    Stack         where the pieces are and how the owner's forward runs around the layers
    Crossing      a tensor besides the hidden state that reaches a layer: [at, "arg" | "kw", key]

Read from and written to the store manifest's JSON as GenericArch is (its module doc).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .record import Record, missing

Dim = int | str  # a boundary dim: "b" (rows), "T" (tokens) or a size
How = Literal["arg", "kw"]  # a layer argument by position or by keyword
Logits = Literal["plain", "forward"]  # the head module's output, or the CausalLM's forward per chunk


@dataclass(frozen=True)
class Crossing:
    """[at, how, key]: side inputs — layer `at` takes a tensor computed before the layers as its
    positional argument `key` (how "arg") or keyword `key` ("kw"); passes — a layer's output `at`
    goes to the next layer's argument `key`."""

    at: int
    how: How
    key: int | str

    @staticmethod
    def from_list(v: list[Any]) -> Crossing:
        return Crossing(v[0], v[1], v[2])

    def to_list(self) -> list[Any]:
        return [self.at, self.how, self.key]


STACK_KEYS = (
    "prefix",
    "suffix",
    "forwarded",
    "passes",
    "side",
    "side_width",
    "stack",
    "owner",
    "base",
    "embed",
    "head",
    "returns",
    "calls",
    "owner_kwargs",
    "logits",
)


@dataclass(frozen=True)
class Stack(Record):
    """The forward's structure (arch.probe's module doc): module paths of the stack, its owner, the
    base model, embedding, head; the owner's modules before (prefix) and after (suffix) the layers;
    what a layer returns (0: a tensor, k: a k-tuple); the layer of each call; the inputs the
    owner's forward takes; the logits mode ("plain" | "forward"); the extra outputs a layer passes
    on and where the next takes them; side inputs and their elements per token; a loop's junctions
    (call -> the earlier calls its input reads; None: no loop); the boundary dims (None: (b, T,
    hidden))."""

    stack: str
    owner: str
    base: str
    embed: str
    head: str
    prefix: tuple[str, ...]
    suffix: tuple[str, ...]
    returns: int
    calls: tuple[int, ...]
    owner_kwargs: tuple[str, ...]
    logits: Logits
    forwarded: tuple[int, ...] = ()
    passes: tuple[Crossing, ...] = ()
    side: tuple[Crossing, ...] = ()
    side_width: int = 0
    junctions: Mapping[int, tuple[int, ...]] | None = None
    boundary: tuple[Dim, ...] | None = None

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Stack:
        junctions = d.get("junctions")
        boundary = d.get("boundary")
        return Stack(
            stack=d["stack"],
            owner=d["owner"],
            base=d["base"],
            embed=d["embed"],
            head=d["head"],
            prefix=tuple(d["prefix"]),
            suffix=tuple(d["suffix"]),
            returns=d["returns"],
            calls=tuple(d["calls"]),
            owner_kwargs=tuple(d.get("owner_kwargs", ())),
            logits=d["logits"],
            forwarded=tuple(d.get("forwarded", ())),
            passes=tuple(Crossing.from_list(p) for p in d.get("passes", ())),
            side=tuple(Crossing.from_list(p) for p in d.get("side", ())),
            side_width=d.get("side_width", 0),
            junctions=None if junctions is None else {int(k): tuple(v) for k, v in junctions.items()},
            boundary=None if boundary is None else tuple(boundary),
            absent=missing(d, STACK_KEYS),
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "prefix": list(self.prefix),
            "suffix": list(self.suffix),
            "forwarded": list(self.forwarded),
            "passes": [p.to_list() for p in self.passes],
            "side": [p.to_list() for p in self.side],
            "side_width": self.side_width,
            "stack": self.stack,
            "owner": self.owner,
            "base": self.base,
            "embed": self.embed,
            "head": self.head,
            "returns": self.returns,
            "calls": list(self.calls),
            "owner_kwargs": list(self.owner_kwargs),
            "logits": self.logits,
        }
        if self.junctions is not None:
            d["junctions"] = {str(k): list(v) for k, v in self.junctions.items()}
        if self.boundary is not None:
            d["boundary"] = list(self.boundary)
        return self._written(d)
