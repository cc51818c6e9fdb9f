"""A multimodal checkpoint (LLaVA: a vision tower and projector around a Llama): convert takes its
language model, carries the rest aside untouched, training changes only the language model, and
export writes the whole checkpoint back, loadable by its own transformers class."""

from pathlib import Path

import torch
import transformers

from horizon_cli.convert import convert
from horizon_cli.export import export
from tests.cli.test_cli_store_errors import horizon
from tests.conftest import chat_rows, write_config, write_jsonl
from tests.support.census_config import tiny_config
from tests.support.oracle import one_thread  # noqa: F401 (autouse fixture: tiny models on one thread)
from tests.support.tokenizer import make_tokenizer


def tiny_llava(root: Path) -> Path:
    cfg = tiny_config("llava", 2)
    cfg.text_config.vocab_size = 400  # the tiny tokenizer's
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    model.save_pretrained(root)
    make_tokenizer(root)
    return root


def test_llava_language_model_trained_tower_carried(tmp_path):
    src = tiny_llava(tmp_path / "hf")
    convert(src, tmp_path / "store", dtype="float32")
    r = horizon("inspect", tmp_path / "store")
    assert r.exit_code == 0 and "carried untouched" in r.output, r.output
    export(tmp_path / "store", tmp_path / "same")
    orig = transformers.LlavaForConditionalGeneration.from_pretrained(src).state_dict()
    back = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "same").state_dict()
    assert orig.keys() == back.keys()
    assert all(torch.equal(orig[k], back[k]) for k in orig)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    cfg = write_config(tmp_path / "cfg.yaml", tmp_path / "store", data, tmp_path / "run", train={"steps": 2})
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    export(tmp_path / "run", tmp_path / "trained")
    after = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "trained").state_dict()
    tower = [k for k in orig if not k.startswith(("model.language_model.", "lm_head."))]
    assert tower and all(torch.equal(orig[k], after[k]) for k in tower)
    lm = [k for k in orig if k.startswith("model.language_model.layers.")]
    assert any(not torch.equal(orig[k], after[k]) for k in lm)
