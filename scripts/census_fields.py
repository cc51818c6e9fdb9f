"""Probe every exact type of the census with one config field changed at a time (issue 43).

    PYTHONPATH=. python scripts/census_fields.py [TYPE,TYPE...]

Fields that change how transformers runs a forward, not what the model is (a padding id, the
cache, the outputs it returns, the dtype, the attention class) must leave arch.generic's
description as it is, or be refused in one line; a traceback is a bug. Prints one line per type:
`ok`, or each field's outcome. The fast subset is tests/arch/test_probe_config_fields.py.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

FIELDS = {
    "pad_token_id": 0,
    "pad_token_id=last": "LAST",  # the vocabulary's last id
    "pad_token_id=-1": -1,
    "use_cache=false": False,
    "use_cache": True,
    "output_hidden_states": True,
    "output_attentions": True,
    "return_dict": False,
    "torchscript": True,
    "output_router_logits": True,
    "attn_implementation": "eager",
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}


def _changed(base: dict, key: str, value) -> dict:
    d = json.loads(json.dumps(base))
    name = key.split("=")[0]
    tc = d.get("text_config") if isinstance(d.get("text_config"), dict) else None
    if value == "LAST":
        value = (tc or d).get("vocab_size", 2) - 1
    for c in (d, tc) if tc is not None else (d,):
        c[name] = value
    return d


def main(types: list[str] | None) -> None:
    import transformers

    from horizon_cli.arch.generic import generic_spec
    from horizon_cli.errors import InputError
    from tests.support.census_config import tiny_config

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    record = json.loads((Path(__file__).parent.parent / "docs" / "census.json").read_text())
    exact = [t for t, v in record.items() if (v.get("horizon") or {}).get("result") == "exact"]
    for mt in types or exact:
        base = tiny_config(mt, (record.get(mt, {}).get("depth") or {}).get("layers") or 2).to_dict()
        seen = {}
        for key, value in FIELDS.items():
            try:
                generic_spec(_changed(base, key, value), mt)
            except InputError as e:
                seen[key] = f"refused: {str(e)[:120]}"
            except Exception as e:  # noqa: BLE001 (what the sweep looks for)
                seen[key] = f"TRACEBACK {type(e).__name__}: {str(e)[:120]}"
        print(mt, json.dumps(seen) if seen else "ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else None)
