"""Census: what a tiny model looks like structurally, read off the model and transformers' source.

The facts issue 19's generic path needs: where the decoder stack, its owner (the text model),
the embeddings, the final norm, the head and the rotary module are; the forward signatures of the
layers and the rotary module; the mask functions and the arithmetic of the model-level forwards
(file:line); config multipliers; recurrent / linear-attention modules inside the layers; the
checkpoint's key prefix on disk against the in-memory names; the other towers of a multimodal model.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path

from torch import nn

SCALARS = re.compile(
    r"multiplier|scale|scaling|softcap|normalizer|logit|residual|parallel|alibi|rope_type|position"
)
RECURRENT = re.compile(
    r"Mamba|Mixer|DeltaNet|DeltaAttention|LinearAttention|Lightning|ShortConv|Conv|Recurrent|Rglru|RgLru|SSM|Lstm|LSTM|Rwkv|Retention|Kda"
)
MASK_CALL = re.compile(
    r"\b(create_\w*mask\w*|_prepare_4d\w*|_update_\w*mask|make_flex\w*|\w+_mask_function|_ignore_causal_mask_sdpa)\("
)


def sig(fn) -> list[str]:
    try:
        ps = inspect.signature(inspect.unwrap(fn)).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name if p.default is inspect.Parameter.empty else f"{p.name}={_short(p.default)}" for p in ps][
        1:
    ]


def _short(v) -> str:
    s = repr(v)
    return s if len(s) < 24 else s[:21] + "..."


def where(obj) -> str:
    """file:line of a class or function, relative to transformers/models."""
    obj = inspect.unwrap(obj)
    try:
        f = inspect.getsourcefile(obj)
        line = inspect.getsourcelines(obj)[1]
    except (TypeError, OSError):
        return "?"
    f = str(f)
    return f"{f.split('transformers/')[-1]}:{line}"


def forward_facts(cls) -> dict:
    """Mask calls and the lines doing arithmetic in a forward (file:line each)."""
    fn = inspect.unwrap(getattr(cls, "forward", None))
    try:
        lines, start = inspect.getsourcelines(fn)
    except (TypeError, OSError):
        return {}
    masks, arith, doc = [], [], False
    for i, ln in enumerate(lines):
        code = ln.split("#")[0].strip()
        quotes = code.count('"""') + code.count("'''")
        if doc or quotes:
            doc = doc != (quotes % 2 == 1)
            continue
        if not code or code.startswith(">>>"):
            continue
        masks += [f"{m}@{start + i}" for m in MASK_CALL.findall(code)]
        stripped = re.sub(r"\*\*?kwargs|\*args|\*\*\w+|\[[^\]]*\]", "", code)
        if re.search(r"[^*]\*[^*]|/|softcap|tanh|scal|multiplier", stripped) and not stripped.startswith(
            ("def ", "@")
        ):
            arith.append(f"{start + i}: {code[:110]}")
    return {
        "at": where(fn),
        "masks": masks,
        "arith": arith[:12],
        "lines": len(lines),
        "loop": loop_body(lines, start),
    }


def loop_body(lines: list[str], start: int) -> list[str]:
    """The lines of the forward's loop over the decoder layers (file line numbers)."""
    for i, ln in enumerate(lines):
        if re.match(r"\s*for .* in .*(layers|self\.h\b|self\.layer\b|blocks)", ln):
            indent = len(ln) - len(ln.lstrip())
            body = [f"{start + i}: {ln.strip()}"]
            for j in range(i + 1, len(lines)):
                lj = lines[j]
                if lj.strip() and len(lj) - len(lj.lstrip()) <= indent:
                    break
                if lj.strip() and not lj.strip().startswith("#"):
                    body.append(f"{start + j}: {lj.strip()[:100]}")
            return body[:14]
    return []


def module_path(model: nn.Module, target: nn.Module) -> str | None:
    return next((p for p, m in model.named_modules() if m is target), None)


def structure(model: nn.Module, cfg, stack_path: str | None, hf_dir: Path | None) -> dict:
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    out: dict = {"text_config": type(text).__name__, "composite": text is not cfg}
    mod = sys.modules[type(model).__module__]
    out["source"] = where(type(model)).rsplit(":", 1)[0]
    imports = sorted(set(re.findall(r"\b(create_\w*mask\w*)\b", Path(mod.__file__).read_text())))
    out["mask_functions_in_file"] = imports
    out["top_children"] = [
        [n, type(m).__name__, sum(p.numel() for p in m.parameters())] for n, m in model.named_children()
    ]
    for attr in (
        "_no_split_modules",
        "_keep_in_fp32_modules",
        "_tied_weights_keys",
        "_keys_to_ignore_on_load_unexpected",
    ):
        v = getattr(model, attr, None)
        if v:
            out[attr] = (
                sorted(map(str, v)) if not isinstance(v, dict) else {str(k): str(x) for k, x in v.items()}
            )
    rec = getattr(type(model.base_model), "_can_record_outputs", None) or getattr(
        type(model), "_can_record_outputs", None
    )
    if rec:
        out["_can_record_outputs"] = {k: _rec_name(v) for k, v in rec.items()}
    if stack_path:
        out.update(stack_facts(model, stack_path))
    out["head"] = head_facts(model)
    out["rotary"] = [
        {
            "path": p,
            "class": type(m).__name__,
            "forward": sig(type(m).forward),
            "in_layers": ".layers." in f".{p}.",
        }
        for p, m in model.named_modules()
        if "Rotary" in type(m).__name__ or "RoPE" in type(m).__name__
    ][:6]
    out["config_scalars"] = {
        k: v for k, v in vars(text).items()
        if not k.startswith("_") and SCALARS.search(k) and isinstance(v, (int, float, str, bool)) and v is not None
    }  # fmt: skip
    out["causal_lm_forward"] = forward_facts(type(model))
    if hf_dir is not None:
        out["checkpoint"] = checkpoint_facts(model, hf_dir, stack_path)
    return out


def _rec_name(v) -> str:
    cls = getattr(v, "target_class", v)
    return getattr(cls, "__name__", str(cls))


def stack_facts(model: nn.Module, stack_path: str) -> dict:
    owner_path, _, attr = stack_path.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    stack = owner.get_submodule(attr)
    layer_classes = sorted({type(layer).__name__ for layer in stack})
    out = {
        "stack": stack_path,
        "owner": [owner_path, type(owner).__name__],
        "owner_children": [[n, type(m).__name__] for n, m in owner.named_children()],
        "layer_classes": layer_classes,
        "layer_forward": {type(layer).__name__: sig(type(layer).forward) for layer in stack},
        "layer_at": {type(layer).__name__: where(type(layer)) for layer in stack},
        "owner_forward": forward_facts(type(owner)),
    }
    names = [n for n, _ in owner.named_children()]
    after = names[names.index(attr) + 1 :] if attr in names else []
    out["final_norm"] = [
        [f"{owner_path}.{n}".lstrip("."), type(owner.get_submodule(n)).__name__]
        for n in after
        if "norm" in n.lower() or "Norm" in type(owner.get_submodule(n)).__name__
    ]
    embeds = []
    for p, m in model.named_modules():
        if p.startswith(stack_path + "."):
            continue
        if isinstance(m, nn.Embedding) or ("Embed" in type(m).__name__ and not list(m.children())):
            w = getattr(m, "weight", None)
            e = {"path": p, "class": type(m).__name__, "shape": list(w.shape) if w is not None else None}
            scale = getattr(m, "embed_scale", None)
            if scale is not None:
                e["embed_scale"] = (
                    float(scale) if not hasattr(scale, "numel") or scale.numel() == 1 else "tensor"
                )
            embeds.append(e)
    out["embeddings"] = embeds[:8]
    inner = {}
    for layer in stack:
        for _, m in layer.named_modules():
            n = type(m).__name__
            if RECURRENT.search(n):
                inner[n] = sig(type(m).forward)
    out["recurrent_modules"] = inner
    return out


def head_facts(model: nn.Module) -> dict:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return {"path": None}
    emb = model.get_input_embeddings()
    w = getattr(head, "weight", None)
    return {
        "path": module_path(model, head),
        "class": type(head).__name__,
        "bias": getattr(head, "bias", None) is not None,
        "tied": w is not None and emb is not None and w is getattr(emb, "weight", None),
    }


def checkpoint_facts(model: nn.Module, hf_dir: Path, stack_path: str | None) -> dict:
    idx = hf_dir / "model.safetensors.index.json"
    if idx.is_file():
        disk = set(json.loads(idx.read_text())["weight_map"])
    else:
        from safetensors import safe_open

        with safe_open(hf_dir / "model.safetensors", "pt") as f:
            disk = set(f.keys())
    mem = set(model.state_dict())
    out = {
        "keys": len(disk),
        "only_on_disk": sorted(disk - mem)[:6],
        "only_in_memory": sorted(mem - disk)[:6],
    }
    found = {m.group(0)[:-3] for k in disk if (m := re.match(r"^(.*?\.)?(layers|h|blocks|layer)\.0\.", k))}
    avoid = ("vision", "visual", "audio", "encoder.", "vq", "patch", "image", "mtp")
    text = sorted(p for p in found if not any(a in p for a in avoid)) or sorted(found)
    out["layer_prefix_on_disk"] = text[0] if text else None
    if len(found) > 1:
        out["layer_prefixes_on_disk"] = sorted(found)
    if stack_path:
        out["layer_prefix_in_memory"] = stack_path
    return out
