"""Shared fixtures: a tiny converted store with a tokenizer, and helpers to write run configs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# engine.dtype: auto computes in bf16 only on a CPU with AVX-512 BF16 or AMX (runtime/dtype.py);
# the suite takes every CPU as one, so what a test that leaves the dtype to `auto` trains with does
# not depend on the machine (an AVX2-only CPU runs those tests in bf16, slower, as before auto);
# tests/runtime/test_dtype_auto.py takes this away to test the detection itself
os.environ["HORIZON_CPU_BF16"] = "1"
# rich wraps at the inherited terminal width (COLUMNS), and hard-wraps a word longer than it (a
# long tmp path, as under pytest-xdist): one fixed width for this process and every CLI it starts,
# so no test depends on the terminal it was started from
os.environ["COLUMNS"] = "200"


def horizon(*args):
    """`horizon ARGS...` in this process (typer's CliRunner), for the tests of the CLI: its Result
    (exit_code, output). Arguments may be paths; 2000 columns, so no line of the output wraps."""
    from typer.testing import CliRunner

    from horizon_cli.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "2000"})


def store_with_tokenizer(root: Path, family: str = "llama", chat_template: bool = True, **over) -> Path:
    """A tiny `family` model (vocab 400, 128 positions; `over`: more config) saved with the tiny
    tokenizer (with its chat template, or without) under root/hf and converted to fp32 at root/store."""
    from horizon_cli.convert import convert
    from tests.support.tiny import make_model, save
    from tests.support.tokenizer import make_tokenizer

    save(make_model(family, **{"vocab_size": 400, "max_position_embeddings": 128, **over}), root / "hf")
    make_tokenizer(root / "hf", chat_template=chat_template)
    convert(root / "hf", root / "store", dtype="float32")
    return root / "store"


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> Path:
    """A 2-layer Llama (tied embeddings, vocab 400) converted to fp32, with the tiny tokenizer."""
    return store_with_tokenizer(tmp_path_factory.mktemp("tiny"), "llama", tie=True)


@pytest.fixture(scope="module")
def tok():
    """The tiny tokenizer, with its chat template (one per test module, as each module had)."""
    from tests.support.tokenizer import make_tokenizer

    return make_tokenizer()


@pytest.fixture(scope="module")
def tok_plain():
    """The tiny tokenizer without a chat template."""
    from tests.support.tokenizer import make_tokenizer

    return make_tokenizer(chat_template=False)


def chat_rows(n: int = 48, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"what is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                ]
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_config(path: Path, store: Path, data_path: Path, out: Path, **sections) -> Path:
    cfg = {
        "model": {"path": str(store)},
        "data": {"path": str(data_path), "max_seq_len": 64, "shuffle": True},
        "train": {"steps": 6, "batch_size": 4, "micro_batch_size": 2, "seed": 1},
        "optim": {"lr": 3.0e-3, "grad_clip": 1.0, "weight_decay": 0.01},
        "schedule": {"kind": "cosine", "warmup_steps": 1},
        "engine": {"device": "cpu", "dtype": "float32"},
        "output": {"dir": str(out), "save_every": 2, "keep_last": 2, "export": False},
        "log": {"every": 1, "plot": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg))
    return path


SLOW_TIER = Path(__file__).with_name("slow_tier.txt")


def slow_tier_ids() -> list[str]:
    """tests/slow_tier.txt's lines: node ids (or prefixes ending in *) of the measured slow tier."""
    lines = (ln.strip() for ln in SLOW_TIER.read_text().splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def in_slow_tier(nodeid: str, line: str) -> bool:
    if line.endswith("*"):
        return nodeid.startswith(line[:-1])
    return nodeid == line or nodeid.startswith(line + "[")


@pytest.hookimpl(tryfirst=True)  # before pytest's -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    ids = slow_tier_ids()
    for item in items:
        if any(in_slow_tier(item.nodeid, ln) for ln in ids):
            item.add_marker(pytest.mark.slow)
