"""Bad inputs as a user meets them: `horizon train` exits 2 with one line naming the file and the
record or key; config strictness; `--debug` after the command; `--version`."""

from __future__ import annotations

import json
import shutil

import pytest

from horizon_cli import __version__
from horizon_cli.errors import ConfigError
from tests.conftest import chat_rows, write_config, write_jsonl
from tests.train.test_train_cli import horizon, one_error_line


@pytest.fixture
def cfg(tiny_store, tmp_path):
    def make(data, store=tiny_store, **sections):
        return write_config(tmp_path / "cfg.yaml", store, data, tmp_path / "run", **sections)

    return make


# ---- config


def test_duplicate_keys_and_non_finite_numbers_are_reported_at_once(cfg, tmp_path):
    path = cfg(write_jsonl(tmp_path / "d.jsonl", chat_rows(4)))
    text = path.read_text()
    path.write_text(text + "schedule:\n  min_lr_ratio: .nan\nlog:\n  every: 1\n")  # two more sections, again
    msg = one_error_line(
        horizon("train", path, "optim.eps=nan", "optim.weight_decay=.inf", "optim.betas=[0.9, inf]")
    )
    for needle in (
        "schedule: duplicate key (lines",
        "log: duplicate key (lines",
        "schedule.min_lr_ratio: expected a finite number, got nan",
        "optim.eps: expected a finite number, got 'nan'",
        "optim.weight_decay: expected a finite number, got inf",
        "optim.betas: list item 'inf': expected a finite number",
    ):
        assert needle in msg
    inner = tmp_path / "inner.yaml"
    inner.write_text("data:\n  path: a.jsonl\n  max_seq_len: 8\n  path: b.jsonl\n")
    assert "data.path: duplicate key (lines 2 and 4)" in one_error_line(horizon("train", inner))


def test_non_utf8_config_names_line_and_offset(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"model:\n  path: caf\xe9\n")
    msg = one_error_line(horizon("train", path))
    assert "latin1.yaml: not UTF-8 text: byte 0xe9 at line 2 (byte offset 18)" in msg


def test_debug_after_the_command_and_version(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 1\n")
    r = horizon("train", bad, "--debug")  # the traceback is shown: the error propagates
    assert isinstance(r.exception, ConfigError) and "train.stepz" in str(r.exception)
    assert "No such option" not in r.output
    assert "train.stepz" in one_error_line(horizon("train", bad))  # without it: one line
    r = horizon("--version")
    assert r.exit_code == 0 and r.output.strip() == f"horizon {__version__}"


# ---- data


@pytest.fixture
def store_without_tokenizer(tiny_store, tmp_path):
    store = tmp_path / "bare"
    shutil.copytree(tiny_store, store)
    for f in (store / "hf").iterdir():
        if f.name != "config.json":
            f.unlink()
    return store


def test_pre_tokenized_data_trains_without_tokenizer_files(cfg, tmp_path, store_without_tokenizer):
    rows = [{"input_ids": list(range(5, 5 + n))} for n in range(8, 16)]
    data = write_jsonl(tmp_path / "tok.jsonl", rows)
    r = horizon("train", cfg(data, store_without_tokenizer), "train.steps=1")  # format: auto
    assert r.exit_code == 0, r.output
    assert "format tokens (auto-detected" in r.output
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "hello"}])
    fresh = {"dir": str(tmp_path / "run2")}  # the first run's dir would refuse the new data first
    msg = one_error_line(horizon("train", cfg(text, store_without_tokenizer, output=fresh)))
    assert f"model.path: store {store_without_tokenizer} has no tokenizer files" in msg
    assert "and format 'text' needs a tokenizer" in msg


BAD_DATA = [
    # (records or raw bytes, what the one line must say)
    (
        [{"input_ids": [1, 2]}, {"input_ids": [3, 400]}],
        "bad.jsonl: record 2: input_ids holds id 400, outside the model's vocabulary (vocab_size 400)",
    ),  # fmt: skip
    (
        b'{"text": "one"}\n{"text": "caf\xe9"}\n',
        "bad.jsonl: not UTF-8 text: byte 0xe9 at line 2 (byte offset 29)",
    ),
    (
        [{"messages": [{"role": "user", "content": "hi"}]}],
        "bad.jsonl: record 1 has no assistant turn, so there is nothing to train on",
    ),  # fmt: skip
    (
        [
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                ]
            }
        ],
        "bad.jsonl: record 1: message 1 tool_calls: the chat template does not render them",
    ),  # fmt: skip
    ([{"instruction": "a", "output": ["b", "c"]}], "bad.jsonl: record 1: output must be text, got a list"),
    ([{"instruction": "a", "output": "b", "history": "x"}], "bad.jsonl: record 1: history must be a list"),
]


@pytest.mark.parametrize(
    "data, needle", BAD_DATA, ids=["vocab", "utf8", "no-assistant", "tool-calls", "list", "history"]
)
def test_bad_data_is_one_line_naming_file_and_record(cfg, tmp_path, data, needle):
    path = tmp_path / "bad.jsonl"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        write_jsonl(path, data)
    msg = one_error_line(horizon("train", cfg(path)))
    assert needle in msg
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_ignored_fields_are_named_in_a_warning(cfg, tmp_path):
    # (an `images` field is read now: a text-only model refuses it, tests/vision/test_vision.py)
    rows = [{**r, "caption": f"picture {i}", "id": i} for i, r in enumerate(chat_rows(8))]
    r = horizon("train", cfg(write_jsonl(tmp_path / "d.jsonl", rows)), "train.steps=1")
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())  # rich wraps long lines at the terminal's width
    assert out.count("warning:") == 1 and "d.jsonl: field 'caption' is not read by format chat" in out
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
