"""Preference data (data/preference.py, data/pairs.py): every form read into the token ids TRL's
DPOTrainer gives (its own dataset preparation and collator's truncation), LLaMA-Factory's alpaca
and sharegpt records as the TRL conversation they stand for, pre-tokenized pairs as given, bad
pairs named and skipped, a missing completion refused, pairs never parted by the eval split."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from horizon_cli.config.schema import DataConfig
from horizon_cli.data import prepare_data
from horizon_cli.data.batch import IGNORE
from horizon_cli.data.formats import resolve_format
from horizon_cli.data.pairs import as_pairs, build_pairs
from horizon_cli.errors import InputError
from tests.conftest import write_jsonl

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

CONV = {
    "prompt": [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 plus 3?"}],
               [{"role": "user", "content": "hello there"}]],
    "chosen": [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "hi, how are you?"}]],
    "rejected": [[{"role": "assistant", "content": "six"}], [{"role": "assistant", "content": "go away"}]],
}  # fmt: skip
PLAIN = {
    "prompt": ["The sky is", "one two", "Paris is the capital of"],
    "chosen": [" blue.", " three", " France"],
    "rejected": [" green.", " four five", " Germany, a country"],
}


@pytest.fixture(scope="module")
def trainer(tok, tmp_path_factory):
    from tests.support.tiny import make_model

    model = make_model("llama", vocab_size=400)
    args = trl.DPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], use_cpu=True, bf16=False
    )
    ds = datasets.Dataset.from_dict(PLAIN)
    return trl.DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=ds, processing_class=tok
    )


def ours(records: dict, tok, max_len: int = 128, log=None):
    ds = datasets.Dataset.from_dict(records)
    ts = build_pairs(ds, tok, DataConfig(max_seq_len=max_len), "d.jsonl", log or (lambda s: None), None)
    return as_pairs(ts)


def theirs(trainer, records: dict, tok, max_len: int | None = None) -> list[tuple[list, list]]:
    """TRL's rows: (prompt + completion ids, completion mask), chosen then rejected of each pair,
    after its dataset preparation and (max_len) its collator's keep_start truncation."""
    args = copy.copy(trainer.args)
    args.max_length = max_len
    prepared = trainer._prepare_dataset(datasets.Dataset.from_dict(records), tok, args, "x")
    coll = trl.trainer.dpo_trainer.DataCollatorForPreference(pad_token_id=0, max_length=max_len)
    out = []
    for ex in prepared:
        b = coll([ex])
        for r in (0, 1):
            n = int(b["attention_mask"][r].sum())
            out.append((b["input_ids"][r, :n].tolist(), b["completion_mask"][r, :n].tolist()))
    return out


def rows_of(pairs) -> list[tuple[list, list]]:
    return [
        (r.input_ids.tolist(), (r.labels != IGNORE).astype(int).tolist())
        for r in pairs.rows(range(len(pairs)))
    ]


@pytest.mark.parametrize("records", [PLAIN, CONV], ids=["standard", "conversational"])
def test_trl_forms_tokenize_as_trl(trainer, tok, records):
    assert rows_of(ours(records, tok)) == theirs(trainer, records, tok)


def test_implicit_prompt_as_trls_extract_prompt(trainer, tok):
    conv = {k: [p + c for p, c in zip(CONV["prompt"], CONV[k], strict=True)] for k in ("chosen", "rejected")}
    text = {
        k: [p + c for p, c in zip(PLAIN["prompt"], PLAIN[k], strict=True)] for k in ("chosen", "rejected")
    }
    for records in (conv, text):
        assert rows_of(ours(records, tok)) == theirs(trainer, records, tok)


def test_truncation_as_trls_collator_with_counts(trainer, tok):
    said = []
    got = ours(PLAIN, tok, max_len=7, log=said.append)
    assert rows_of(got) == [r for r in theirs(trainer, PLAIN, tok, max_len=7) if len(r[0])]
    prompt_lens = [
        len(p)
        for p in trainer._prepare_dataset(datasets.Dataset.from_dict(PLAIN), tok, trainer.args, "x")[
            "prompt_ids"
        ]
    ]
    assert len(got) == sum(n < 7 for n in prompt_lens) < 3  # TRL drops a pair whose prompt fills max_length
    assert "pairs truncated to max_seq_len 7" in said[0] and "1 prompt fills max_seq_len" in said[0]


def test_llama_factory_records_are_the_conversations_they_stand_for(trainer, tok, tok_plain):
    alpaca = {
        "instruction": ["add the numbers", "greet"], "input": ["2 and 3", ""], "system": ["be brief", ""],
        "chosen": ["5", "hello!"], "rejected": ["six", "no"],
    }  # fmt: skip
    as_trl = {
        "prompt": [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "add the numbers\n2 and 3"}],
                   [{"role": "user", "content": "greet"}]],
        "chosen": [[{"role": "assistant", "content": c}] for c in alpaca["chosen"]],
        "rejected": [[{"role": "assistant", "content": c}] for c in alpaca["rejected"]],
    }  # fmt: skip
    assert rows_of(ours(alpaca, tok)) == theirs(trainer, as_trl, tok)
    sharegpt = {
        "conversations": [[{"from": "human", "value": "what is 2 plus 3?"}], [{"from": "human", "value": "hello there"}]],
        "system": ["be brief", ""],
        "chosen": [{"from": "gpt", "value": "5"}, {"from": "gpt", "value": "hi, how are you?"}],
        "rejected": [{"from": "gpt", "value": "six"}, {"from": "gpt", "value": "go away"}],
    }  # fmt: skip
    assert rows_of(ours(sharegpt, tok)) == theirs(trainer, CONV, tok)
    # no chat template: the Alpaca prompt as TRL's standard prompt
    plain = ours({k: v[1:] for k, v in alpaca.items()}, tok_plain)
    prompt = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\ngreet\n\n### Response:\n"
    want = theirs(trainer, {"prompt": [prompt], "chosen": ["hello!"], "rejected": ["no"]}, tok_plain)
    assert rows_of(plain) == want


def test_pre_tokenized_pairs_are_used_as_given(tok):
    recs = {
        "prompt_input_ids": [[1, 5, 6], [1, 7]],
        "chosen_input_ids": [[8, 9], [10]],
        "rejected_input_ids": [[11], [12, 13, 14]],
    }
    assert rows_of(ours(recs, None)) == [
        ([1, 5, 6, 8, 9], [0, 0, 0, 1, 1]), ([1, 5, 6, 11], [0, 0, 0, 1]),
        ([1, 7, 10], [0, 0, 1]), ([1, 7, 12, 13, 14], [0, 0, 1, 1, 1]),
    ]  # fmt: skip


def test_auto_detects_every_form():
    for cols in (["prompt", "chosen", "rejected"], ["chosen", "rejected"], ["instruction", "input", "chosen", "rejected"],
                 ["conversations", "chosen", "rejected"], ["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"]):  # fmt: skip
        assert resolve_format("auto", cols, "d") == "preference"


def test_bad_pairs_are_named_and_skipped(tok):
    said: list[str] = []
    recs = {
        "prompt": ["a", "b", "c", "d"],
        "chosen": [" x", " same", "", " y"],
        "rejected": [" z", " same", " w", "  "],
    }
    got = ours(recs, tok, log=said.append)
    assert len(got) == 1
    warn = [s for s in said if s.startswith("warning")]
    assert any("1 pair skipped (chosen equals rejected): record 2" in s for s in warn)
    assert any("2 pairs skipped (empty completion): records 3, 4" in s for s in warn)


def test_a_missing_completion_is_refused(tok, tmp_path):
    with pytest.raises(InputError, match=r"record 2: has no 'rejected'"):
        ours({"prompt": ["a", "b"], "chosen": [" x", " y"], "rejected": [" z", None]}, tok)
    with pytest.raises(InputError, match=r"has field 'chosen' but no 'rejected'"):
        resolve_format("auto", ["prompt", "chosen"], "d.jsonl")


def test_eval_split_keeps_pairs_whole(tok, tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": f" yes {i}", "rejected": f" no {i}{i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = DataConfig(path=str(path), max_seq_len=64, eval_fraction=0.25)
    data = prepare_data(cfg, tok, seed=3, log=lambda s: None)
    assert data.format == "preference" and (len(data.train), len(data.eval)) == (15, 5)
    seen = set()
    for split in (data.train, data.eval):
        rows = split.rows(range(len(split)))
        for c, r in zip(rows[0::2], rows[1::2], strict=True):
            text = tok.decode(c.input_ids[c.labels == IGNORE])
            assert tok.decode(r.input_ids[r.labels == IGNORE]) == text  # the same prompt: one pair
            seen.add(text)
    assert len(seen) == 20
    assert np.intersect1d(data.train.stored, data.eval.stored).size == 0
