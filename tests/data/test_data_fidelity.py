"""Data fidelity: what a record holds is what gets trained, or the run stops naming the record.

Real-world shapes: LLaMA-Factory alpaca with system/history, OpenAI chats with tool calls, ShareGPT
with a system field and function calls, CSV with numeric columns, stray fields (images, ids)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from horizon_cli import utf8
from horizon_cli.config.schema import DataConfig
from horizon_cli.data import pad_id_of, prepare_data
from horizon_cli.errors import InputError
from tests.data.test_data_formats import CHAT, loss_spans
from tests.support.tokenizer import make_tokenizer

# renders `tools`, assistant `tool_calls` (name + arguments as JSON) and tool results
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nTools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "<call>{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</call>"
    "{% endfor %}{% endif %}"
    "{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# drops system messages without a word
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] != 'system' %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prep(path, tokenizer, logs=None, **cfg):
    log = logs.append if logs is not None else (lambda _: None)
    vocab_size = cfg.pop("vocab_size", None)
    cache_dir = cfg.pop("cache", None)
    data = DataConfig(path=str(path), **{"max_seq_len": 512, **cfg})
    return prepare_data(data, tokenizer, vocab_size=vocab_size, cache_dir=cache_dir, log=log)


# ---- scalars in text fields


def test_scalars_in_json_text_fields_become_their_text(tmp_path, tok_plain):
    recs = [
        {"instruction": "2+2?", "output": 4},
        {"instruction": "1-1?", "output": 0},
        {"instruction": "Is fire cold?", "output": False},
        {"instruction": "half of one?", "output": 0.5},
        {"instruction": 7, "input": 0, "output": "seven"},
    ]
    out = prep(write(tmp_path, recs), tok_plain).train
    assert [loss_spans(tok_plain, out[i]) for i in range(4)] == [
        ["4</s>"],
        ["0</s>"],
        ["false</s>"],
        ["0.5</s>"],
    ]
    assert "### Instruction:\n7\n\n### Input:\n0\n\n### Response:\nseven" in tok_plain.decode(
        out[4].input_ids
    )


def test_whole_floats_print_as_integers_and_texts_may_be_numbers(tmp_path, tok):
    # a column of numbers with one fraction arrives as floats: 4 -> 4.0, written back as "4"
    out = prep(write(tmp_path, [{"instruction": "a", "output": 4}, {"instruction": "b", "output": 4.5}]), tok)
    assert [loss_spans(tok, out.train[i]) for i in range(2)] == [["4</s>\n"], ["4.5</s>\n"]]
    text = prep(write(tmp_path, [{"text": 12345}, {"text": 0}], "t.jsonl"), tok).train
    assert tok.decode(text[1].input_ids) == "<s>0</s>" and len(text) == 2


def test_csv_cells_are_read_as_written(tmp_path, tok_plain):
    path = tmp_path / "d.csv"
    path.write_text(
        "\ufeffinstruction,input,output\nadd two and two,,4\nsubtract,NA,0\nhalve nine,,4.50\n"
    )  # with a BOM
    out = prep(path, tok_plain).train
    assert [loss_spans(tok_plain, out[i]) for i in range(3)] == [["4</s>"], ["0</s>"], ["4.50</s>"]]
    assert "### Input:\nNA\n\n" in tok_plain.decode(out[1].input_ids)
    assert "### Input:" not in tok_plain.decode(out[0].input_ids)


# ---- LLaMA-Factory alpaca: system and history

LF_ALPACA = {
    "instruction": "And Germany?",
    "input": "",
    "output": "Berlin.",
    "system": "Answer in one word.",
    "history": [["Capital of France?", "Paris."]],
}


def test_alpaca_system_and_history_with_a_chat_template(tmp_path, tok):
    row = prep(write(tmp_path, [LF_ALPACA]), tok).train[0]
    msgs = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And Germany?"},
        {"role": "assistant", "content": "Berlin."},
    ]
    assert tok.decode(row.input_ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert loss_spans(tok, row) == ["Paris.</s>\n", "Berlin.</s>\n"]  # history answers train too


def test_alpaca_system_and_history_without_a_chat_template(tmp_path, tok_plain):
    row = prep(write(tmp_path, [LF_ALPACA]), tok_plain).train[0]
    assert tok_plain.decode(row.input_ids) == (
        "<s>Answer in one word.\n\n### Instruction:\nCapital of France?\n\n### Response:\nParis.\n\n"
        "### Instruction:\nAnd Germany?\n\n### Response:\nBerlin.</s>"
    )
    assert loss_spans(tok_plain, row) == ["Paris.", "Berlin.</s>"]


def test_alpaca_history_must_be_pairs(tmp_path, tok):
    with pytest.raises(InputError, match=r"record 1: history\[0\] must be a \[prompt, response\] pair"):
        prep(write(tmp_path, [{**LF_ALPACA, "history": [["only a prompt"]]}]), tok)


# ---- chats: system field, tool calls, tools, weights

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
OPENAI_TOOLS = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 degrees"},
        {"role": "assistant", "content": "It is 18 degrees."},
    ],
    "tools": [TOOL],
}


def test_openai_tool_calls_and_tools_go_through_the_template(tmp_path):
    tok = make_tokenizer(chat_template=TOOLS_TEMPLATE)
    row = prep(write(tmp_path, [OPENAI_TOOLS]), tok).train[0]
    text = tok.decode(row.input_ids)
    assert "Tools: get_weather" in text and "<|tool|>\n18 degrees</s>" in text
    call = '<call>get_weather {"city": "Paris"}</call>'  # JSON-string arguments become a mapping
    assert loss_spans(tok, row) == [f"{call}</s>\n", "It is 18 degrees.</s>\n"]


def test_sharegpt_function_call_observation_and_string_tools_match_openai(tmp_path):
    tok = make_tokenizer(chat_template=TOOLS_TEMPLATE)
    conv = {
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
            {"from": "observation", "value": "18 degrees"},
            {"from": "gpt", "value": "It is 18 degrees."},
        ],
        "tools": json.dumps([TOOL]),  # LLaMA-Factory keeps tools as a JSON string
    }
    a = prep(write(tmp_path, [conv]), tok).train[0]
    b = prep(write(tmp_path, [OPENAI_TOOLS], "o.jsonl"), tok).train[0]
    assert tok.decode(a.input_ids) == tok.decode(b.input_ids)
    assert a.labels.tolist() == b.labels.tolist()


@pytest.mark.parametrize(
    "record, match",
    [
        (OPENAI_TOOLS, r"record 2: message 1 tool_calls: the chat template does not render them"),
        (
            {"messages": CHAT["messages"], "tools": [TOOL]},
            r"record 2: tools: the chat template does not render",
        ),
    ],
    ids=["tool_calls", "tools"],
)
def test_a_template_that_cannot_render_tools_stops_naming_field_and_record(tmp_path, tok, record, match):
    with pytest.raises(InputError, match=match):
        prep(write(tmp_path, [CHAT, record]), tok)  # the default template ignores tools


def test_a_template_that_drops_the_system_prompt_stops(tmp_path):
    tok = make_tokenizer(chat_template=NO_SYSTEM_TEMPLATE)
    with pytest.raises(
        InputError, match=r"record 1: message 0 \(system\): the chat template does not render"
    ):
        prep(write(tmp_path, [CHAT]), tok)


def test_sharegpt_system_field_becomes_the_system_turn(tmp_path, tok):
    conv = {"system": "Be brief.", "conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "Hello world!"}]}  # fmt: skip
    ref = {"messages": CHAT["messages"][:3]}
    a = prep(write(tmp_path, [conv]), tok).train[0]
    b = prep(write(tmp_path, [ref], "r.jsonl"), tok).train[0]
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.labels.tolist() == b.labels.tolist()
    clash = {"system": "Be long.", "messages": CHAT["messages"]}
    with pytest.raises(
        InputError, match="record 1: has both a `system` field and a different system message"
    ):
        prep(write(tmp_path, [clash], "c.jsonl"), tok)


def test_turn_keys_decide_the_shape_not_the_field_name(tmp_path, tok):
    sharegpt = [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]} for m in CHAT["messages"]]  # fmt: skip
    ref = prep(write(tmp_path, [CHAT], "ref.jsonl"), tok).train[0]
    for rec in ({"conversations": CHAT["messages"]}, {"messages": sharegpt}):
        row = prep(write(tmp_path, [rec]), tok).train[0]
        assert row.input_ids.tolist() == ref.input_ids.tolist() and row.labels.tolist() == ref.labels.tolist()


def test_weight_zero_keeps_the_turn_without_loss(tmp_path, tok):
    msgs = [dict(m) for m in CHAT["messages"]]
    msgs[2]["weight"] = 0
    row = prep(write(tmp_path, [{"messages": msgs}]), tok).train[0]
    assert "Hello world!" in tok.decode(row.input_ids)
    assert loss_spans(tok, row) == ["three four five</s>\n"]


def test_unread_fields_with_content_are_named_once_each(tmp_path, tok):
    msgs = [dict(m) for m in CHAT["messages"]]
    msgs[2]["reasoning_content"] = "think first"
    recs = [
        {**CHAT, "caption": "a cat", "id": 1, "source": "web", "token_count": 45, "notes": ""},
        {"messages": msgs, "caption": "", "id": 2, "source": "web", "token_count": 30, "notes": " "},
        {**CHAT, "caption": "a dog", "id": 3, "source": "web", "token_count": 10, "notes": ""},
    ]
    path, cache, logs = write(tmp_path, recs), tmp_path / "cache", []
    prep(path, tok, logs, cache=cache)
    warnings = [line.replace(str(tmp_path), "") for line in logs if line.startswith("warning:")]
    assert warnings == [
        "warning: /data.jsonl: field 'caption' is not read by format chat and is ignored (content in 2 records)",
        "warning: /data.jsonl: field 'messages[].reasoning_content' is not read by format chat and is ignored "
        "(content in 1 record)",
    ]
    again: list[str] = []
    prep(path, tok, again, cache=cache)  # a cache hit says it again
    assert any("cache hit" in line for line in again)
    assert [line.replace(str(tmp_path), "") for line in again if line.startswith("warning:")] == warnings


# ---- token ids against the model's vocabulary


def test_tokens_need_no_tokenizer_and_are_checked_against_the_model_vocab(tmp_path):
    recs = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 450], "labels": [-100, 9, 450]}]
    out = prep(write(tmp_path, recs), None, vocab_size=500)  # auto detects tokens
    assert out.format == "tokens" and out.pad_id == 0 and out.train[1].labels.tolist() == [-100, 9, 450]
    with pytest.raises(InputError, match=r"data.jsonl: record 2: input_ids holds id 450, outside the model's vocabulary \(vocab_size 300\)"):  # fmt: skip
        prep(write(tmp_path, recs), None, vocab_size=300)
    with pytest.raises(InputError, match="format 'text' needs a tokenizer"):
        prep(write(tmp_path, [{"text": "hi"}], "t.jsonl"), None, vocab_size=300)


@pytest.mark.parametrize(
    "rec, match",
    [
        ({"input_ids": [1, 2, 3], "labels": [-100, 2, 999]}, "labels holds id 999"),
        ({"input_ids": [-100, 2, 3]}, "input_ids holds id -100"),
        ({"input_ids": [1, 2, 2**40]}, "input_ids holds an id beyond 32 bits"),
        ({"input_ids": [1, 2, 3], "attention_mask": [1, 1, 0]}, "attention_mask has zeros"),
    ],
)
def test_bad_token_records(tmp_path, rec, match):
    with pytest.raises(InputError, match=f"record 2: {match}"):
        prep(write(tmp_path, [{"input_ids": [4, 5]}, rec]), None, vocab_size=400)


def test_the_models_vocab_counts_not_the_tokenizers(tmp_path, tok):
    # tokenizer (400 ids) larger than the model: its own ids >= 200 are refused, naming the record
    recs = [{"input_ids": [5, 6]}, {"input_ids": [5, 250]}]
    with pytest.raises(InputError, match="record 2: input_ids holds id 250, outside the model's vocabulary"):
        prep(write(tmp_path, recs), tok, vocab_size=200)
    texts = [{"text": "a"}, {"text": "Paris is the capital of France."}]  # merged tokens have ids > 262
    with pytest.raises(
        InputError, match=r"t.jsonl: record 2: the tokenizer gives id \d+ .*does not match the model"
    ):
        prep(write(tmp_path, texts, "t.jsonl"), tok, vocab_size=200)
    # and the reverse: a model vocab padded beyond the tokenizer accepts ids up to its own size
    out = prep(write(tmp_path, [{"input_ids": [5, 450]}], "w.jsonl"), tok, vocab_size=512)
    assert out.train[0].input_ids.tolist() == [5, 450]


def test_padding_id_is_one_the_model_can_embed(tmp_path):
    class Tok:
        pad_token_id, eos_token_id = 450, 2  # a pad token added beyond the model's vocabulary

    assert pad_id_of(Tok(), 512) == 450 and pad_id_of(None, 400) == 0
    assert prep(write(tmp_path, [{"input_ids": [5, 6]}]), Tok(), vocab_size=400).pad_id == 2


# ---- non-UTF-8 files


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".txt"])
def test_non_utf8_data_names_file_line_and_offset(tmp_path, tok, suffix):
    lines = {
        ".jsonl": [b'{"text": "one"}', b'{"text": "caf\xe9"}'],
        ".json": [b'[{"text": "one"},', b'{"text": "caf\xe9"}]'],
        ".csv": [b"text", b"caf\xe9"],
        ".txt": [b"one", b"caf\xe9"],
    }[suffix]
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(b"\n".join(lines) + b"\n")
    offset = len(lines[0]) + 1 + lines[1].index(b"\xe9")
    with pytest.raises(InputError, match=rf"latin1\{suffix}: not UTF-8 text: byte 0xe9 at line 2 \(byte offset {offset}\)"):  # fmt: skip
        prep(path, tok)


def test_utf8_scan_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(utf8, "CHUNK", 5)  # every multi-byte character straddles some chunk edge
    path = tmp_path / "d.txt"
    good = "žluťoučký kůň\nπ ≈ 3.14159 🙂\n".encode()
    path.write_bytes(good)
    utf8.check_file(path)
    path.write_bytes(good + b"ok\n\xc3(")  # a lead byte followed by a non-continuation byte
    with pytest.raises(
        InputError, match=rf"not UTF-8 text: byte 0xc3 at line 4 \(byte offset {len(good) + 3}\)"
    ):
        utf8.check_file(path)
    path.write_bytes("utf16".encode("utf-16"))
    with pytest.raises(InputError, match="byte 0xff at line 1 .*looks like UTF-16"):
        utf8.check_file(path)


def test_a_utf8_bom_is_dropped_from_every_input_file(tmp_path, tok):
    """Issue 32: one rule for every input file: a leading BOM is dropped (a .txt line kept it as
    text, a dataset_info.json and generate's prompts refused it)."""
    from horizon_cli.config import load_config
    from horizon_cli.data.prompts import read_records

    bom = b"\xef\xbb\xbf"
    files = {
        "d.txt": b"hello there\nsecond line\n",
        "d.jsonl": b'{"text": "hello there"}\n{"text": "second line"}\n',
        "d.json": b'[{"text": "hello there"}, {"text": "second line"}]',
        "d.csv": b"text\nhello there\nsecond line\n",
    }
    for name, body in files.items():
        (tmp_path / name).write_bytes(body)
        plain = prep(tmp_path / name, tok).train
        (tmp_path / name).write_bytes(bom + body)
        with_bom = prep(tmp_path / name, tok).train
        assert np.array_equal(with_bom.tokens, plain.tokens), name
        assert tok.decode(with_bom[0].input_ids) == "<s>hello there</s>", name
    (tmp_path / "reg").mkdir()
    (tmp_path / "reg" / "d.jsonl").write_bytes(files["d.jsonl"])
    reg = tmp_path / "reg" / "dataset_info.json"
    reg.write_bytes(bom + json.dumps({"d": {"file_name": "d.jsonl", "columns": {"prompt": "text"}}}).encode())
    assert np.array_equal(prep(reg, tok).train.tokens, plain.tokens)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(bom + b"model: {path: m}\ndata: {path: d.jsonl}\noutput: {dir: o}\n")
    assert load_config(cfg).data.path == "d.jsonl"
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(bom + b'{"prompt": "hi"}\n')
    assert read_records(prompts) == [({"prompt": "hi"}, f"{prompts} line 1")]


# ---- the token cache verifies what it loads


def test_corrupt_or_mismatched_cache_entry_is_rebuilt_with_a_note(tmp_path, tok):
    path = write(tmp_path, [CHAT] * 3)
    cache = tmp_path / "cache"
    want = np.array(prep(path, tok, cache=cache).train.tokens)  # a copy: the set maps the entry
    (entry,) = cache.iterdir()
    blob = bytearray((entry / "tokens.npy").read_bytes())
    blob[-1] ^= 0x01  # one bit of one token id
    (entry / "tokens.npy").write_bytes(bytes(blob))
    logs: list[str] = []
    again = prep(path, tok, logs, cache=cache).train
    assert np.array_equal(again.tokens, want)
    assert any("tokens.npy does not match its checksum); rebuilding" in line for line in logs)
    meta = json.loads((entry / "meta.json").read_text())
    (entry / "meta.json").write_text(json.dumps({**meta, "key": "0" * 20}))
    logs.clear()
    prep(path, tok, logs, cache=cache)
    assert any("does not match its fingerprint" in line for line in logs)
    logs.clear()
    prep(path, tok, logs, cache=cache)
    assert any("cache hit" in line for line in logs) and not any("rebuilding" in line for line in logs)


def test_media_columns_are_counted_without_decoding():
    import datasets

    from horizon_cli.data.fields import Unread, unread_columns

    feats = {
        "text": datasets.Value("string"),
        "images": datasets.List(datasets.Image()),
        "pic": datasets.Image(),
    }
    ds = datasets.Dataset.from_dict(
        {
            "text": ["a", "b", "c"],
            "images": [[{"bytes": b"not a png", "path": None}], [], None],
            "pic": [None] * 3,
        },
        features=datasets.Features(feats),
    )  # decoding "not a png" would raise
    assert unread_columns(ds, ["text"], Unread("text", "d")) == {"images": 1}
