"""Several sources in one run: `data.path` as a list (own format, split and weight each),
LLaMA-Factory's dataset_info.json as a source list, and eval rows from a DatasetDict split."""

from __future__ import annotations

import json
from collections import Counter

import datasets
import pytest

from horizon_cli.config import load_config
from horizon_cli.config.schema import DataConfig, SourceConfig
from horizon_cli.data import prepare_data
from horizon_cli.errors import ConfigError, InputError
from tests.conftest import chat_rows

TEXTS = ["Hello world", "The quick brown fox", "one two three", "Paris is the capital of France."]
ALPACA = [{"instruction": f"say {w}", "input": "", "output": f"{w} {w}"} for w in ("one", "two", "three")]


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prep(tok, logs=None, seed=0, batch_size=None, **cfg):
    log = logs.append if logs is not None else (lambda _: None)
    data = DataConfig(**{"max_seq_len": 128, "shuffle": False, **cfg})
    return prepare_data(data, tok, seed=seed, log=log, batch_size=batch_size)


def ids(ts) -> list[tuple[int, ...]]:
    return [tuple(ts[i].input_ids.tolist()) for i in range(len(ts))]


def rows(ts) -> list[tuple[list[int], list[int]]]:
    return [(ts[i].input_ids.tolist(), ts[i].labels.tolist()) for i in range(len(ts))]


def test_sources_with_their_own_format_and_weight(tmp_path, tok):
    chats = jsonl(tmp_path / "chat.jsonl", chat_rows(3))
    texts = jsonl(tmp_path / "text.jsonl", [{"text": t, "messages": "x"} for t in TEXTS])  # read as text
    alone_c = prep(tok, path=str(chats)).train
    alone_t = prep(tok, path=str(texts), format="text").train
    logs: list[str] = []
    src = [SourceConfig(path=str(chats), weight=2.0), SourceConfig(path=str(texts), format="text")]
    out = prep(tok, logs, path=src, batch_size=4)
    assert out.format == "chat+text"
    assert Counter(ids(out.train)) == Counter(ids(alone_c) * 2 + ids(alone_t))  # each chat row twice
    assert out.train.label_tokens == 2 * alone_c.label_tokens + alone_t.label_tokens
    assert any(
        "data: mixture per epoch: " in x and "3 rows x 2 = 6 (60.0%)" in x and "4 rows = 4 (40.0%)" in x
        for x in logs
    )
    assert any("an epoch is 10 rows = 2.5 steps of train.batch_size 4" in x for x in logs)


def test_a_fractional_weight_takes_a_seeded_subset(tmp_path, tok):
    texts = jsonl(tmp_path / "t.jsonl", [{"text": f"{t} {i}"} for i in range(5) for t in TEXTS])  # 20 rows
    other = jsonl(tmp_path / "o.jsonl", [{"text": "one"}])
    src = [SourceConfig(path=str(texts), weight=1.5), SourceConfig(path=str(other))]
    a, b = prep(tok, path=src, seed=3).train, prep(tok, path=src, seed=3).train
    assert ids(a) == ids(b) and len(a) == 20 + 10 + 1
    counts = Counter(ids(a))
    assert sorted(counts.values()) == [1] * 11 + [2] * 10  # 10 of the 20 rows twice, `other` once
    assert ids(prep(tok, path=src, seed=4).train) != ids(a)  # the subset follows the seed
    with pytest.raises(InputError, match="weight 0.01 of its 1 rows is no row at all"):
        prep(tok, path=[SourceConfig(path=str(texts)), SourceConfig(path=str(other), weight=0.01)])


def test_eval_fraction_splits_each_source_before_weighting(tmp_path, tok):
    """A row repeated by its weight must not land in train and eval both."""
    a = jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i}"} for i in range(10)])
    b = jsonl(tmp_path / "b.jsonl", [{"text": f"beta {i}"} for i in range(10)])
    out = prep(
        tok, path=[SourceConfig(path=str(a), weight=3.0), SourceConfig(path=str(b))], eval_fraction=0.2
    )
    train, evals = set(ids(out.train)), set(ids(out.eval))
    assert len(out.eval) == 4 and not train & evals
    assert len(out.train) == 3 * 8 + 8


def test_each_source_is_cached_on_its_own(tmp_path, tok):
    a, b = (
        jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS]),
        jsonl(tmp_path / "b.jsonl", chat_rows(2)),
    )
    src, cache = [str(a), SourceConfig(path=str(b), weight=2.0)], str(tmp_path / "cache")
    first = prep(tok, path=[SourceConfig(path=s) if isinstance(s, str) else s for s in src], cache_dir=cache)
    logs: list[str] = []
    again = prep(
        tok, logs, path=[SourceConfig(path=str(a)), SourceConfig(path=str(b), weight=3.0)], cache_dir=cache
    )
    assert sum("cache hit" in x for x in logs) == 2  # a weight is no part of a source's tokens
    assert len(again.train) == len(first.train) + 2


def test_config_list_items_are_strings_or_sources(tmp_path):
    base = ["model.path=m", "output.dir=o"]
    cfg = load_config(None, [*base, "data.path=[a.jsonl, {path: b.jsonl, weight: 2, format: text}]"])
    assert cfg.data.path == [
        SourceConfig(path="a.jsonl"),
        SourceConfig(path="b.jsonl", format="text", weight=2.0),
    ]
    with pytest.raises(ConfigError) as e:
        load_config(
            None, [*base, "data.path=[a.jsonl, {path: b.jsonl, weight: -1, formt: text}, {weight: 1}]"]
        )
    msg = str(e.value)
    for needle in ("data.path[1].formt: unknown key", "data.path[1].weight: -1.0 must be greater than 0.0",
                   "data.path[2].path: required"):  # fmt: skip
        assert needle in msg
    with pytest.raises(ConfigError, match=r"data.path: an empty list"):
        load_config(None, [*base, "data.path=[]"])


def test_the_same_source_twice_is_refused(tmp_path, tok):
    a = jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    with pytest.raises(InputError, match="is listed twice .give it a weight instead"):
        prep(tok, path=[SourceConfig(path=str(a)), SourceConfig(path=str(a))])


# ---- LLaMA-Factory's dataset_info.json


def registry(tmp_path, entries: dict):
    path = tmp_path / "dataset_info.json"
    path.write_text(json.dumps(entries))
    return path


def test_dataset_info_entries_read_as_their_canonical_twins(tmp_path, tok):
    jsonl(tmp_path / "qa.jsonl", [{"question": r["instruction"], "answer": r["output"]} for r in ALPACA])
    talk = [{"dialog": [{"speaker": "me", "words": "hi there"}, {"speaker": "bot", "words": "Hello world!"}]}]
    jsonl(tmp_path / "talk.jsonl", talk)
    jsonl(tmp_path / "corpus.jsonl", [{"content": t} for t in TEXTS])
    oa = [
        {
            "messages": [
                {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "Hello world!"},
            ]
        }
    ]
    jsonl(tmp_path / "oa.jsonl", oa)
    reg = registry(tmp_path, {
        "qa": {"file_name": "qa.jsonl", "columns": {"prompt": "question", "response": "answer"}},
        "talk": {"file_name": "talk.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"},
                 "tags": {"role_tag": "speaker", "content_tag": "words", "user_tag": "me", "assistant_tag": "bot"}},
        "corpus": {"file_name": "corpus.jsonl", "columns": {"prompt": "content"}},  # pre-training shape
        "oa": {"file_name": "oa.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
               "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                        "assistant_tag": "assistant", "system_tag": "system"}},
    })  # fmt: skip
    twins = {
        "qa": jsonl(tmp_path / "qa_twin.jsonl", [{"instruction": r["instruction"], "output": r["output"]} for r in ALPACA]),
        "talk": jsonl(tmp_path / "talk_twin.jsonl", [{"messages": [{"role": "user", "content": "hi there"},
                                                                    {"role": "assistant", "content": "Hello world!"}]}]),
        "corpus": jsonl(tmp_path / "corpus_twin.jsonl", [{"text": t} for t in TEXTS]),
        "oa": tmp_path / "oa.jsonl",
    }  # fmt: skip
    logs: list[str] = []
    out = prep(tok, logs, path=str(reg))
    assert out.format == "chat+instruction+text"
    assert rows(out.train) == sum((rows(prep(tok, path=str(p)).train) for p in twins.values()), [])
    assert any("mixture per epoch: qa 3 rows" in x for x in logs)
    picked = prep(tok, path=[SourceConfig(path=str(reg), names=["talk"], weight=2.0)])
    assert len(picked.train) == 2


@pytest.mark.parametrize(
    "entry, match",
    [({"file_name": "d.jsonl", "ranking": True}, "needs field.s. chosen/chosen_input_ids and rejected"),
     ({"ms_hub_url": "x/y"}, "loads from ms_hub_url, which horizon does not read"),
     ({"file_name": "d.jsonl", "colums": {}}, "entry 'e': unknown key 'colums'"),
     ({"file_name": "d.jsonl", "columns": {"answer": "output"}}, "columns: 'answer' is not a alpaca column"),
     ({"file_name": "nope.jsonl"}, r"data.path \(.*dataset_info.json: e\): .*nope.jsonl: no such file")],
)  # fmt: skip
def test_dataset_info_problems_are_one_line(tmp_path, tok, entry, match):
    jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b", "tag": True}])
    with pytest.raises(InputError, match=match):
        prep(tok, path=str(registry(tmp_path, {"e": entry})))


def test_dataset_info_names_and_shape_are_checked(tmp_path, tok):
    jsonl(tmp_path / "d.jsonl", ALPACA)
    reg = registry(tmp_path, {"e": {"file_name": "d.jsonl"}})
    with pytest.raises(InputError, match=r"data.path\[0\]: .*has no entry 'f' \(entries: e\)"):
        prep(tok, path=[SourceConfig(path=str(reg), names=["f"])])
    with pytest.raises(
        InputError, match=r"data.path\[0\].format: a dataset_info.json registry sets each entry's format"
    ):
        prep(tok, path=[SourceConfig(path=str(reg), format="chat")])
    hf_info = tmp_path / "hf" / "dataset_info.json"  # what save_to_disk writes: not a registry
    hf_info.parent.mkdir()
    hf_info.write_text(json.dumps({"citation": "", "features": {"text": {"dtype": "string"}}}))
    with pytest.raises(InputError, match="not a LLaMA-Factory dataset registry"):
        prep(tok, path=str(hf_info))


def test_num_samples_scales_the_entry(tmp_path, tok):
    jsonl(tmp_path / "d.jsonl", ALPACA)
    reg = registry(tmp_path, {"e": {"file_name": "d.jsonl", "num_samples": 6}})
    assert len(prep(tok, path=str(reg)).train) == 6  # 6 of 3 records: each twice


# ---- eval from a split


def test_eval_split_takes_each_sources_split(tmp_path, tok):
    d = tmp_path / "dd"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"text": t} for t in TEXTS]),
        "test": datasets.Dataset.from_list([{"text": "held out one"}, {"text": "held out two"}]),
    }).save_to_disk(str(d))  # fmt: skip
    logs: list[str] = []
    out = prep(tok, logs, path=str(d), eval_split="test")
    assert len(out.train) == 4 and len(out.eval) == 2
    assert ids(out.eval) == ids(prep(tok, path=str(d), split="test").train)
    assert any("data: eval (split 'test'): 2 rows" in x for x in logs)
    with pytest.raises(InputError, match=r"no split 'dev' in this DatasetDict \(splits: test, train\)"):
        prep(tok, path=str(d), eval_split="dev")
    f = jsonl(tmp_path / "f.jsonl", [{"text": "x"}])
    with pytest.raises(
        InputError, match=r"data.path\[1\] \(data.eval_split\): .*f.jsonl is a single file, without splits"
    ):
        prep(tok, path=[SourceConfig(path=str(d)), SourceConfig(path=str(f))], eval_split="test")


def test_a_dataset_info_kto_tag_column_is_unpaired_preference(tmp_path, tok):
    """LLaMA-Factory's KTO entry (columns: kto_tag) -> format unpaired, its tags the labels."""
    jsonl(
        tmp_path / "d.jsonl",
        [{"instruction": "a", "output": "b", "tag": True}, {"instruction": "c", "output": "d", "tag": False}],
    )
    entry = {
        "file_name": "d.jsonl",
        "columns": {"prompt": "instruction", "response": "output", "kto_tag": "tag"},
    }
    out = prep(tok, path=str(registry(tmp_path, {"e": entry})))
    assert out.format == "unpaired" and out.train.desirable([0, 1]).tolist() == [True, False]
