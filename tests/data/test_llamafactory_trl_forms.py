"""Forms TRL and LLaMA-Factory users bring, read as those tools read them: LLaMA-Factory's own KTO
registry entries (a kto_tag column mapped to itself), TRL's vision messages with string content
(data.images puts the image parts before the first user text, as TRL's prepare_multimodal_messages)
and KTO on paired data (TRL's KTOTrainer unpairs it: chosen -> desirable, rejected -> undesirable)."""

from __future__ import annotations

import json

import pytest

from horizon_cli.config.schema import DataConfig
from horizon_cli.data import prepare_data

TURNS = [
    {"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}],
     "kto_tag": i % 2 == 0}
    for i in range(4)
]  # fmt: skip
ALPACA = [
    {"instruction": f"question {i}", "input": "", "output": f"answer {i}", "kto_tag": i % 2 == 0}
    for i in range(4)
]


def _prep(tok, path, **cfg):
    return prepare_data(
        DataConfig(**{"max_seq_len": 128, "shuffle": False, "path": str(path), **cfg}), tok, seed=0
    )


def _registry(tmp_path, rows, entry) -> str:
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"kto": {"file_name": "d.jsonl", **entry}}))
    return str(tmp_path / "dataset_info.json")


@pytest.mark.parametrize(
    "rows, entry",
    [
        (TURNS, {"formatting": "sharegpt", "columns": {"messages": "conversations", "kto_tag": "kto_tag"}}),
        (
            ALPACA,
            {
                "columns": {
                    "prompt": "instruction",
                    "query": "input",
                    "response": "output",
                    "kto_tag": "kto_tag",
                }
            },
        ),
    ],
    ids=["sharegpt", "alpaca"],
)
def test_llamafactorys_own_kto_entries_are_unpaired_preference(tmp_path, tok, rows, entry):
    """The identity mapping kto_tag -> kto_tag (LLaMA-Factory's dataset_info.json) is KTO data,
    the same examples as the file read directly."""
    via = _prep(tok, _registry(tmp_path, rows, entry))
    direct = _prep(tok, tmp_path / "d.jsonl")
    assert via.format == direct.format == "unpaired"
    n = len(direct.train)
    assert via.train.desirable(list(range(n))).tolist() == [True, False, True, False]
    ids = lambda d: [r.input_ids.tolist() for r in d.train.rows(list(range(n)))]  # noqa: E731
    assert ids(via) == ids(direct)


def _as_trl(example) -> list[dict]:
    """horizon's canonical messages in TRL's shape (image parts carry their file)."""
    files = iter(example.images)
    return [
        {
            "role": m["role"],
            "content": [{**p, "image": next(files)} if p["type"] == "image" else p for p in m["content"]],
        }
        for m in example.messages
    ]


@pytest.mark.parametrize("n", [1, 2])
def test_trls_vision_messages_with_string_content_put_the_images_before_the_first_user_text(tmp_path, n):
    """TRL's vision form: {"images": [...], "messages": [... string content ...]} -> the messages
    TRL's prepare_multimodal_messages makes (the image parts before the first user message's text)."""
    from trl.data_utils import prepare_multimodal_messages

    from horizon_cli.vision.records import image_example

    images = [f"img/{k}.png" for k in range(n)]
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What color is this?"},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "And the border?"},
        {"role": "assistant", "content": "Blue."},
    ]
    got = image_example({"images": images, "messages": messages}, "v.jsonl: line 1", tmp_path)
    want = prepare_multimodal_messages(messages, [tmp_path / f for f in images])
    assert _as_trl(got) == want
    assert got.images == [tmp_path / f for f in images]


def test_placeholders_still_pair_with_images_llamafactorys_way(tmp_path):
    """LLaMA-Factory's `<image>` in the text still places each image; a mismatch is still refused."""
    from horizon_cli.errors import InputError
    from horizon_cli.vision.records import image_example

    rec = {"images": ["a.png"], "messages": [{"role": "user", "content": "Look: <image> what?"},
                                             {"role": "assistant", "content": "A cat."}]}  # fmt: skip
    ex = image_example(rec, "v.jsonl: line 1", tmp_path)
    assert [p["type"] for p in ex.messages[0]["content"]] == ["text", "image", "text"]
    two = {**rec, "images": ["a.png", "b.png"]}
    with pytest.raises(InputError, match="fewer image placeholders"):
        image_example(two, "v.jsonl: line 1", tmp_path)


PAIRS = [
    {"prompt": f"question {i}", "chosen": f"good answer {i}", "rejected": f"bad {i}", "id": i}
    for i in range(6)
]


@pytest.mark.parametrize("chat", [False, True], ids=["text", "messages"])
def test_kto_on_pairs_reads_what_trls_unpairing_makes(tmp_path, tok, chat):
    """KTOTrainer unpairs preference pairs (trl.data_utils.unpair_preference_dataset: the chosen
    completions desirable, then the rejected undesirable, the prompt repeated): horizon's KTO on the
    pairs file gives the examples of horizon's KTO on TRL's unpaired records."""
    import datasets
    from trl.data_utils import unpair_preference_dataset

    rows = PAIRS
    if chat:
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "id": r["id"],
                 **{k: [{"role": "assistant", "content": r[k]}] for k in ("chosen", "rejected")}} for r in PAIRS]  # fmt: skip
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    unpaired = unpair_preference_dataset(datasets.Dataset.from_list(rows))
    (tmp_path / "trl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unpaired.to_list()))
    got = _prep(tok, pairs, format="unpaired", ignore_fields=["id"])
    want = _prep(tok, tmp_path / "trl.jsonl", ignore_fields=["id"])
    assert got.format == want.format == "unpaired" and len(got.train) == len(want.train) == 2 * len(PAIRS)
    n = len(want.train)
    assert got.train.desirable(list(range(n))).tolist() == want.train.desirable(list(range(n))).tolist()
    assert [(r.input_ids.tolist(), r.labels.tolist()) for r in got.train.rows(list(range(n)))] == [
        (r.input_ids.tolist(), r.labels.tolist()) for r in want.train.rows(list(range(n)))
    ]


def test_kto_on_pairs_trains_from_the_cli_and_pairs_without_a_prompt_are_one_line(tmp_path, tiny_store):
    from tests.conftest import horizon, write_config, write_jsonl

    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    cfg = write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "run", preference={"loss": "kto"},
                       data={"ignore_fields": ["id"]}, train={"steps": 2, "batch_size": 4, "micro_batch_size": 2})  # fmt: skip
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    assert "12 examples (6 desirable, 6 undesirable" in r.output
    implicit = write_jsonl(tmp_path / "implicit.jsonl", [{"chosen": "a b", "rejected": "a c"}] * 4)
    cfg = write_config(
        tmp_path / "d.yaml", tiny_store, implicit, tmp_path / "run2", preference={"loss": "kto"}
    )
    r = horizon("train", cfg)
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1 and "implicit.jsonl" in lines[0] and "prompt" in lines[0], (
        r.output
    )


def test_kto_trains_from_a_registry_and_its_hint_names_the_entry(tmp_path, tiny_store):
    """preference: {loss: kto} on a dataset_info.json entry (KTO's auto format met the registry's
    'leave data.format auto' before); without it, the hint names the registry and its entry."""
    from tests.conftest import horizon, write_config

    reg = _registry(
        tmp_path,
        TURNS,
        {"formatting": "sharegpt", "columns": {"messages": "conversations", "kto_tag": "kto_tag"}},
    )
    train = {"steps": 1, "batch_size": 4, "micro_batch_size": 2}
    r = horizon(
        "train",
        write_config(
            tmp_path / "c.yaml", tiny_store, reg, tmp_path / "run", preference={"loss": "kto"}, train=train
        ),
    )
    assert r.exit_code == 0 and "4 examples (2 desirable, 2 undesirable" in " ".join(r.output.split()), (
        r.output
    )
    src = [{"path": reg, "names": ["kto"]}]
    r = horizon(
        "train",
        write_config(
            tmp_path / "d.yaml", tiny_store, reg, tmp_path / "run2", data={"path": src}, train=train
        ),
    )
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and f"data.path: {reg} (kto) holds unpaired preference examples" in said, said
