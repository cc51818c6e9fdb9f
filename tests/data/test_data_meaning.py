"""Fields that change what a record means are never ignored silently (horizon_cli/data/fields.py).

LLaMA-Factory's KTO data (`kto_tag`) and TRL's unpaired preference data (`label: bool`) are read
as unpaired preference (format unpaired), and refused as KTO under another named format; a number or boolean under any other name, and a field named like a weight, score
or reward, stop the run naming the field and the record; ids and provenance stay metadata, and
data.ignore_fields declares more of it."""

from __future__ import annotations

import json
import re

import pytest

from horizon_cli.config.schema import DataConfig
from horizon_cli.data import prepare_data
from horizon_cli.errors import InputError
from tests.data.test_data_formats import CHAT

KTO = re.escape("unpaired preference (KTO) data is trained by preference: {loss: kto}")


def prep(tmp_path, records, tokenizer, logs=None, **cfg):
    path, text = tmp_path / "d.jsonl", "".join(json.dumps(r) + "\n" for r in records)
    if not path.is_file() or path.read_text() != text:  # the same file keeps its cache key
        path.write_text(text)
    log = logs.append if logs is not None else (lambda _: None)
    return prepare_data(DataConfig(path=str(path), **{"max_seq_len": 256, **cfg}), tokenizer, log=log)


def chats(n=4, **extra):
    return [{**CHAT, **{k: (v(i) if callable(v) else v) for k, v in extra.items()}} for i in range(n)]


def test_kto_data_is_read_as_unpaired_preference(tmp_path, tok):
    """LLaMA-Factory's kto_tag (sharegpt, alpaca) and TRL's boolean label: format unpaired (the
    KTO examples, data.unpaired), never SFT; read with another format named, refused as KTO."""
    recs = chats(kto_tag=lambda i: i % 2 == 0)  # LLaMA-Factory: messages + kto_tag true/false
    out = prep(tmp_path, recs, tok)
    assert out.format == "unpaired" and len(out.train) == 4 and out.unit == "examples"
    assert out.train.desirable(range(4)).tolist() == [True, False, True, False]
    alpaca = [
        {"instruction": "a", "output": "b", "kto_tag": False},
        {"instruction": "c", "output": "d", "kto_tag": True},
    ]
    assert prep(tmp_path, alpaca, tok).format == "unpaired"
    trl = [{"prompt": "The sky is", "completion": " blue.", "label": True},
           {"prompt": "The sky is", "completion": " green.", "label": False}]  # fmt: skip
    assert prep(tmp_path, trl, tok).train.desirable([0, 1]).tolist() == [True, False]
    with pytest.raises(InputError, match=rf"d.jsonl: record 1: field 'kto_tag' \(true\) .*{KTO}"):
        prep(tmp_path, recs, tok, format="chat")
    with pytest.raises(InputError, match=rf"record 1: field 'label' \(true\) .*{KTO}"):
        prep(tmp_path, trl, tok, format="prompt_completion")


@pytest.mark.parametrize(
    "field, value, shown",
    [("weight", 0.5, "0.5"), ("score", 3, "3"), ("reward", -1.0, "-1.0"), ("advantage", 0.2, "0.2"),
     ("label", "bad", "'bad'"), ("rating", "5 stars", "'5 stars'"), ("is_safe", False, "false"),
     ("turns", 2, "2")],
)  # fmt: skip
def test_meaning_fields_stop_the_run_naming_field_and_record(tmp_path, tok, field, value, shown):
    recs = chats(3) + [{**CHAT, field: value}]
    with pytest.raises(InputError) as e:
        prep(tmp_path, recs, tok)
    msg = str(e.value)
    assert f"d.jsonl: record 4: field {field!r} holds {shown}, which may change what the record means" in msg
    assert "format chat does not read it" in msg and "data.ignore_fields" in msg


def test_metadata_stays_silent_and_ignore_fields_declares_more(tmp_path, tok):
    recs = chats(id=lambda i: i, source="web", token_count=lambda i: 10 + i, dataset="x", url="http://a")
    logs: list[str] = []
    out = prep(tmp_path, recs, tok, logs)
    assert len(out.train) == 4 and not [x for x in logs if x.startswith("warning:")]
    with_score = chats(score=lambda i: float(i), turns=2)
    with pytest.raises(InputError, match="field 'score'"):
        prep(tmp_path, with_score, tok)
    plain = prep(tmp_path, chats(), tok)
    declared = prep(tmp_path, with_score, tok, ignore_fields=["score", "turns"])
    assert declared.train[0].input_ids.tolist() == plain.train[0].input_ids.tolist()
    # the user chose: KTO tags may be declared metadata too (plain SFT on every record)
    assert len(prep(tmp_path, chats(kto_tag=True), tok, ignore_fields=["kto_tag"]).train) == 4


def test_a_boolean_label_on_text_is_not_called_kto(tmp_path, tok):
    with pytest.raises(InputError, match="field 'label' holds true, which may change what the record means"):
        prep(tmp_path, [{"text": "a fine film", "label": True}], tok)


def test_nulls_and_blanks_carry_nothing(tmp_path, tok):
    recs = chats(score=None, weight=None, label="  ")
    assert len(prep(tmp_path, recs, tok).train) == 4


def test_message_fields_with_meaning_are_refused(tmp_path, tok):
    msgs = [dict(m) for m in CHAT["messages"]]
    msgs[2]["train"] = False  # axolotl-style: this turn is not to be trained
    with pytest.raises(InputError, match=r"record 1: message 2: field 'messages\[\]\.train' holds false"):
        prep(tmp_path, [{"messages": msgs}], tok)
    assert len(prep(tmp_path, [{"messages": msgs}], tok, ignore_fields=["train"]).train) == 1
    conv = {"conversations": [{"from": "human", "value": "hi", "score": 1}, {"from": "gpt", "value": "yo"}]}
    with pytest.raises(InputError, match=r"message 0: field 'conversations\[\]\.score' holds 1"):
        prep(tmp_path, [conv], tok)


def test_the_check_holds_on_a_cache_hit_after_ignore_fields_changes(tmp_path, tok):
    """ignore_fields is part of the cache key: an entry built while a field was declared
    metadata is not reused once the declaration is gone."""
    recs, cache, logs = chats(score=1.0), tmp_path / "cache", []
    prep(tmp_path, recs, tok, ignore_fields=["score"], cache_dir=str(cache))
    prep(tmp_path, recs, tok, logs, ignore_fields=["score"], cache_dir=str(cache))
    assert any("cache hit" in x for x in logs)
    with pytest.raises(InputError, match="field 'score'"):
        prep(tmp_path, recs, tok, cache_dir=str(cache))


def test_preference_pairs_are_never_read_as_sft(tmp_path, tok):
    """chosen and rejected are read as a pair (format preference), never judged as unknown
    meaning fields nor trained as SFT; a pair's tag or score is still refused."""
    pairs = [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},  # TRL
        {
            **CHAT,
            "chosen": {"role": "assistant", "content": "a"},
            "rejected": {"role": "assistant", "content": "b"},
        },
        {"instruction": "a", "input": "", "chosen": "b", "rejected": "c"},  # LLaMA-Factory alpaca
    ]
    for rec in pairs:
        out = prep(tmp_path, [rec], tok)
        assert out.format == "preference" and len(out.train) == 1 and out.unit == "pairs"
    with pytest.raises(InputError, match=r"record 1: field 'score' holds 0.5"):
        prep(tmp_path, [{**pairs[0], "score": 0.5}], tok)
    with pytest.raises(InputError, match=KTO):
        prep(tmp_path, [{**pairs[0], "kto_tag": True}], tok)
    with pytest.raises(InputError, match=r"chosen\[\]\.weight|chosen has a message weight"):
        msgs = [{"role": "assistant", "content": "x", "weight": 1}]
        prep(
            tmp_path, [{"prompt": [{"role": "user", "content": "q"}], "chosen": msgs, "rejected": msgs}], tok
        )
