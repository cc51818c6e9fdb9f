"""Prompts (GRPO's, generation's) whose tokenizer gives ids past the model's vocabulary: one line
naming the record, before any weight loads (they indexed past the embedding table: IndexError)."""

from __future__ import annotations

import json

import pytest

from horizon_cli.config.schema import DataConfig
from horizon_cli.data.prompt_only import prepare_prompts
from horizon_cli.errors import InputError
from tests.support.tokenizer import make_tokenizer


@pytest.mark.parametrize(
    "rec",
    [{"prompt": "what is one plus one?"}, {"prompt": [{"role": "user", "content": "what is one plus one?"}]}],
)
def test_tokenized_prompt_ids_past_the_vocabulary_are_one_line(tmp_path, rec):
    tok = make_tokenizer()
    ids = tok(tok.apply_chat_template(rec["prompt"], tokenize=False, add_generation_prompt=True)
              if isinstance(rec["prompt"], list) else rec["prompt"], add_special_tokens=False)["input_ids"]  # fmt: skip
    (tmp_path / "p.jsonl").write_text(json.dumps(rec) + "\n")
    cfg = DataConfig(path=str(tmp_path / "p.jsonl"))
    small = max(ids)  # the largest id is one past this vocabulary
    with pytest.raises(
        InputError, match=r"record 1: the tokenizer gives id \d+, outside the model's vocabulary"
    ):
        prepare_prompts(cfg, tok, small, 128, 8, 0)
    train, _ = prepare_prompts(
        cfg, tok, max(ids) + 1, 128, 8, 0
    )  # the same prompt, a vocabulary that holds it
    assert len(train.rows) == 1 and max(train.rows[0].ids) == max(ids)
