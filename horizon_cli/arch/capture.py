"""Running a transformers model's own code around streamed layers ("capture").

The generic path streams decoder layers one at a time, so the model-level code around them (what
`XxxModel.forward` does before its loop over the layers, what it does after, what the
`XxxForCausalLM.forward` does with the head) must run in pieces. Rather than re-implementing that
code per family, horizon runs transformers' own:

  before the layers  the stack's owner (`XxxModel`) runs its forward with every layer's `forward`
                     replaced by a recorder: each records the (args, kwargs) the owner passes it
                     (masks per layer type, rotary tables, ALiBi, positions, the cache) and returns
                     its hidden-state input unchanged; the last layer the owner calls stops the
                     forward (`Stop`). The token embedding module computes with the rows gathered
                     on the host (`rows_embedding`), so the table never has to be on the device,
                     while whatever the module does after the lookup (Gemma's scale) still runs.
                     The first recorded hidden state is the input of layer 0, with the autograd
                     graph of everything the owner did to it (multipliers, learned positions,
                     embedding norms).
  the layers         transformers' own layer modules, called with the recorded arguments and the
                     running hidden state (`layer_call`).
  after the layers   the owner's modules called after its last layer, in order (the final norm,
                     found by call order: its name varies), and the CausalLM's own forward with its
                     base model replaced by a stub that returns the hidden rows (`head_stub`): its
                     logit scaling, soft-capping or slicing runs as transformers wrote it.

arch.probe runs the same machinery once on the meta device to learn the structure; model.generic
runs it for real on every micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class Stop(Exception):
    """Raised by the recorder of the last layer the owner calls: nothing after it runs."""


Call = tuple[int, tuple, dict]  # (layer index, args, kwargs) as the owner passed them


def hidden_of(args: tuple, kwargs: dict):
    """The hidden-state input of a layer call (first positional argument, or `hidden_states`)."""
    if args:
        return args[0]
    return kwargs.get("hidden_states")


def with_hidden(args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[tuple, dict]:
    """A recorded call's arguments with the hidden state replaced by x."""
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


@contextlib.contextmanager
def recorders(
    layers: list[nn.Module],
    log: list[Call],
    returns: int,
    stop_at: int | None,
    extras: tuple = (),
    stop_call: int | None = None,
    outputs: dict[int, torch.Tensor] | None = None,
) -> Iterator[None]:
    """While inside: layer i's forward records its call into `log` and returns its hidden input
    (`returns` 0: the tensor itself; k > 0: a k-tuple, the rest None — what a layer that returns
    extra outputs gives when they are off, or `extras`); the call of layer `stop_at` raises Stop.
    By call (the k-th call the owner makes, a layer run in a loop counting each time): call
    `stop_call` raises Stop, and call k returns `outputs[k]` where given (a layer's real output:
    the code between the calls of a loop then computes with it)."""
    rest = tuple(extras) or (None,) * max(returns - 1, 0)

    def recorder(i: int):
        def forward(*args, **kwargs):
            k = len(log)
            log.append((i, args, kwargs))
            if i == stop_at or k == stop_call:
                raise Stop
            h = outputs[k] if outputs is not None and k in outputs else hidden_of(args, kwargs)
            return (h, *rest) if returns else h

        return forward

    for i, layer in enumerate(layers):
        layer.forward = recorder(i)  # an instance attribute: the class's forward is untouched
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


@contextlib.contextmanager
def rows_embedding(emb: nn.Module, rows: torch.Tensor) -> Iterator[None]:
    """While inside: the token embedding module looks its ids up in `rows` (b, T, H) — the rows
    the host gathered for exactly those ids — through the module's own forward, so what it does
    after the lookup runs unchanged. Its padding row gets its zero gradient from the engine, by
    token id (engine.embed), so the module's padding_idx is off meanwhile."""
    from torch.nn.utils.stateless import _reparametrize_module

    b, T = rows.shape[:2]

    def forward(ids, *args, **kwargs):
        if tuple(ids.shape) != (b, T):
            raise RuntimeError(f"embedding called with ids {tuple(ids.shape)}, rows are for {(b, T)}")
        index = torch.arange(b * T, device=rows.device).view(b, T)
        pad = getattr(emb, "padding_idx", None)
        setattr(emb, "padding_idx", None)  # noqa: B010 (nn.Module's attribute typing says Tensor | Module)
        try:
            with _reparametrize_module(emb, {"weight": rows.reshape(b * T, -1)}):
                return type(emb).forward(emb, index, *args, **kwargs)
        finally:
            setattr(emb, "padding_idx", pad)  # noqa: B010

    emb.forward = forward
    try:
        yield
    finally:
        del emb.forward


class _Base(nn.Module):
    """Stands in for the CausalLM's base model: returns the hidden rows it was given. Any
    attribute it does not have is itself (OPT's CausalLM calls `self.model.decoder(...)`), and the
    output has None for every field but the hidden state (router logits, cross-attentions)."""

    def __init__(self, h: torch.Tensor, real: nn.Module):
        super().__init__()
        self.h = h
        object.__setattr__(self, "real", real)  # not a submodule

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or name == "real":
                raise
            value = getattr(self.real, name, self)
            return self if isinstance(value, nn.Module) else value

    def forward(self, *args, **kwargs):
        return _output(self.h)


def _output(h: torch.Tensor):
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class Output(BaseModelOutputWithPast):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return Output(last_hidden_state=h)


@contextlib.contextmanager
def head_stub(model: nn.Module, base: str, h: torch.Tensor) -> Iterator[None]:
    """While inside: the CausalLM's child `base` (its base model, which holds the stack) returns
    `h` (1, n, H) for last_hidden_state, so `model(inputs_embeds=h)` runs only the CausalLM's own
    code after its base model: the head and whatever it does to the logits."""
    real = model._modules[base]
    assert real is not None
    stub = _Base(h, real)
    model._modules[base] = stub
    try:
        yield
    finally:
        model._modules[base] = real


def materialize_buffers(root: nn.Module, modules: list[nn.Module], device) -> None:
    """Give the non-persistent buffers of `modules` (meta: rotary inverse frequencies, embedding
    scales, position ids, Falcon-H1's mup vectors) real values on `device`, as transformers does
    when it loads a model built on the meta device: a fill, then the model's own `_init_weights`
    on each module that holds one and on every module above it (Falcon-H1's model writes its
    layers' vectors; parameters stay on the meta device, untouched); a buffer still at the fill
    is an error (its value would be garbage)."""
    init = getattr(root, "_init_weights", None)
    fresh: list[tuple[nn.Module, str]] = []
    holders: set[int] = set()
    for mod in modules:
        for path, sub in mod.named_modules():
            for n in sub._non_persistent_buffers_set:
                buf = sub._buffers.get(n)
                if buf is not None and buf.device.type == "meta":
                    sub._buffers[n] = torch.full_like(buf, _unset(buf.dtype), device=device)
                    fresh.append((sub, n))
                    above = [
                        m for p, m in mod.named_modules() if not p or path == p or path.startswith(p + ".")
                    ]
                    holders.update(id(m) for m in above)
    if not fresh:
        return
    if init is not None:
        with torch.no_grad():
            for mod in modules:
                for sub in mod.modules():
                    if id(sub) in holders:
                        init(sub)
    for sub, n in fresh:
        b = sub._buffers[n]
        unset = b is not None and b.dtype != torch.bool and b.numel() and bool((b == _unset(b.dtype)).all())
        if b is None or b.device.type == "meta" or unset:
            raise RuntimeError(f"{type(sub).__name__}.{n}: its value cannot be rebuilt")


def _unset(dtype: torch.dtype):
    """A fill no initialiser leaves in a whole buffer (the float one is the largest finite value:
    NaN compares unequal to itself)."""
    if dtype.is_floating_point:
        return torch.finfo(dtype).max
    return False if dtype == torch.bool else torch.iinfo(dtype).min


@contextlib.contextmanager
def packed_positions(owner: nn.Module, pos: torch.Tensor) -> Iterator[None]:
    """While inside: transformers' mask functions, as the owner's module calls them, get the
    micro-batch's position ids even where the model's code does not pass them (gpt-oss, ...), so
    packed documents — positions restarting at 0 — get the block-diagonal masks transformers builds
    from position ids (find_packed_sequence_indices)."""
    import inspect
    import sys

    import transformers.masking_utils as mu

    module = sys.modules[type(owner).__module__]
    real = {
        k: f
        for k, f in vars(module).items()
        if callable(f)
        and getattr(f, "__module__", "") == mu.__name__
        and k.startswith("create_")
        and "position_ids" in inspect.signature(f).parameters
    }

    def wrap(f):
        def call(*args, **kwargs):
            if kwargs.get("position_ids") is None and kwargs.get("cache") is None:
                kwargs["position_ids"] = pos
            return f(*args, **kwargs)

        return call

    for k, f in real.items():
        setattr(module, k, wrap(f))
    try:
        yield
    finally:
        for k, f in real.items():
            setattr(module, k, f)
