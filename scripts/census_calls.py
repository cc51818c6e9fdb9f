"""Census: what the model-level forward does around the decoder layers, observed in one forward.

Forward hooks on every module outside the decoder stack that the text model (the stack's owner)
or the CausalLM holds, and on every layer, record the order of calls; a layer's pre-hook records
the keyword arguments it receives. From that:

  before    modules called before layer 0 (embeddings, rotary, position embeddings, norms)
  embed     how layer 0's input relates to the token embedding: "same", "scaled" (by a constant,
            given), or "other" (positions added, a norm, ...)
  chained   each layer's input is the previous layer's output, untouched (the loop body only
            calls the layer): then the model-level code is prefix + layers + suffix
  calls     layer calls per forward against the number of layers (loops re-run layers)
  kwargs    what the layers receive, and which of those differ between layers (per-type masks,
            per-type rotary tables) — by object identity
  after     modules called after the last layer (final norm, ...), then the head
  logits    how the model's logits relate to the head module's output: "same", "scaled", "other"
"""

from __future__ import annotations

import torch
from torch import nn


def _first(x):
    if isinstance(x, (tuple, list)):
        return x[0] if x else None
    return getattr(x, "last_hidden_state", x)


def _desc(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype}".replace("torch.", "") + str(list(v.shape))
    if isinstance(v, (tuple, list)) and v and isinstance(v[0], torch.Tensor):
        return f"{type(v).__name__}[{len(v)}]"
    if isinstance(v, dict):
        return f"dict{sorted(map(str, v))}"
    return type(v).__name__


def _relation(a: torch.Tensor, b: torch.Tensor) -> dict:
    """same / scaled (a = c * b) / other, for two tensors of one shape."""
    if a.shape != b.shape:
        return {"kind": "other", "why": f"shapes {list(a.shape)} vs {list(b.shape)}"}
    a, b = a.double(), b.double()
    if torch.allclose(a, b, rtol=1e-6, atol=1e-9):
        return {"kind": "same"}
    c = float((a * b).sum() / (b * b).sum().clamp_min(1e-30))
    if torch.allclose(a, c * b, rtol=1e-5, atol=1e-7):
        return {"kind": "scaled", "factor": round(c, 6)}
    return {"kind": "other"}


def watched(model: nn.Module, stack_path: str) -> dict[str, nn.Module]:
    """Modules outside the stack held by the owner and by the modules above it (CausalLM, a
    multimodal wrapper), one level down each."""
    out = {}
    parts = stack_path.split(".")
    for depth in range(len(parts)):
        holder = model.get_submodule(".".join(parts[:depth])) if depth else model
        for name, m in holder.named_children():
            path = ".".join([*parts[:depth], name])
            if path != stack_path and not stack_path.startswith(path + "."):
                out[path] = m
    return out


def call_order(model: nn.Module, stack_path: str, ids: torch.Tensor) -> dict:
    stack = model.get_submodule(stack_path)
    events, layer_in, layer_out, kwargs_seen = [], [], [], []
    outputs: dict[str, torch.Tensor] = {}
    handles = []

    def on_module(path):
        def hook(mod, args, out):
            events.append(path)
            t = _first(out)
            if isinstance(t, torch.Tensor):
                outputs.setdefault(path, t.detach())

        return hook

    def on_layer_pre(i):
        def hook(mod, args, kwargs):
            h = args[0] if args else kwargs.get("hidden_states")
            layer_in.append((i, h))
            kwargs_seen.append((i, {**{f"arg{j}": a for j, a in enumerate(args[1:], 1)}, **kwargs}))

        return hook

    def on_layer(i):
        def hook(mod, args, out):
            events.append(f"layer{i}")
            layer_out.append((i, _first(out)))

        return hook

    for path, m in watched(model, stack_path).items():
        handles.append(m.register_forward_hook(on_module(path)))
    for i, layer in enumerate(stack):
        handles.append(layer.register_forward_pre_hook(on_layer_pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(on_layer(i)))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        for h in handles:
            h.remove()
    return summarize(model, events, layer_in, layer_out, kwargs_seen, outputs, logits, len(stack), ids)


def summarize(model, events, layer_in, layer_out, kwargs_seen, outputs, logits, n, ids) -> dict:
    idx = [k for k, e in enumerate(events) if e.startswith("layer")]
    if not idx:
        return {"error": "no layer was called"}
    first, last = idx[0], idx[-1]
    between = sorted({e for e in events[first:last] if not e.startswith("layer")})
    res = {
        "before": _dedup(events[:first]),
        "after": _dedup(events[last + 1 :]),
        "between": between,
        "calls": len(idx),
        "layers": n,
    }
    chained = all(
        i_in is not None and o is not None and (i_in is o or (i_in.shape == o.shape and torch.equal(i_in, o)))
        for (_, i_in), (_, o) in zip(layer_in[1:], layer_out[:-1], strict=False)
    )
    res["chained"] = chained
    emb = model.get_input_embeddings()
    h0 = layer_in[0][1]
    if isinstance(emb, nn.Embedding) and isinstance(h0, torch.Tensor):
        with torch.no_grad():
            res["embed"] = _relation(h0, emb(ids))
    res["kwargs"] = _kwargs(kwargs_seen)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    hp = next((p for p, m in model.named_modules() if m is head), None) if head is not None else None
    if hp in outputs:
        res["logits"] = _relation(logits, outputs[hp])
    return res


def _dedup(seq: list[str]) -> list[str]:
    out = []
    for e in seq:
        if not out or out[-1] != e:
            out.append(e)
    return out


def _kwargs(seen) -> dict:
    """Per kwarg: its description, and how many distinct objects the layers got (1: shared)."""
    out = {}
    names = sorted({k for _, kw in seen for k in kw})
    for k in names:
        vals = [kw.get(k) for _, kw in seen]
        ids = {id(v) for v in vals}
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        distinct = len(ids)
        if tensors and len(tensors) == len(vals):  # equal values count once
            uniq = []
            for t in tensors:
                if not any(t.shape == u.shape and torch.equal(t, u) for u in uniq):
                    uniq.append(t)
            distinct = len(uniq)
        out[k] = {"type": _desc(vals[0]), "distinct": distinct}
    return out
