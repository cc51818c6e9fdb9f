"""Census: which generic rule finds the decoder stack the census found (meta device, no weights).

    python -m scripts.census stacks docs/census.json

Rules, each checked against the census's stack (the ModuleList of num_hidden_layers layers):
  gc        the only ModuleList whose elements are all transformers.modeling_layers.
            GradientCheckpointingLayer (every decoder layer of the v5 library subclasses it)
  decoder   model.get_decoder() is a PreTrainedModel and holds that list as a direct child
  no_split  the only ModuleList whose elements' classes are all in model._no_split_modules
  record    the only ModuleList of _can_record_outputs["hidden_states"] instances
"""

from __future__ import annotations

import json
import sys
import warnings
from collections import Counter
from pathlib import Path

from torch import nn


def lists_of(model: nn.Module, pred) -> list[str]:
    return [
        p
        for p, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) and all(pred(x) for x in m)
    ]


def rules(model: nn.Module) -> dict[str, list[str]]:
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    out = {"gc": lists_of(model, lambda x: isinstance(x, GradientCheckpointingLayer))}
    try:
        dec = model.get_decoder()
    except Exception:  # noqa: BLE001
        dec = None
    if isinstance(dec, PreTrainedModel) and dec is not model:
        base = next(p for p, m in model.named_modules() if m is dec)
        out["decoder"] = [
            f"{base}.{n}".lstrip(".")
            for n, m in dec.named_children()
            if isinstance(m, nn.ModuleList)
            and len(m)
            and all(isinstance(x, GradientCheckpointingLayer) for x in m)
        ]
    else:
        out["decoder"] = []
    ns = set(getattr(model, "_no_split_modules", None) or [])
    out["no_split"] = lists_of(model, lambda x: type(x).__name__ in ns)
    rec = getattr(type(model.base_model), "_can_record_outputs", None) or {}
    hs = rec.get("hidden_states")
    hs = getattr(hs, "target_class", hs)
    out["record"] = lists_of(model, lambda x: isinstance(hs, type) and isinstance(x, hs))
    return out


def main(path: str) -> None:
    warnings.filterwarnings("ignore")
    import transformers

    from tests.support.census_config import build, tiny_config

    transformers.logging.set_verbosity_error()
    rows = json.loads(Path(path).read_text())
    hits: Counter = Counter()
    misses: dict[str, list[str]] = {}
    for mt, r in sorted(rows.items()):
        stack = (r.get("depth") or {}).get("stack")
        try:
            found = rules(build(mt, tiny_config(mt, (r.get("depth") or {}).get("layers", 2)), "meta"))
        except Exception as e:  # noqa: BLE001
            print(f"- {mt}: not built ({type(e).__name__})")
            continue
        for rule, got in found.items():
            ok = stack is not None and got == [stack]
            hits[rule] += ok
            if not ok:
                misses.setdefault(rule, []).append(f"{mt} ({', '.join(got) or 'none'})")
    print(
        f"types with a census stack: {sum(1 for r in rows.values() if (r.get('depth') or {}).get('stack'))}"
    )
    for rule, n in hits.most_common():
        print(f"- {rule}: finds exactly the census stack in {n}; misses: {'; '.join(misses.get(rule, []))}")


if __name__ == "__main__":
    main(sys.argv[1])
