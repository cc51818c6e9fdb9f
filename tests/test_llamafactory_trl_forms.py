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
