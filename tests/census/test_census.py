"""The census as a test: every model type of transformers' causal-LM mapping, tiny and random,
through horizon's public entry points against transformers + torch.optim.AdamW (fp32, 3 steps).

tests/support/census_horizon.run_type: save_pretrained -> convert -> `horizon train` (3 AdamW steps, eps
1e-6, 2 micro-batches) -> export -> from_pretrained; the three losses, gradient norms, every step-1
gradient and the exported model's logits within 1e-5 of the resident oracle (run in the same
micro-batches and at once, both), every weight after step 3 within 1e-5 of the micro-batched one
(tests/support/census_horizon.py's docstring: the criterion and why). What each type gave last is recorded in docs/census.json (`scripts/census.py horizon`),
which docs/architectures.md's table is generated from (`scripts/census.py table`):

  exact     must stay exact
  refused   must stay refused, at convert, with the same line (naming the feature)
  mismatch / failed   known gaps (docs/architectures.md): expected to fail, run to see they still do

A type the record does not know (a new transformers release) must train exactly or be refused with
a line that names what it lacks. The fast subset (one model per kind of layer) runs in `make test`
(jamba in the slow tier); the whole mapping is opt-in, `pytest -m census tests/census/test_census.py`
(~40 min here), run when transformers changes: a release's new types are recorded first.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.census_horizon import run_type
from tests.support.oracle import one_thread  # noqa: F401 (autouse fixture: tiny models on one thread)

RECORD = json.loads((Path(__file__).resolve().parents[2] / "docs" / "census.json").read_text())

# one per kind of layer, with the depth that holds every layer kind of the full model
FAST = {
    "exaone": 2,  # dense, a LlamaForCausalLM under another name and other checkpoint names: native
    "qwen3_moe": 2,  # routed experts fused in memory, per-expert on disk
    "deepseek_v3": 2,  # multi-head latent attention, dense then MoE layers, a frozen buffer
    "gemma3": 6,  # multimodal: the language model trained, the tower carried; sliding / full layers
    "granite": 2,  # the owner's and the CausalLM's own code: embedding, residual and logit multipliers
    "gpt2": 2,  # the stack at transformer.h, learned positions, Conv1D layers
    "jamba": 5,  # hybrid: Mamba mixers (a recurrent scan, its working set measured) beside attention, MoE
}


def _types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _line(message: str) -> str:
    """A refusal without the path of the temporary checkpoint."""
    return re.sub(r"\S*/hf/", "", message.split("; supported:")[0]).strip()


def _params():
    out = []
    for mt in _types():
        row = RECORD.get(mt, {})
        if row and not (row.get("transformers") or {}).get("trains", True):
            continue  # transformers cannot train it: no oracle
        want = (row.get("horizon") or {}).get("result")
        marks = [] if mt in FAST else [pytest.mark.slow, pytest.mark.census]  # the rest: opt-in
        if want in ("mismatch", "failed"):
            why = (row["horizon"].get("worst") or row["horizon"].get("message") or "")[:120]
            marks.append(pytest.mark.xfail(reason=f"known gap: {why}", strict=False))
        out.append(pytest.param(mt, marks=marks, id=mt))
    return out


@pytest.mark.parametrize("mt", _params())
def test_census(mt, tmp_path):
    row = RECORD.get(mt, {})
    layers = FAST.get(mt) or (row.get("depth") or {}).get("layers")
    if not layers:
        from tests.support.census_config import choose_depth

        layers = choose_depth(mt)["layers"]
    got = run_type(mt, layers, tmp_path)
    want = row.get("horizon") or {}
    if want.get("result") == "refused":
        assert got["result"] == "refused" and got.get("stage") == "convert", got
        assert _line(got["message"]) == _line(want["message"]), got["message"]
        return
    if got["result"] == "refused" and not want:
        assert "not described" not in got["message"], got["message"]
        pytest.fail(f"a new type refused: {got['message']} (record it with scripts/census.py horizon)")
    assert got["result"] == "exact", got.get("worst") or got.get("message")
    if want.get("path"):
        assert got["path"] == want["path"]
