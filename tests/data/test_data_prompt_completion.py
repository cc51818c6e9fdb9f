"""TRL's prompt/completion SFT format: tokens and labels equal TRL's SFTTrainer (completion only
loss, its default for this format), for plain strings and for message lists."""

from __future__ import annotations

import json

import pytest

from horizon_cli.config.schema import DataConfig
from horizon_cli.data import IGNORE, prepare_data
from horizon_cli.errors import InputError
from tests.data.test_data_fidelity import NO_SYSTEM_TEMPLATE
from tests.support.tokenizer import make_tokenizer

PLAIN = [
    {"prompt": "The quick brown fox", "completion": " jumps over the lazy dog."},
    {"prompt": "Hello world! How are", "completion": " you today?"},  # merges across the boundary?
    {"prompt": "Paris is the capital of", "completion": " France.</s>"},  # EOS already there
]
CONV = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}],
        "completion": [{"role": "assistant", "content": "Hello world!"}],
    },
    {
        "prompt": [{"role": "user", "content": "one two"}],
        "completion": [
            {"role": "assistant", "content": "three"},
            {"role": "user", "content": "four"},
            {"role": "assistant", "content": "five six"},
        ],
    },
]


def prep(tmp_path, records, tokenizer, logs=None, **cfg):
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    log = logs.append if logs is not None else (lambda _: None)
    data = DataConfig(path=str(path), **{"max_seq_len": 256, "shuffle": False, **cfg})
    return prepare_data(data, tokenizer, log=log)


def trl_rows(records, tokenizer) -> list[tuple[list[int], list[int]]]:
    """TRL's own preparation of the dataset (SFTTrainer._prepare_dataset, no model needed)."""
    trl = pytest.importorskip("trl")
    import datasets

    class Trainer:  # what _prepare_dataset reads of the trainer
        _tokenizer, completion_only_loss, chat_template = tokenizer, True, None

    args = trl.SFTConfig(output_dir="unused", max_length=None, report_to=[], use_cpu=True, bf16=False)
    datasets.disable_progress_bars()
    try:
        ds = datasets.Dataset.from_list(records)
        out = trl.SFTTrainer._prepare_dataset(Trainer(), ds, tokenizer, args, False, None, "train")
    finally:
        datasets.enable_progress_bars()
    return [(r["input_ids"], r["labels"]) for r in out]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' TrainingArguments, built by TRL
@pytest.mark.parametrize("records", [PLAIN, CONV], ids=["strings", "messages"])
def test_tokens_and_labels_equal_trl(tmp_path, tok, records):
    logs: list[str] = []
    out = prep(tmp_path, records, tok, logs)
    assert out.format == "prompt_completion"
    assert any("format prompt_completion (auto-detected" in line for line in logs)
    ours = [(out.train[i].input_ids.tolist(), out.train[i].labels.tolist()) for i in range(len(out.train))]
    assert ours == trl_rows(records, tok)
    for ids, labels in ours:  # the loss starts after the prompt and runs to the end
        first = next(i for i, v in enumerate(labels) if v != IGNORE)
        assert labels[first:] == ids[first:] and first > 0


def test_train_on_prompt_trains_on_everything(tmp_path, tok):
    out = prep(tmp_path, PLAIN + CONV, tok, train_on_prompt=True)
    assert all(out.train[i].labels.tolist() == out.train[i].input_ids.tolist() for i in range(len(out.train)))


def test_plain_completion_gets_one_eos_and_blank_ones_are_dropped(tmp_path, tok):
    logs: list[str] = []
    out = prep(tmp_path, [PLAIN[2], {"prompt": "x", "completion": "  "}], tok, logs)
    assert len(out.train) == 1 and out.train.stats["empty"] == 1
    assert out.train[0].input_ids.tolist().count(tok.eos_token_id) == 1


def test_shapes_that_do_not_match_are_refused(tmp_path, tok, tok_plain):
    mixed = {"prompt": "hi", "completion": [{"role": "assistant", "content": "yo"}]}
    with pytest.raises(
        InputError, match="record 1: prompt and completion must both be text or both be message lists"
    ):
        prep(tmp_path, [mixed], tok)
    with pytest.raises(InputError, match="message lists need a chat template"):
        prep(tmp_path, CONV, tok_plain)
    dropping = make_tokenizer(chat_template=NO_SYSTEM_TEMPLATE)
    with pytest.raises(
        InputError, match=r"record 1: message 0 \(system\): the chat template does not render"
    ):
        prep(tmp_path, CONV, dropping)


def test_explicit_format_and_chat_still_wins_with_messages(tmp_path, tok):
    out = prep(tmp_path, PLAIN, tok, format="prompt_completion")
    assert out.format == "prompt_completion"
    # ultrachat-style: messages and a prompt string; no completion: chat
    rec = {"prompt": "hi there", "messages": CONV[0]["prompt"] + CONV[0]["completion"]}
    assert prep(tmp_path, [rec], tok).format == "chat"
