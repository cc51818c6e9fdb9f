"""LLaMA-Factory's dataset formats read as LLaMA-Factory reads them (data/records.py, registry.py).

LLaMA-Factory (src/llamafactory/data/converter.py) turns each record into the messages its template
renders; the rules are written out below (it cannot be installed offline here), and a record read
by horizon, rendered with the tokenizer's chat template, must be the rendering of those messages:

    alpaca    history [[prompt, response], ...] -> user/assistant turns first; the last user turn
              is "\\n".join of the instruction and the input, each only when non-empty
              (AlpacaDatasetConverter: query.append(prompt), query.append(query), "\\n".join(query));
              the response is `output`; `system` is the system prompt
    sharegpt  a first turn tagged system is the system prompt (the `system` column is read only
              without one); the other turns keep their order, human -> user, gpt -> assistant
              (SharegptDatasetConverter)
"""

from __future__ import annotations

import json

from horizon_cli.config.schema import DataConfig
from horizon_cli.data import prepare_data

ROLES = {"human": "user", "gpt": "assistant"}


def lf_alpaca(ex: dict) -> list[dict]:
    """AlpacaDatasetConverter's messages (system, prompt turns, response) for an SFT record."""
    msgs = [{"role": "system", "content": ex["system"]}] if ex.get("system") else []
    for old_prompt, old_response in ex.get("history") or []:
        msgs += [{"role": "user", "content": old_prompt}, {"role": "assistant", "content": old_response}]
    query = [ex[k] for k in ("instruction", "input") if ex.get(k)]
    return msgs + [
        {"role": "user", "content": "\n".join(query)},
        {"role": "assistant", "content": ex["output"]},
    ]


def lf_sharegpt(ex: dict) -> list[dict]:
    """SharegptDatasetConverter's messages for an SFT record with the default tags."""
    turns = ex["conversations"]
    if turns and turns[0]["from"] == "system":
        system, turns = turns[0]["value"], turns[1:]
    else:
        system = ex.get("system", "")
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": ROLES[t["from"]], "content": t["value"]} for t in turns]


ALPACA = [
    {"instruction": "Add the numbers", "input": "2 and 3", "output": "5"},
    {"instruction": "Greet", "input": "", "output": "Hello!"},
    {"instruction": "", "input": "only an input", "output": "ok"},
    {
        "instruction": "Sum",
        "input": "4 4",
        "output": "8",
        "system": "Be brief.",
        "history": [["hi", "hello"]],
    },
]
SHAREGPT = [
    {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "Hello world!"}]},
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "one two"},
            {"from": "gpt", "value": "three"},
            {"from": "human", "value": "four"},
            {"from": "gpt", "value": "five six"},
        ]
    },
    {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}], "system": "Be kind."},
]


def rendered(tmp_path, tok, records, name: str, formatting: str) -> list[str]:
    """Each record read through a LLaMA-Factory dataset_info.json entry, as the text trained on."""
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    entry = {"file_name": f"{name}.jsonl", "formatting": formatting}
    if formatting == "alpaca":
        entry["columns"] = {"prompt": "instruction", "query": "input", "response": "output",
                            "system": "system", "history": "history"}  # fmt: skip
    reg = tmp_path / "dataset_info.json"
    reg.write_text(json.dumps({name: entry}))
    out = prepare_data(DataConfig(path=str(reg), max_seq_len=256, shuffle=False), tok, log=lambda _: None)
    return [tok.decode(out.train[i].input_ids) for i in range(len(out.train))]


def test_alpaca_records_are_llamafactorys_messages(tmp_path, tok):
    got = rendered(tmp_path, tok, ALPACA, "al", "alpaca")
    assert got == [tok.apply_chat_template(lf_alpaca(r), tokenize=False) for r in ALPACA]
    assert "Add the numbers\n2 and 3" in got[0]  # one newline, not a blank line


def test_alpaca_user_turn_joins_instruction_and_input_with_one_newline(tok):
    from horizon_cli.data.records import instruction_record

    for r in ALPACA:
        assert instruction_record(r, "r").as_chat().messages == lf_alpaca(r)


def test_sharegpt_records_are_llamafactorys_messages(tmp_path, tok):
    got = rendered(tmp_path, tok, SHAREGPT, "sg", "sharegpt")
    assert got == [tok.apply_chat_template(lf_sharegpt(r), tokenize=False) for r in SHAREGPT]
