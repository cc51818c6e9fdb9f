"""A real checkpoint nobody here made: SmolLM2-135M-Instruct (built by `make smollm2`).

Opt-in: `pytest -m smollm2 tests/convert/test_smollm2.py`. convert -> export must give bitwise the
checkpoint's tensors and the same logits, in the checkpoint's dtype (bf16) and in fp32, and the
exported checkpoint still answers "What is the capital of France?" with Paris.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.smollm2

REPO = Path(__file__).resolve().parents[2]
HF = Path(os.environ.get("HORIZON_SMOLLM2_DIR") or REPO / ".cache" / "smollm2" / "hf")


@pytest.fixture(scope="module")
def source() -> Path:
    if not (HF / "horizon-smollm2.json").is_file() or not (HF / "model.safetensors").is_file():
        pytest.skip(f"SmolLM2 checkpoint not built at {HF}: run `make smollm2` (or set HORIZON_SMOLLM2_DIR)")
    return HF


@pytest.fixture(scope="module")
def prompt(source):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    return tok, tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )


def round_trip(source: Path, tmp: Path, dtype: str) -> Path:
    from horizon_cli.convert import convert
    from horizon_cli.export import export

    info = convert(source, tmp / "store", dtype=dtype)
    assert info["params"] == 134_515_008  # SmolLM2-135M, tied embeddings
    export(tmp / "store", tmp / "dst")
    return tmp / "dst"


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def logits(path: Path, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_round_trip(source, prompt, tmp_path, dtype):
    dst = round_trip(source, tmp_path, dtype)
    want, got = tensors(source), tensors(dst)
    assert set(got) == set(want) - {"lm_head.weight"}  # tied: the head is the embedding
    for k, v in got.items():
        assert v.dtype == getattr(torch, dtype) and torch.equal(v, want[k].to(v.dtype)), k
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["num_hidden_layers"] == 30
    ids = prompt[1]["input_ids"]
    td = getattr(torch, dtype)
    assert torch.equal(logits(dst, td, ids), logits(source, td, ids))


def test_exported_checkpoint_answers_paris(source, prompt, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dst = round_trip(source, tmp_path, "bfloat16")
    assert (dst / "tokenizer.json").is_file() and (dst / "chat_template.jinja").is_file()
    tok = AutoTokenizer.from_pretrained(dst)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    assert torch.equal(enc["input_ids"], prompt[1]["input_ids"])  # same tokenizer and template
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
