"""Data formats: tokenization, label masking, auto detection, truncation (horizon_cli.data)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from horizon_cli.config.schema import DataConfig
from horizon_cli.data import IGNORE, prepare_data
from horizon_cli.errors import InputError
from tests.support.tokenizer import VOCAB_SIZE, make_tokenizer


def prep(tmp_path, records, tokenizer, **cfg):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    logs: list[str] = []
    out = prepare_data(DataConfig(path=str(path), **{"max_seq_len": 256, **cfg}), tokenizer, log=logs.append)
    return out, logs


def loss_spans(tokenizer, row) -> list[str]:
    """Decode each contiguous run of tokens that carry loss."""
    on = row.labels != IGNORE
    runs, cur = [], []
    for t, flag in zip(row.input_ids, on, strict=True):
        if flag:
            cur.append(int(t))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r) for r in runs]


CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "Hello world!"},
        {"role": "user", "content": "one two"},
        {"role": "assistant", "content": "three four five"},
    ]
}


def test_tiny_tokenizer_round_trips_through_save_pretrained(tmp_path, tok):
    saved = make_tokenizer(tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert len(saved) == len(tok) == VOCAB_SIZE
    assert saved("Hello world").input_ids == tok("Hello world").input_ids
    assert saved.apply_chat_template(CHAT["messages"], tokenize=False) == tok.apply_chat_template(
        CHAT["messages"], tokenize=False
    )
    assert (
        tok.decode(tok("any text: ünïcode ok", add_special_tokens=False).input_ids) == "any text: ünïcode ok"
    )


def test_text_adds_bos_and_eos_and_trains_on_everything(tmp_path, tok):
    out, _ = prep(tmp_path, [{"text": "Hello world"}], tok, format="text")
    row = out.train[0]
    body = tok("Hello world", add_special_tokens=False).input_ids
    assert row.input_ids.tolist() == [tok.bos_token_id, *body, tok.eos_token_id]
    assert row.labels.tolist() == row.input_ids.tolist()
    assert row.input_ids.dtype == np.int32
    assert out.format == "text"


def test_text_does_not_double_eos(tmp_path, tok):
    out, _ = prep(tmp_path, [{"text": "Hello world</s>"}], tok, format="text")
    ids = out.train[0].input_ids.tolist()
    assert ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id


def test_blank_text_records_are_dropped(tmp_path, tok):
    out, logs = prep(tmp_path, [{"text": "one"}, {"text": "  "}, {"text": ""}, {"text": "two"}], tok)
    assert len(out.train) == 2
    assert out.train.stats["empty"] == 2
    assert any("2 empty" in line for line in logs)


def test_chat_masks_all_but_assistant_turns(tmp_path, tok):
    out, _ = prep(tmp_path, [CHAT], tok, format="chat")
    row = out.train[0]
    assert tok.decode(row.input_ids) == tok.apply_chat_template(CHAT["messages"], tokenize=False)
    assert loss_spans(tok, row) == ["Hello world!</s>\n", "three four five</s>\n"]  # the turn whole (TRL)
    on = row.labels != IGNORE
    assert np.array_equal(row.labels[on], row.input_ids[on])


def test_chat_train_on_prompt_trains_on_everything(tmp_path, tok):
    out, _ = prep(tmp_path, [CHAT], tok, format="chat", train_on_prompt=True)
    row = out.train[0]
    assert row.labels.tolist() == row.input_ids.tolist()


def test_sharegpt_maps_roles(tmp_path, tok):
    conv = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "hi there"},
            {"from": "gpt", "value": "Hello world!"},
            {"from": "human", "value": "one two"},
            {"from": "gpt", "value": "three four five"},
        ]
    }
    out, _ = prep(tmp_path, [conv], tok)
    ref, _ = prep(tmp_path, [CHAT], tok)
    assert out.format == "chat"
    assert out.train[0].input_ids.tolist() == ref.train[0].input_ids.tolist()
    assert out.train[0].labels.tolist() == ref.train[0].labels.tolist()


def test_sharegpt_unknown_role_is_an_input_error(tmp_path, tok):
    conv = {"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]}
    with pytest.raises(InputError, match=r"data.jsonl: record 1: conversations\[0\] has from='alien'"):
        prep(tmp_path, [conv], tok)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# marks only the final message, so rendering a prefix does not prefix the full conversation
FINAL_MARK = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% if loop.last %}three{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    "template, end",
    [(CHATML, "<|im_end|>\n"), (LLAMA3, "<|eot_id|>"), (FINAL_MARK, "</s>\n")],
    ids=["chatml", "llama3", "prefix-breaking"],
)
def test_chat_spans_with_other_templates(tmp_path, template, end):
    """Each turn whole, through what its template writes after the end-of-turn marker: ChatML's
    `<|im_end|>\n`, as TRL's qwen2_5_training.jinja puts it inside {% generation %} and
    LLaMA-Factory's chatml / qwen `format_assistant` slot `{{content}}<|im_end|>\n` labels it."""
    tokenizer = make_tokenizer(chat_template=template)  # markers not in its vocab: spelled out in bytes
    out, _ = prep(tmp_path, [CHAT], tokenizer, format="chat", max_seq_len=1024)
    assert out.train.stats["truncated"] == 0
    assert loss_spans(tokenizer, out.train[0]) == [f"Hello world!{end}", f"three four five{end}"]


def test_instruction_with_chat_template_is_a_user_turn(tmp_path, tok):
    rec = {"instruction": "Write a poem", "input": "about the sea", "output": "Waves and sky."}
    out, _ = prep(tmp_path, [rec], tok, format="instruction")
    row = out.train[0]
    msgs = [
        {"role": "user", "content": "Write a poem\nabout the sea"},
        {"role": "assistant", "content": "Waves and sky."},
    ]
    assert tok.decode(row.input_ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert loss_spans(tok, row) == ["Waves and sky.</s>\n"]


def test_instruction_alpaca_prompt_without_chat_template(tmp_path, tok_plain):
    recs = [
        {"instruction": "Write a poem", "input": "about the sea", "output": "Waves and sky."},
        {"instruction": "Say hi", "output": "hi"},
    ]
    out, _ = prep(tmp_path, recs, tok_plain, format="instruction")
    with_input, without = out.train[0], out.train[1]
    text = tok_plain.decode(with_input.input_ids)
    assert text.startswith("<s>Below is an instruction")
    assert "### Input:\nabout the sea\n\n### Response:\nWaves and sky.</s>" in text
    assert "### Input:" not in tok_plain.decode(without.input_ids)
    assert loss_spans(tok_plain, with_input) == ["Waves and sky.</s>"]
    assert loss_spans(tok_plain, without) == ["hi</s>"]


def test_instruction_train_on_prompt(tmp_path, tok_plain):
    rec = {"instruction": "Say hi", "output": "hi"}
    out, _ = prep(tmp_path, [rec], tok_plain, format="instruction", train_on_prompt=True)
    row = out.train[0]
    assert row.labels.tolist() == row.input_ids.tolist()


def test_tokens_used_exactly_as_given(tmp_path, tok):
    recs = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        {"input_ids": [9, 10, 11]},
    ]
    out, _ = prep(tmp_path, recs, tok)
    assert out.format == "tokens"
    assert out.train[0].input_ids.tolist() == [5, 6, 7, 8]
    assert out.train[0].labels.tolist() == [-100, -100, 7, 8]
    assert out.train[1].input_ids.tolist() == [9, 10, 11]
    assert out.train[1].labels.tolist() == [9, 10, 11]


@pytest.mark.parametrize(
    "rec, match",
    [
        ({"input_ids": [1, 2, 3], "labels": [1, 2]}, "labels has 2 entries, input_ids 3"),
        ({"input_ids": [1, 2, 100000]}, "outside the tokenizer's vocabulary"),
        ({"input_ids": [[1, 2], [3, 4]]}, "flat list of integers"),
    ],
)
def test_tokens_bad_records(tmp_path, tok, rec, match):
    with pytest.raises(InputError, match=match):
        prep(tmp_path, [rec], tok, format="tokens")


@pytest.mark.parametrize(
    "rec, fmt",
    [
        ({"text": "hi"}, "text"),
        ({"instruction": "a", "input": "b", "output": "c"}, "instruction"),
        ({"instruction": "a", "output": "c"}, "instruction"),
        (CHAT, "chat"),
        ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}, "chat"),
        ({"input_ids": [1, 2, 3], "text": "ignored"}, "tokens"),
    ],
)
def test_auto_detection(tmp_path, tok, rec, fmt):
    out, logs = prep(tmp_path, [rec], tok)
    assert out.format == fmt and out.train.format == fmt
    assert any(f"format {fmt} (auto-detected" in line for line in logs)


def test_auto_detection_fails_naming_the_fields(tmp_path, tok):
    with pytest.raises(
        InputError, match=r"data.jsonl: cannot detect the data format from fields \[question, answer\]"
    ):
        prep(tmp_path, [{"question": "a", "answer": "b"}], tok)


def test_prompt_only_records_are_detected_and_sent_to_rl(tmp_path, tok):
    """TRL's prompt-only records (a prompt and a column for the rewards) are format prompt, which
    only an rl: run trains (data.prompt_only): an SFT run says so in one line."""
    with pytest.raises(
        InputError, match=r"data.jsonl: holds prompts only .* train them online with an rl: section"
    ):
        prep(tmp_path, [{"prompt": "a", "answer": "b"}], tok)


def test_explicit_format_missing_fields(tmp_path, tok):
    with pytest.raises(
        InputError, match=r"data.jsonl: format 'instruction' needs .*output.*fields \[instruction\]"
    ):
        prep(tmp_path, [{"instruction": "a"}], tok, format="instruction")


def test_truncation_counts_records_and_tokens(tmp_path, tok_plain):
    long = " ".join(["one two three four five"] * 10)
    recs = [{"instruction": "hi", "output": long}, {"instruction": "hi", "output": "ok"}]
    out, logs = prep(tmp_path, recs, tok_plain, max_seq_len=96)
    row = out.train[0]
    assert len(row.input_ids) == 96 and row.input_ids[0] == tok_plain.bos_token_id
    full, _ = prep(tmp_path, recs[:1], tok_plain, max_seq_len=1024)
    whole = full.train[0]
    assert row.input_ids.tolist() == whole.input_ids[:96].tolist()  # the head, cut
    cut, cut_loss = len(whole.input_ids) - 96, int((whole.labels[96:] != IGNORE).sum())
    assert cut > 0 and cut_loss == cut  # the cut part is all response
    assert out.train.stats["truncated"] == 1 and out.train.stats["cut_tokens"] == cut
    assert any(
        f"1 truncated to max_seq_len 96 ({cut} tokens cut, {cut_loss} of them with loss)" in x for x in logs
    )


def test_chat_without_template_is_an_input_error(tmp_path, tok_plain):
    with pytest.raises(InputError, match="format 'chat' needs a chat template"):
        prep(tmp_path, [CHAT], tok_plain)


def test_chats_without_an_assistant_turn_are_named_as_such(tmp_path, tok):
    only_user = {"messages": [{"role": "user", "content": "hello"}]}
    with pytest.raises(InputError, match="data.jsonl: no record has an assistant turn.*train_on_prompt"):
        prep(tmp_path, [only_user, only_user], tok)
    with pytest.raises(InputError, match="data.jsonl: record 2 has no assistant turn") as e:
        prep(tmp_path, [{"messages": []}, only_user], tok)
    assert "max_seq_len" not in str(e.value)


def test_truncation_that_cuts_every_response_is_every_label_masked(tmp_path, tok_plain):
    rec = {"instruction": "one two three four five six seven eight nine ten", "output": "hi"}
    with pytest.raises(InputError, match="every label is masked"):
        prep(tmp_path, [rec], tok_plain, max_seq_len=8)


def test_chat_message_with_null_content(tmp_path, tok):
    rec = {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "hi"}]}
    out, _ = prep(tmp_path, [rec], tok)
    assert loss_spans(tok, out.train[0]) == ["hi</s>\n"]


def test_chat_message_content_must_be_text(tmp_path, tok):
    rec = {
        "messages": [{"role": "user", "content": [{"type": "text"}]}, {"role": "assistant", "content": "hi"}]
    }
    with pytest.raises(InputError, match="record 1: message 0 'content' must be text, got a list"):
        prep(tmp_path, [rec], tok)


def test_examples_without_loss_are_dropped(tmp_path, tok):
    only_user = {"messages": [{"role": "user", "content": "hello"}]}
    weightless = {
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0}]
    }
    out, logs = prep(tmp_path, [only_user, CHAT, weightless], tok)
    assert len(out.train) == 1 and out.train.stats["no_labels"] == 1 and out.train.stats["no_assistant"] == 1
    assert any("1 without an assistant turn (the first: record 1)" in line for line in logs)
