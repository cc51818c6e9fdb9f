"""Census: counts, and what each refused type needs, from the rows census.py wrote.

    python -m scripts.census summary docs/census.json

Each type that transformers trains gets a set of *needs*, read off its row (the observed forward,
the structure probe): the pieces a generic path must derive beyond what horizon's generic path
does today. A mechanism covers needs; a type is unlocked by a set of mechanisms when they cover
all of its needs. The ranking is greedy: each next mechanism is the one that unlocks the most
types together with those before it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

STANDARD_KWARGS = {
    "attention_mask", "position_embeddings", "position_ids", "cache", "use_cache", "cache_position",
    "output_router_logits", "output_attentions",
}  # fmt: skip
ENCODER_LIKE = ("encoder", "bert", "roberta", "electra", "ernie", "xlm", "xmod", "roformer", "rembert")

# need -> (mechanism, what it is)
MECHANISMS = {
    "stack": "find the decoder stack generically (the ModuleList of _no_split_modules / _can_record_outputs['hidden_states'] layers), wherever it sits",
    "prefix": "run the owner's own forward up to layer 0 (embeddings, scale, learned positions, embedding norms, rotary, masks) instead of describing it",
    "derive": "derive what today's table says (stack at model.layers, embedding module, final norm, shared or per-layer-type rotary, masks by layer type) for any class",
    "per_layer_kwargs": "pass each layer the extra arguments its owner passes (ALiBi, per-layer inputs, shared KV, attention scaling, Mamba masks), taken from the owner's own forward",
    "suffix": "run what the owner calls after the last layer (final norm(s)) and the CausalLM's logit code (scaling, soft-cap) per chunk",
    "recurrent": "hybrid / recurrent layers (Mamba, GatedDeltaNet, linear attention, short conv): state stays in the layer; packing refused",
    "composite": "multimodal / composite checkpoints: train the language model, carry the rest",
    "cross_layer": "tensors beyond the hidden state that cross layers (shared KV, per-layer inputs from the prefix, the embedding fed to every layer, weights shared by several layers): extra boundary activations and their gradients",
    "unchained": "model-level code between layers, or layers run more than once (loops, H/L modules)",
    "non_causal": "not a causal model at all (refuse, naming it)",
}


def needs(row: dict) -> set[str]:
    """What a type needs beyond today's generic path (empty: it should work as is)."""
    calls = row.get("calls") or {}
    st = row.get("structure") or {}
    h = row.get("horizon") or {}
    out: set[str] = {"derive"}
    if h.get("result") == "exact":
        return set()
    t = row.get("transformers") or {}
    if t.get("causal") is False:
        out.add("non_causal")
    stack = (row.get("depth") or {}).get("stack")
    if stack not in ("model.layers", "model.language_model.layers"):
        out.add("stack")
    rotary = {r["path"] for r in st.get("rotary") or []}
    before = [b for b in calls.get("before", []) if "drop" not in b.rsplit(".", 1)[-1] and b not in rotary]
    emb = (calls.get("embed") or {}).get("kind")
    if emb != "same" or len(before) > 1:  # "same": the one module before layer 0 is the token embedding
        out.add("prefix")
    extra = extra_args(calls)
    if extra:
        out.add("per_layer_kwargs")
    if cross_layer(calls, extra) or row["type"] in SHARED_BLOCKS:
        out.add("cross_layer")
    after = [a.rsplit(".", 1)[-1] for a in calls.get("after", [])]
    logits = (calls.get("logits") or {}).get("kind")
    if logits not in ("same", None) or len(after) != 2:
        out.add("suffix")
    if logits == "other" and h.get("path") == "generic":  # soft-capping: today's table knows it
        out.discard("suffix")
    if set(st.get("recurrent_modules") or {}) - {"Conv1D"}:  # GPT-2's Conv1D is a linear layer
        out.add("recurrent")
    if st.get("composite") or stack == "model.language_model.layers":
        out.add("composite")
    if calls.get("between") or calls.get("chained") is False or calls.get("calls") != calls.get("layers"):
        out.add("unchained")
    if not calls or "error" in calls:
        out.add("unchained")  # nothing observed: assume the worst
    return out


def kind(row: dict) -> str:
    """decoder | multimodal | seq2seq-decoder | encoder-as-decoder | non-causal | not-text | no-oracle."""
    t = row.get("transformers") or {}
    st = row.get("structure") or {}
    stack = (row.get("depth") or {}).get("stack") or ""
    if not t.get("trains"):
        return "no-oracle"
    if t.get("causal") is False:
        return "non-causal"
    if ".encoder.layer" in stack or stack.startswith(("reformer.", "cpmant.")):
        return "encoder-as-decoder"
    cross = any("encoder_hidden_states" in str(f) for f in (st.get("layer_forward") or {}).values())
    if stack.endswith("decoder.layers") and cross:  # BartDecoder, WhisperDecoder, ...: cross-attention layers
        return "seq2seq-decoder"
    if st.get("composite") or "language_model" in stack:
        return "multimodal"
    return "decoder"


def by_class(rows: dict) -> list[str]:
    """Types whose ForCausalLM is a class another model_type owns (accept by class)."""
    own = {}
    for k, r in rows.items():
        own.setdefault(r.get("model_class"), []).append(k)
    return sorted(k for cls, ks in own.items() if len(ks) > 1 for k in ks if cls)


# hybrid layers that reuse one attention block's weights (tied across layers: Zamba's shared_transf,
# modeling_zamba.py:853-861; Zamba2's shared_transformer blocks)
SHARED_BLOCKS = ("zamba", "zamba2")


def cross_layer(calls: dict, extra: list[str]) -> bool:
    """More than the hidden state crosses between layers or from the model level into every layer:
    shared KV (Gemma 3n / 4), per-layer inputs computed before layer 0 (Gemma 3n / 4), the
    embedding output given again to each layer (Zamba's original_hidden_states)."""
    kw = calls.get("kwargs") or {}
    for k in extra:
        t, n = _arg(kw[k])
        if k == "shared_kv_states" or (
            t.startswith("float") and (n > 1 or re.match(r"float\d+\[2, 24, \d+\]$", t))
        ):
            return True
    return False


def _arg(v) -> tuple[str, int]:
    """(type, distinct objects across layers) of a layer argument, in either row format."""
    if isinstance(v, dict):
        return v["type"], v.get("distinct", 1)
    t, _, n = v.partition(" x")
    return t, int(n) if n else 1


def extra_args(calls: dict) -> list[str]:
    """Layer arguments beyond what today's generic path passes (None and flags do not count)."""
    kw = calls.get("kwargs") or {}
    return sorted(
        k
        for k, v in kw.items()
        if k not in STANDARD_KWARGS and _arg(v)[0] not in ("NoneType", "bool", "DynamicCache")
    )


def counts(rows: dict) -> dict:
    trains = {k: r for k, r in rows.items() if (r.get("transformers") or {}).get("trains")}
    kinds = Counter(kind(r) for r in rows.values())
    per_kind = {
        k: dict(Counter((r.get("horizon") or {}).get("result") for r in rows.values() if kind(r) == k))
        for k in kinds
    }
    res = Counter((r.get("horizon") or {}).get("result", "none") for r in trains.values())
    refused = Counter(
        _reason((r.get("horizon") or {}).get("message", ""))
        for r in trains.values()
        if r["horizon"]["result"] == "refused"
    )
    return {
        "tried": len(rows),
        "transformers_trains": len(trains),
        "horizon": dict(res),
        "refused_by": dict(refused),
        "kinds": dict(kinds),
        "horizon_by_kind": per_kind,
        "shared_classes": by_class(rows),
    }


def _reason(msg: str) -> str:
    if "not described for the generic path" in msg:
        return "model-level pieces not described (generic path)"
    if "multimodal" in msg:
        return "multimodal wrapper"
    return msg.split(": ", 1)[-1][:80]


# the design-level mechanisms: capturing the owner's own forward gives prefix, per-layer arguments
# and suffix together (one mechanism), the others stand alone
GROUPS = {"prefix": "capture", "per_layer_kwargs": "capture", "suffix": "capture"}
GROUP_TEXT = {
    "capture": "run the owner's own forward around streamed layers and record what it does: what layer 0 "
    "receives (embedding, scale, learned positions, embedding norm), each layer's arguments (masks and "
    "rotary per layer type, ALiBi, per-layer inputs), what follows the last layer (final norms) and the "
    "CausalLM's logit code (scaling, soft-cap), applied per loss chunk",
}
TARGET = ("decoder", "multimodal")  # what issue 19's 95% counts: text decoders, LMs of multimodal models


def ranking(rows: dict, kinds=TARGET) -> list[tuple[str, int, int]]:
    """Greedy: (mechanism, types unlocked with it and those before, of the trainable refused)."""
    todo = {
        k: needs(r)
        for k, r in rows.items()
        if kind(r) in kinds and (r.get("horizon") or {}).get("result") != "exact"
    }
    todo = {k: {GROUPS.get(x, x) for x in n} for k, n in todo.items() if "non_causal" not in n}
    mechs = sorted({GROUPS.get(m, m) for m in MECHANISMS} - {"non_causal"})
    chosen: set[str] = set()
    out = []
    while True:
        best, gain = None, -1
        for m in mechs:
            if m in chosen:
                continue
            g = sum(1 for n in todo.values() if n <= chosen | {m}) - sum(
                1 for n in todo.values() if n <= chosen
            )
            if g > gain:
                best, gain = m, g
        if best is None:
            break
        chosen.add(best)
        out.append((best, gain, sum(1 for n in todo.values() if n <= chosen)))
    return out


def _short(path: str, stack: str | None) -> str:
    owner = (stack or "").rpartition(".")[0]
    return path[len(owner) + 1 :] if owner and path.startswith(owner + ".") else path


def features(row: dict) -> list[str]:
    """One line of the appendix table: where things are and what the forward does."""
    calls = row.get("calls") or {}
    st = row.get("structure") or {}
    stack = (row.get("depth") or {}).get("stack")
    emb = calls.get("embed") or {}
    lg = calls.get("logits") or {}
    kw = calls.get("kwargs") or {}
    per_type = sorted(k for k, v in kw.items() if _arg(v)[1] > 1)
    extra = extra_args(calls)
    rec = sorted(set(st.get("recurrent_modules") or {}) - {"Conv1D"})
    loop = "" if calls.get("chained", True) and calls.get("calls") == calls.get("layers") else "no"
    if calls.get("calls") and calls.get("calls") != calls.get("layers"):
        loop = f"{calls['calls']} calls / {calls['layers']}"
    return [
        f"`{stack}`" if stack else "?",
        ", ".join(_short(b, stack) for b in calls.get("before", [])),
        ", ".join(_short(a, stack) for a in calls.get("after", [])),
        emb.get("kind", "") + (f" ×{emb['factor']}" if "factor" in emb else ""),
        lg.get("kind", "") + (f" ×{lg['factor']}" if "factor" in lg else ""),
        ", ".join(per_type),
        ", ".join(extra),
        ", ".join(r for r in rec if r != "Conv1d") or ("Conv1d" if rec else ""),
        loop or ("yes" if calls else "?"),
    ]


def appendix(rows: dict) -> None:
    head = ["type", "kind", "stack", "before layer 0", "after the last", "layer-0 input", "logits", "per-layer",
            "other layer args", "recurrent", "chained", "horizon"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for k, r in sorted(rows.items()):
        if not (r.get("transformers") or {}).get("trains"):
            continue
        h = (r.get("horizon") or {}).get("result", "")
        print(f"| `{k}` | {kind(r)} | " + " | ".join(c.replace("|", "/") for c in features(r)) + f" | {h} |")


def main(path: str) -> None:
    rows = json.loads(Path(path).read_text())
    print("## counts\n")
    print(json.dumps(counts(rows), indent=1))
    print("\n## needs of each trainable type horizon does not train exactly\n")
    for k, r in sorted(rows.items()):
        t = r.get("transformers") or {}
        if t.get("trains") and (r.get("horizon") or {}).get("result") != "exact":
            print(f"- {k}: {', '.join(sorted(needs(r))) or '(none)'}")
    print("\n## how often each need occurs\n")
    c = Counter(n for r in rows.values() if (r.get("transformers") or {}).get("trains") for n in needs(r))
    for n, k in c.most_common():
        print(f"- {n}: {k}")
    target = [k for k, r in rows.items() if kind(r) in TARGET]
    exact = [k for k in target if rows[k]["horizon"].get("result") == "exact"]
    print(f"\n## target (kinds {', '.join(TARGET)}): {len(target)} types, {len(exact)} exact today\n")
    print("## greedy ranking over the target: mechanism, types it adds, cumulative (+ the exact ones)\n")
    for m, g, cum in ranking(rows):
        print(
            f"- {m}: +{g} (cumulative {cum + len(exact)} of {len(target)}) — {GROUP_TEXT.get(m) or MECHANISMS[m]}"
        )
    print("\n## greedy ranking over every causal type transformers trains (encoders, seq2seq decoders too)\n")
    for m, g, cum in ranking(rows, ("decoder", "multimodal", "seq2seq-decoder", "encoder-as-decoder")):
        print(f"- {m}: +{g} (cumulative {cum})")
    print("\n## per type (transformers trains)\n")
    appendix(rows)
