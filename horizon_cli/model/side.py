"""Side inputs: tensors besides the hidden state that cross layers with a gradient.

Two kinds reach a layer of the generic path (model.generic):

  recorded  arguments the stack's owner computes from trained weights before the layers and passes
            to layers after the first (Gemma 4's per-layer inputs; arch.probe's `side`): their
            producer is the first layer's capture
  passed    float outputs a layer returns and its model passes to the next layer (Zaya's router
            states; arch.probe's `passes`): their producer is that layer
  shared    entries a layer writes into a dict its model gives every layer, which later layers
            read (Gemma 4's `shared_kv_states`: the keys and values a "store" layer computed, which
            its KV-sharing layers attend with): their producer is the layer that wrote them in the
            forward; a later layer reads them as its forward saw them (`shared_in`, `shared_out`)

Under autograd a consumer layer takes each as a leaf of its own, so its graph stays one layer deep
(invariant 3). The engine's backward differentiates those leaves with the layer's own (`inputs`,
`give`); the producer's backward then adds (tensor * its consumers' gradient).sum() to the auxiliary
scalar it seeds with 1 (`seed`), whose gradient is exactly that one. The backward runs top-down,
so every consumer's gradient is known by the time its producer's backward runs.

Memory, per micro-batch on the device: a consumer's gradient is the size of the argument itself
(Gemma 4: the per-layer width per token and layer, about as much as the recorded per-layer inputs
the forward already holds), kept until the producer's backward; one tensor given to several layers
(Zamba's embedding output) keeps one gradient, summed in fp32. Shared entries: the forward's keys
and values of each storing layer (per layer type) stay referenced until the step ends, and their
KV-sharing readers' gradients until the storing layer's backward: a few layers' K/V per micro-batch,
not in the memory plan.
"""

from __future__ import annotations

import copy
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SideState:
    """One micro-batch's side inputs across a training step."""

    leaves: dict[int, list[tuple[tuple, torch.Tensor]]] = field(default_factory=dict)  # layer -> (key, leaf)
    grads: dict[tuple, torch.Tensor] = field(default_factory=dict)  # key -> its consumers' gradient
    keys: dict[int, tuple] = field(default_factory=dict)  # id(recorded tensor) -> its key
    live_calls: dict | None = None  # the first layer's capture under autograd, until its backward
    live_out: dict[int, dict[Any, torch.Tensor]] = field(default_factory=dict)  # passed outputs, with graph
    wrote: dict[tuple, int] = field(default_factory=dict)  # (dict argument, entry) -> its forward's writer
    seen: dict[int, dict[tuple, tuple[int, Any]]] = field(default_factory=dict)  # layer -> what it could read

    def begin(self, i: int) -> None:
        """Layer i runs under autograd: the leaves of its previous run are gone."""
        self.leaves[i] = []

    def recorded(self, i: int, slots: list[tuple[str, Any]], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Layer i's recorded side arguments, each a leaf of its own; a tensor recorded for several
        layers keeps one key (the first slot that took it)."""
        new, kw = list(args), dict(kwargs)
        for how, key in slots:
            v = new[key] if how == "arg" else kw.get(key)
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                continue
            k = self.keys.setdefault(id(v), ("in", i, how, key))  # ctx.calls holds v: its id is stable
            leaf = v.detach().requires_grad_()
            self.leaves[i].append((k, leaf))
            if how == "arg":
                new[key] = leaf
            else:
                kw[key] = leaf
        return tuple(new), kw

    def shared_in(self, i: int, kwargs: dict) -> tuple[dict, dict]:
        """Layer i's call with the dicts its model shares between layers: (its kwargs, {name: (the
        dict it gets, the shared one, its entries before the call, its forward's run?)}). The
        forward's run records what earlier layers wrote there; under autograd layer i gets a copy
        holding those entries as the forward saw them, each tensor a leaf of its own."""
        dicts = {
            n: d for n, d in kwargs.items() if isinstance(d, MutableMapping)
        }  # KVSharingDict: a UserDict
        if not dicts:
            return kwargs, {}
        first = i not in self.seen  # the forward's run (a recompute reads what that one saw)
        if first:
            self.seen[i] = {
                (n, k): (self.wrote[(n, k)], d[k])
                for n, d in dicts.items()
                for k in d
                if (n, k) in self.wrote
            }
        given, kw = {}, dict(kwargs)
        for n, d in dicts.items():
            mine = d
            if torch.is_grad_enabled():
                mine = kw[n] = copy.copy(d)
                for (name, k), (src, v) in self.seen[i].items():
                    if name == n:
                        mine[k] = type(v)(
                            self.passed(i, src, ("shared", n, k, j), t) for j, t in enumerate(v)
                        )
            given[n] = (mine, d, dict(mine), first)  # the entries themselves: an id can be reused
        return kw, given

    def shared_out(self, i: int, given: dict) -> None:
        """What layer i wrote into the shared dicts: its forward's run records it as the writer;
        under autograd the entries keep their graph (its backward seeds them) and reach the shared
        dict detached, for the layers after it."""
        for n, (mine, shared, before, first) in given.items():
            for k, v in list(mine.items()):
                if before.get(k) is v or not _tensors(v):
                    continue
                if first:
                    self.wrote[(n, k)] = i
                if mine is not shared:
                    for j, t in enumerate(v):
                        self.produced(i, ("shared", n, k, j), t)
                    shared[k] = type(v)(t.detach() for t in v)

    def passed(self, i: int, src: int, k, v: torch.Tensor) -> torch.Tensor:
        """Output k of layer src as layer i's input: a leaf of its own."""
        leaf = v.detach().requires_grad_()
        self.leaves[i].append((("out", src, k), leaf))
        return leaf

    def produced(self, i: int, k: Any, v: torch.Tensor) -> None:
        """Layer i's passed output k, with its graph (the producer's backward seeds it)."""
        if v.requires_grad:
            self.live_out.setdefault(i, {})[k] = v

    def inputs(self, i: int) -> list[torch.Tensor]:
        """The leaves layer i's last autograd run made: the engine differentiates them too."""
        return [leaf for _, leaf in self.leaves.get(i, [])]

    def give(self, i: int, grads) -> None:
        """Their gradients, in the order of `inputs` (None: not reached)."""
        for (k, _), g in zip(self.leaves.pop(i, []), grads, strict=True):
            if g is not None:
                old = self.grads.get(k)
                self.grads[k] = g if old is None else old.float() + g

    def seed(self, i: int, first: bool) -> torch.Tensor | None:
        """Layer i's producer term: (tensor * gradient).sum() over what it produced (the first
        layer: the recorded side arguments of its capture; any layer: its passed outputs)."""
        terms = []
        if first and self.live_calls is not None:
            live, self.live_calls = self.live_calls, None
            for k in [k for k in self.grads if k[0] == "in"]:
                g = self.grads.pop(k)
                _, j, how, key = k
                v = live[j][0][key] if how == "arg" else live[j][1][key]
                if v.requires_grad:
                    terms.append((v * g).sum())
        for j, v in self.live_out.pop(i, {}).items():
            if ("out", i, j) in self.grads:
                terms.append((v * self.grads.pop(("out", i, j))).sum())
        return sum(terms[1:], terms[0]) if terms else None


def _tensors(v) -> bool:
    """A shared entry horizon carries: a tuple or list of float tensors (keys, values)."""
    return (
        isinstance(v, (tuple, list))
        and bool(v)
        and all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in v)
    )


def plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The sum of two optional scalars."""
    return b if a is None else a if b is None else a + b
