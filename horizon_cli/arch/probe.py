"""The structure of a CausalLM's forward, observed once on the meta device (no memory, no weights).

arch.capture's recorders stand in for the layers while the stack's owner runs its forward on a
meta input, and hooks on the owner's other modules record the order of calls. From that:

  calls      which layers the owner calls, in order (a layer it skips, as Mllama's cross-attention
             layers without images, is left out of the forward); a layer called twice is a loop
  chain      each layer's input is the previous layer's output untouched: the model-level code is
             a prefix, the layers, a suffix — the shape the streamed engine runs
  prefix     the owner's modules called before layer 0 (embeddings, learned positions, embedding
             norms, rotary) — their tensors travel with layer 0
  suffix     the owner's modules after its last layer, each taking the previous one's output (the
             final norm, whatever its name); their tensors go with the head
  logits     "plain" when the CausalLM's logits are its head's output, else "forward": its own
             forward runs per logits chunk (arch.capture.head_stub) for scaling, soft-capping, ...
  side       arguments of layers after the first that depend on trained weights (per-layer
             embeddings, the embedding output fed to every layer): their gradients go back to the
             first layer's capture (model.generic)

Anything the engine cannot split this way raises InputError naming what the model does.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from .calls import is_loop, junctions
from .capture import Stop, head_stub, hidden_of, recorders
from .crossing import side_inputs, side_width
from .stack import find_stack, path_of
from .structure import Crossing, Logits, Stack

T = 4  # probe tokens


def _first(x):
    if isinstance(x, (tuple, list)):
        return x[0] if x else None
    return getattr(x, "last_hidden_state", x)


def owner_kwargs(owner: nn.Module) -> list[str]:
    """Which of the standard inputs the owner's forward takes (by name, or through **kwargs)."""
    params = inspect.signature(type(owner).forward).parameters
    varkw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    want = ("input_ids", "position_ids", "attention_mask", "use_cache", "cache", "past_key_values")
    return [k for k in want if k in params or (varkw and k in ("position_ids",))]


def _inputs(names: list[str], device="meta", b: int = 1, t: int = T) -> dict[str, Any]:
    # no position_ids: the mask functions' packed-sequence check reads their values
    kw: dict[str, Any] = {"input_ids": torch.zeros(b, t, dtype=torch.long, device=device)}
    if "use_cache" in names:
        kw["use_cache"] = False
    return kw


def _record(
    owner, layers, returns: int, watched: dict[str, nn.Module], names, stop_at=None, extras=(), rows=(1, T)
):
    """One meta forward of the owner: the event list and what it returned."""
    events: list[tuple] = []
    log: list = []
    handles = []

    def on_module(path):
        def hook(mod, args, out):
            events.append(("mod", path, args[0] if args else None, _first(out), mod))

        return hook

    for path, m in watched.items():
        handles.append(m.register_forward_hook(on_module(path)))

    class Log(list):
        def append(self, item):
            super().append(item)
            events.append(("layer", item[0], hidden_of(item[1], item[2]), item))

    log = Log()
    out = None
    try:
        with (
            torch.enable_grad(),
            recorders(layers, log, returns, stop_at, extras),
            _no_packing_check(),
            contextlib.suppress(Stop),
        ):
            out = owner(**_inputs(names, b=rows[0], t=rows[1]))
    finally:
        for h in handles:
            h.remove()
    return events, out


@contextlib.contextmanager
def _no_packing_check():
    """transformers' mask functions and its padding warning (a config with `pad_token_id`: GPT-2
    fine-tunes) read values (packed rows in the position ids, padding in the mask or the ids) that
    the meta device has not: they skip those checks when tracing, as the probe says."""
    import transformers.masking_utils as mu
    import transformers.modeling_utils as mo

    real = mu.is_tracing, mo.is_tracing
    mu.is_tracing = mo.is_tracing = lambda *a, **k: True
    try:
        yield
    finally:
        mu.is_tracing, mo.is_tracing = real


def _real_returns(layer: nn.Module, call) -> int | None:
    """What a layer returns: 0 a tensor, k a k-tuple (run on the meta device; None if it cannot)."""
    _, args, kwargs = call
    try:
        with torch.no_grad():
            out = layer(*args, **kwargs)
    except Exception:  # noqa: BLE001 (meta kernels are incomplete: the chain check decides)
        return None
    return len(out) if isinstance(out, (tuple, list)) else 0


class _Extra:
    """Stands for a layer's extra output in the probe: is it passed on to the next layer?"""


def _forwarded(owner, layers, returns: int, watched, names) -> tuple[list[int], tuple[Crossing, ...]]:
    """(positions 1, 2, ... of a layer's extra outputs that the owner passes to the next layer —
    all of them when the owner cannot run with stand-ins —, and where the next layer takes each:
    [k, "kw", name] or [k, "arg", index])."""
    if returns < 2:
        return [], ()
    marks = tuple(_Extra() for _ in range(returns - 1))
    try:
        events, _ = _record(owner, layers, returns, watched, names, stop_at=1, extras=marks)
    except Exception:  # noqa: BLE001 (the owner computes with them)
        return list(range(1, returns)), ()
    calls = [e[3] for e in events if e[0] == "layer"]
    if len(calls) < 2:
        return [], ()
    _, args, kwargs = calls[1]
    where = [Crossing(k + 1, "arg", j) for k, m in enumerate(marks) for j, v in enumerate(args) if v is m]
    where += [Crossing(k + 1, "kw", n) for k, m in enumerate(marks) for n, v in kwargs.items() if v is m]
    return sorted({w.at for w in where}), tuple(where)


def probe(model: nn.Module, where: str) -> Stack:
    """The forward's structure (module doc) of a CausalLM built on the meta device."""
    stack = find_stack(model, where)
    owner_path = stack.rpartition(".")[0]
    if not owner_path:
        raise InputError(f"{where}: the decoder stack sits in the CausalLM itself: no base model to run")
    owner = model.get_submodule(owner_path)
    layers = list(model.get_submodule(stack).children())
    lm: Any = model  # a PreTrainedModel
    emb, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    emb_path, head_path = path_of(model, emb), path_of(model, head)
    if emb_path is None or not emb_path.startswith(owner_path + "."):
        raise InputError(f"{where}: the token embedding is not inside {type(owner).__name__}")
    if head is None or head_path is None:
        raise InputError(f"{where}: {type(model).__name__} has no output embedding (LM head)")
    names = owner_kwargs(owner)
    stack_attr = stack[len(owner_path) + 1 :]
    watched = {f"{owner_path}.{n}": m for n, m in owner.named_children() if n != stack_attr.split(".")[0]}
    first, _ = _record(owner, layers, 0, watched, names, stop_at=0)
    layer_events = [e for e in first if e[0] == "layer"]
    if not layer_events:
        raise InputError(f"{where}: {type(owner).__name__}'s forward calls no decoder layer")
    boundary = _boundary(owner, layers, watched, names, layer_events[0][2], _config(model), where)
    real = _real_returns(layers[layer_events[0][1]], layer_events[0][3])
    tried: list[Exception] = []
    for returns in [real] if real is not None else [0, 1, 2, 3]:
        try:
            events, out = _record(owner, layers, returns, watched, names)
            calls = [e[1] for e in events if e[0] == "layer"]
            prefix, suffix = _chain(events, out, where, type(owner).__name__, boundary, loop=is_loop(calls))
            break
        except Exception as e:  # noqa: BLE001 (another return convention may fit)
            tried.append(e)
    else:
        bad = next((x for x in tried if isinstance(x, InputError)), tried[0])
        raise bad if isinstance(bad, InputError) else InputError(f"{where}: {type(owner).__name__}: {bad}")
    last = _first(out)
    if (
        boundary is not None
        and isinstance(last, torch.Tensor)
        and tuple(last.shape) != (1, T, _hidden_size(model))
    ):
        raise InputError(
            f"{where}: {type(owner).__name__} passes several residual streams {tuple(boundary)} between its layers "
            f"and returns {tuple(last.shape)}, not (batch, tokens, hidden): its modules after the last layer do "
            "not merge the streams"
        )
    forwarded, passes = _forwarded(owner, layers, returns, watched, names)
    junction_map = None
    if is_loop(calls):  # arch.calls: the engine runs the calls; the code between them is re-run
        if forwarded:
            raise InputError(
                f"{where}: {type(owner).__name__} passes layer outputs to the next call in a loop: not supported"
            )
        junction_map = junctions(
            lambda outs: _calls_with(owner, layers, returns, names, outs), owner, stack, where
        )
    side = side_inputs(events, where)
    width = side_width(events, side, T)
    if side and is_loop(calls):
        raise InputError(
            f"{where}: {type(owner).__name__} gives layers tensors computed before the layers inside a loop: "
            "not supported"
        )
    return Stack(
        stack=stack,
        owner=owner_path,
        base=owner_path.split(".")[0],
        embed=emb_path,
        head=head_path,
        prefix=tuple(prefix),
        suffix=tuple(suffix),
        returns=returns,
        calls=tuple(calls),
        owner_kwargs=tuple(names),
        logits=_logits_mode(model, owner_path.split(".")[0], head, where),
        forwarded=tuple(forwarded),
        passes=passes,
        side=side,
        side_width=width,
        junctions=junction_map,
        boundary=None if boundary is None else tuple(boundary),
    )


def _boundary(owner, layers, watched, names, h0, cfg, where: str) -> list | None:
    """The shape of the tensor the owner passes between its layers as a function of the rows b and
    tokens T: None for (b, T, hidden_size), else its dims ("b", "T" or a size: several residual
    streams, (b, T, streams, H) or (b, T, streams * H)), read off a second probe of other (b, T)."""
    H = getattr(cfg.get_text_config(), "hidden_size", None)
    if not isinstance(h0, torch.Tensor) or not isinstance(H, int) or tuple(h0.shape) == (1, T, H):
        return None
    b2, t2 = 3, 7  # neither 1 nor T: each dim that changes is the rows' or the tokens'
    try:
        events, _ = _record(owner, layers, 0, watched, names, stop_at=0, rows=(b2, t2))
        h2 = next(e[2] for e in events if e[0] == "layer")
    except Exception as e:  # noqa: BLE001 (a model that runs one input size only)
        raise InputError(
            f"{where}: {type(owner).__name__} passes a hidden state of shape {tuple(h0.shape)} between its "
            f"layers, which a probe of ({b2}, {t2}) tokens cannot relate to rows and tokens ({type(e).__name__}: {e})"
        ) from e
    form: list = []
    for d1, d2 in zip(h0.shape, h2.shape, strict=False) if h0.dim() == h2.dim() else ():
        form.append("b" if (d1, d2) == (1, b2) else "T" if (d1, d2) == (T, t2) else d1 if d1 == d2 else None)
    if form.count("b") != 1 or form.count("T") != 1 or None in form:
        raise InputError(
            f"{where}: {type(owner).__name__} passes a hidden state of shape {tuple(h0.shape)} between its "
            f"layers for (1, {T}) tokens and {tuple(h2.shape)} for ({b2}, {t2}): not (rows, tokens, ...)"
        )
    return form


def _chain(
    events: list[tuple], out, where: str, owner_name: str, boundary=None, loop: bool = False
) -> tuple[list[str], list[str]]:
    """Prefix and suffix modules from the event order; InputError when the stack is not chained
    (a loop: the code between its calls is arch.calls's junctions, without trained weights)."""
    idx = [k for k, e in enumerate(events) if e[0] == "layer"]
    a, b = idx[0], idx[-1]
    between = sorted({e[1] for e in events[a:b] if e[0] == "mod"})
    weighted = [m for m in between if loop and next(_module(events, m).parameters(), None) is not None]
    if weighted:
        raise InputError(
            f"{where}: {owner_name} runs {', '.join(weighted)}, which has trained weights, between the "
            "calls of its loop: model-level modules with weights between layers are not supported"
        )
    if between and not loop:
        raise InputError(
            f"{where}: {owner_name} runs {', '.join(between)} between its layers: model-level code "
            "between layers is not supported"
        )
    for k, k2 in zip(idx, idx[1:], strict=False):
        # a view of the whole output passes (Gemma 4 slices its inputs [:, -0:] before KV sharing)
        if not loop and not _same(events[k2][2], _returned(events[k])):
            raise InputError(
                f"{where}: {owner_name} changes the hidden state between layers {events[k][1]} and "
                f"{events[k2][1]}: not a chained stack"
            )
    h = _returned(events[b])
    suffix = []
    for e in events[b + 1 :]:
        if e[0] != "mod" or e[2] is not h:
            if boundary is not None:
                dims = ", ".join(map(str, boundary))
                raise InputError(
                    f"{where}: {owner_name} merges its residual streams ({dims}) after its last layer by "
                    f"arithmetic in its own forward, not by modules in a chain (then {e[1]}): not supported yet"
                )
            raise InputError(
                f"{where}: after its last layer {owner_name} runs {e[1]} on something other than the "
                "previous output: not supported"
            )
        suffix.append(e[1])
        h = e[3]
    if out is None or not _same(_first(out), h):
        raise InputError(
            f"{where}: {owner_name}'s output is not its last module's output (model-level arithmetic "
            "after the layers): not supported"
        )
    prefix = []
    for e in events[:a]:
        if e[0] == "mod" and e[1] not in prefix:
            prefix.append(e[1])
    return prefix, suffix


def _module(events: list[tuple], path: str) -> nn.Module:
    return next(e[4] for e in events if e[0] == "mod" and e[1] == path)


def _calls_with(owner, layers, returns: int, names, outputs) -> list:
    """The owner's meta forward with call k's recorder returning outputs[k] (arch.calls)."""
    log: list = []
    with torch.enable_grad(), recorders(layers, log, returns, None, outputs=outputs), _no_packing_check():
        owner(**_inputs(names))
    return log


def _same(out, h) -> bool:
    """out is h, or a view of it of the same shape (GPT-2 reshapes its output to the input's)."""
    if out is h:
        return True
    if not isinstance(out, torch.Tensor) or not isinstance(h, torch.Tensor) or out.shape != h.shape:
        return False
    return out._base is not None and out._base is (h._base if h._base is not None else h)


def _returned(layer_event):
    """What a recorder returned: its hidden input (arch.capture.recorders)."""
    return layer_event[2]


def _logits_mode(model: nn.Module, base: str, head: nn.Module, where: str) -> Logits:
    """'plain' when the CausalLM's logits are its head's output, 'forward' when its forward does
    more (scaling, soft-capping, slicing)."""
    H = _config(model).get_text_config().hidden_size
    h = torch.empty(1, T, H, device="meta")
    seen = []
    hook = head.register_forward_hook(lambda m, a, o: seen.append((a[0] if a else None, o)))
    try:
        with torch.no_grad(), head_stub(model, base, h):
            out = model(inputs_embeds=h)
    except Exception as e:
        raise InputError(
            f"{where}: {type(model).__name__}'s forward cannot run on given hidden states ({type(e).__name__}: {e})"
        ) from e
    finally:
        hook.remove()
    logits = getattr(out, "logits", None)
    if not seen or logits is None:
        raise InputError(f"{where}: {type(model).__name__}'s forward does not call its LM head")
    x, y = seen[-1]
    plain = logits is y and (x is h or (isinstance(x, torch.Tensor) and x._base is h and x.shape == h.shape))
    outside = [n for n, _ in model.named_parameters() if not n.startswith(base + ".")]
    head_params = {n for n, _ in head.named_parameters()}
    extra = [
        n for n in outside if n.split(".", 1)[-1] not in head_params or not n.startswith(_path(model, head))
    ]
    own = {n.rsplit(".", 1)[-1] for n in head_params} <= {"weight", "bias"}  # Dory's head scales its logits
    return "plain" if plain and not extra and own else "forward"


def _hidden_size(model: nn.Module) -> int:
    return _config(model).get_text_config().hidden_size


def _config(model: nn.Module) -> Any:
    return model.config  # a PreTrainedModel's config (nn.Module's attribute typing says Tensor | Module)


def _path(model: nn.Module, module: nn.Module) -> str:
    return (path_of(model, module) or "") + "."
