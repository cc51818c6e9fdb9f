"""Data pipeline: packing, the tokenization cache, eval splits, config checks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from horizon_cli.config.schema import DataConfig
from horizon_cli.data import IGNORE, prepare_data, source
from horizon_cli.errors import InputError
from tests.support.tokenizer import make_tokenizer

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def write_texts(path, n: int, seed: int = 0):
    """n text records of 1..10 words each."""
    rng = np.random.default_rng(seed)
    texts = [" ".join(WORDS[: int(rng.integers(1, 11))]) for _ in range(n)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def prep(path, tokenizer, logs=None, **cfg):
    log = logs.append if logs is not None else (lambda _: None)
    seed = cfg.pop("seed", 0)
    cache_dir = cfg.pop("cache", None)
    return prepare_data(DataConfig(path=str(path), **cfg), tokenizer, seed=seed, cache_dir=cache_dir, log=log)


def arrays(ts):
    return [ts.tokens, ts.labels, ts.offsets, ts.doc_ids]


# ---- packing


def test_packing_greedy_rows_doc_ids_positions_and_boundaries(tmp_path, tok):
    path = write_texts(tmp_path / "d.jsonl", 40)
    plain = prep(path, tok, max_seq_len=32).train
    packed = prep(path, tok, max_seq_len=32, packing=True).train
    assert packed.packed and not plain.packed
    lengths = [len(plain[i].input_ids) for i in range(len(plain))]
    # greedy in order: a document joins the row when it fits
    expect_rows, used = [[]], 0
    for n in lengths:
        if used + n > 32:
            expect_rows.append([])
            used = 0
        expect_rows[-1].append(n)
        used += n
    assert len(packed) == len(expect_rows) < len(plain)
    doc = 0
    for r, docs in enumerate(expect_rows):
        row = packed[r]
        assert len(row.input_ids) == sum(docs) <= 32
        starts = np.cumsum([0, *docs[:-1]])
        assert row.doc_ids.tolist() == [d for d, n in enumerate(docs) for _ in range(n)]
        assert row.position_ids.tolist() == [p for n in docs for p in range(n)]
        for s, n in zip(starts, docs, strict=True):
            orig = plain[doc]
            assert row.input_ids[s : s + n].tolist() == orig.input_ids.tolist()
            assert row.labels[s] == IGNORE  # no prediction across the boundary
            assert row.labels[s + 1 : s + n].tolist() == orig.labels[1:].tolist()
            doc += 1
    assert doc == len(plain)
    assert packed.label_tokens == plain.label_tokens


def test_packing_truncates_long_chat_examples_first(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    long = {
        "messages": [{"role": "user", "content": " ".join(WORDS * 5)}, {"role": "assistant", "content": "hi"}]
    }
    short = {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]}
    path.write_text(json.dumps(long) + "\n" + json.dumps(short) + "\n")
    logs: list[str] = []
    packed = prep(path, tok, logs, max_seq_len=16, packing=True, train_on_prompt=True).train
    whole = len(tok.apply_chat_template(short["messages"], tokenize=True, return_dict=True)["input_ids"])
    assert [len(packed[i].input_ids) for i in range(len(packed))] == [16, whole]
    full = len(tok.apply_chat_template(long["messages"], tokenize=True, return_dict=True)["input_ids"])
    assert packed.stats["truncated"] == 1 and packed.stats["cut_tokens"] == full - 16
    assert packed.stats["cut_label_tokens"] == full - 16  # train_on_prompt: every cut token had loss
    assert any(
        f"1 truncated to max_seq_len 16 ({full - 16} tokens cut, {full - 16} of them with loss)" in x
        for x in logs
    )


# ---- cache


def test_cache_hit_is_bit_identical_and_skips_loading(tmp_path, tok, monkeypatch):
    path = write_texts(tmp_path / "d.jsonl", 30)
    cache = tmp_path / "cache"
    logs: list[str] = []
    first = prep(path, tok, logs, cache=cache, packing=True, max_seq_len=32).train
    assert not any("cache hit" in line for line in logs)

    def boom(_src):
        raise AssertionError("a cache hit must not load the dataset")

    monkeypatch.setattr(source, "load_records", boom)
    second = prep(path, tok, logs, cache=cache, packing=True, max_seq_len=32).train
    assert any("cache hit" in line for line in logs)
    for a, b in zip(arrays(first), arrays(second), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert second.stats == first.stats and second.format == "text"
    assert second.label_tokens == int(second.row_label_tokens.sum()) > 0  # stats match the arrays
    monkeypatch.undo()
    fresh = prep(path, tok, packing=True, max_seq_len=32).train  # no cache at all
    for a, b in zip(arrays(fresh), arrays(second), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def entries(cache):
    return sorted(p.name for p in cache.iterdir())


@pytest.mark.parametrize(
    "change",
    [
        {"max_seq_len": 16},
        {"packing": True},
        {"train_on_prompt": True},
        {"format": "text"},
    ],
)
def test_cache_key_changes_with_settings(tmp_path, tok, change):
    path = write_texts(tmp_path / "d.jsonl", 10)
    cache = tmp_path / "cache"
    prep(path, tok, cache=cache)
    before = entries(cache)
    prep(path, tok, cache=cache, **change)
    assert len(entries(cache)) == len(before) + 1


def test_cache_key_changes_with_the_file(tmp_path, tok):
    path = write_texts(tmp_path / "d.jsonl", 10)
    cache = tmp_path / "cache"
    a = prep(path, tok, cache=cache).train
    write_texts(path, 12, seed=1)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a visibly newer file
    logs: list[str] = []
    b = prep(path, tok, logs, cache=cache).train
    assert not any("cache hit" in line for line in logs)
    assert len(a) == 10 and len(b) == 12 and len(entries(cache)) == 2


def test_cache_key_changes_with_the_tokenizer(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    )
    cache = tmp_path / "cache"
    prep(path, tok, cache=cache)
    other = make_tokenizer(
        chat_template="{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    prep(path, other, cache=cache)
    assert len(entries(cache)) == 2


def test_data_cache_dir_wins_over_the_callers(tmp_path, tok):
    path = write_texts(tmp_path / "d.jsonl", 5)
    prep(path, tok, cache=tmp_path / "caller", cache_dir=str(tmp_path / "mine"))
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "caller").exists()


def test_stale_cache_entry_is_rebuilt(tmp_path, tok):
    path = write_texts(tmp_path / "d.jsonl", 5)
    cache = tmp_path / "cache"
    first = prep(path, tok, cache=cache).train
    (entry,) = cache.iterdir()
    (entry / "labels.npy").unlink()  # a broken entry is a miss, then replaced
    again = prep(path, tok, cache=cache).train
    assert np.array_equal(again.labels, first.labels)
    assert (entry / "labels.npy").is_file()


# ---- eval split


def test_eval_fraction_is_seeded_disjoint_and_keeps_train_order(tmp_path, tok):
    path = write_texts(tmp_path / "d.jsonl", 50)
    full = prep(path, tok).train
    a = prep(path, tok, eval_fraction=0.2, seed=3)
    b = prep(path, tok, eval_fraction=0.2, seed=3)
    c = prep(path, tok, eval_fraction=0.2, seed=4)
    assert len(a.eval) == 10 and len(a.train) == 40
    assert np.array_equal(a.eval.index, b.eval.index) and np.array_equal(a.train.index, b.train.index)
    assert not np.array_equal(a.eval.index, c.eval.index)
    assert sorted([*a.train.index, *a.eval.index]) == list(range(50))
    assert list(a.train.index) == sorted(a.train.index)  # file order without shuffle
    for i, r in enumerate(a.eval.index):
        assert a.eval[i].input_ids.tolist() == full[int(r)].input_ids.tolist()
    assert a.train.label_tokens + a.eval.label_tokens == full.label_tokens


def test_eval_fraction_needs_training_rows(tmp_path, tok):
    path = write_texts(tmp_path / "d.jsonl", 1)
    with pytest.raises(InputError, match="data.eval_fraction: .* leaves no rows to train on"):
        prep(path, tok, eval_fraction=0.5)


def test_eval_path_loads_a_separate_file_in_the_same_format(tmp_path, tok):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"instruction": "Say hi", "output": "hi"}) + "\n")
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"instruction": "Say yo", "output": "yo"}) + "\n")
    out = prep(train, tok, eval_path=str(evals))
    assert out.format == "instruction" and out.eval.format == "instruction" and len(out.eval) == 1


def test_eval_path_with_other_fields_names_the_eval_file(tmp_path, tok):
    train = write_texts(tmp_path / "train.jsonl", 3)
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(InputError, match=r"eval.jsonl: format 'text' needs field\(s\) text; .*\[prompt\]"):
        prep(train, tok, eval_path=str(evals))


def test_eval_fraction_and_eval_path_together(tmp_path, tok):
    path = write_texts(tmp_path / "d.jsonl", 3)
    with pytest.raises(InputError, match="give one of data.eval_path, eval_fraction and eval_split"):
        prep(path, tok, eval_fraction=0.1, eval_path=str(path))


# ---- config checks


def test_max_seq_len_beyond_the_model(tmp_path, tok):
    path = write_texts(tmp_path / "d.jsonl", 3)
    with pytest.raises(InputError, match="data.max_seq_len: 4096 exceeds the model's limit of 2048"):
        prepare_data(
            DataConfig(path=str(path), max_seq_len=4096), tok, model_max_len=2048, log=lambda _: None
        )
    out = prepare_data(
        DataConfig(path=str(path), max_seq_len=2048), tok, model_max_len=2048, log=lambda _: None
    )
    assert len(out.train) == 3 and out.pad_id == tok.pad_token_id
