"""The memory ladder: every rung's plan, `--dry-run` on a config.json alone for another machine,
`--json`, and a start that does not fit refused with the rung that would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from horizon_cli import preflight
from horizon_cli.arch import spec_from_hf
from horizon_cli.config import load_config
from horizon_cli.planning.ladder import best_rung, fit_parts, plan_ladder
from horizon_cli.preflight import given_machine
from horizon_cli.store import Store
from tests.conftest import chat_rows, horizon, write_config, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
H200_1_5TB = (1500, 141)  # GiB: one H200 and 1,500 GiB of RAM (issue 39's machine)


def test_mistral_large_fits_one_h200_in_exact_with_release_not_without():
    cfg = load_config(ROOT / "configs" / "mistral-large-123b-sft.yaml")
    spec = spec_from_hf(json.loads((FIXTURES / "mistral-large-2407.config.json").read_text()))
    machine = given_machine(*H200_1_5TB)
    rungs = plan_ladder(cfg, spec, where=machine)
    assert 122e9 < rungs["exact+release"].params < 123e9
    assert fit_parts(rungs["exact+release"], machine) == (True, True, True)
    assert fit_parts(rungs["exact"], machine) == (False, False, True)  # the host is what exact lacks
    assert rungs["exact+release"].bytes_per_param < 12.1 and rungs["exact"].bytes_per_param >= 14
    assert rungs["lean"].bytes_per_param <= 7.2 and rungs["lean+release"].bytes_per_param < 5.25
    assert best_rung(rungs, machine) == "exact+release"
    assert (cfg.optim.memory, cfg.optim.grad_release) == ("exact", "true")


@pytest.fixture
def planned(tmp_path):
    """A dir holding only Mistral-Large's config.json, a data file, a config for them."""
    shutil.copy(
        FIXTURES / "mistral-large-2407.config.json",
        (tmp_path / "ml").mkdir() or tmp_path / "ml" / "config.json",
    )
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    return tmp_path, [f"model.path={tmp_path / 'ml'}", f"data.path={data}", f"output.dir={tmp_path / 'run'}"]


def test_dry_run_plans_a_config_json_for_another_machine(planned):
    tmp, over = planned
    out = tmp / "plan.json"
    cfg = ROOT / "configs" / "mistral-large-123b-sft.yaml"
    r = horizon("train", cfg, *over, "optim.grad_release=false", "--dry-run", "--json", out,
                "--host-gib", H200_1_5TB[0], "--device-gib", H200_1_5TB[1])  # fmt: skip
    # the plan printed and written, then the line a start gives, exit 2 (a start would stop there)
    assert r.exit_code == 2, r.output
    assert "memory ladder" in r.output and "largest rung that fits: exact+release" in r.output
    assert r.output.strip().splitlines()[-1].startswith("error: memory plan does not fit this machine")
    plan = json.loads(out.read_text())
    for key in (
        "params",
        "trainable_params",
        "host_bytes",
        "host_bytes_per_param",
        "device_bytes",
        "fits",
        "ladder",
    ):
        assert key in plan, key
    assert plan["fits"] is False and plan["memory"] == "exact"
    fitting = ["exact+release", "lean", "lean+release", "lora", "qlora"]
    assert [r for r, p in plan["ladder"].items() if p["fits"]] == fitting
    assert plan["ladder"]["lora"]["trainable_params"] < plan["params"] / 100
    assert not (tmp / "run").exists()
    # a real start on a config.json is refused: it must be converted first
    r = horizon("train", cfg, *over)
    assert r.exit_code == 2 and "convert it first" in r.output


def test_dry_run_plans_a_generic_moe_config(planned, tmp_path):
    tmp, over = planned
    moe = tmp_path / "moe"
    moe.mkdir()
    shutil.copy(FIXTURES / "qwen3-30b-a3b.config.json", moe / "config.json")
    out = tmp / "moe.json"
    r = horizon("train", ROOT / "configs" / "qwen3-30b-a3b-sft.yaml", *over, f"model.path={moe}",
                "--dry-run", "--json", out, "--host-gib", 768e9 / 2**30, "--device-gib", 131)  # fmt: skip
    assert r.exit_code == 0, r.output
    plan = json.loads(out.read_text())
    assert 30e9 < plan["params"] < 31e9 and plan["ladder"]["exact"]["fits"]


def test_machine_options_are_checked(planned):
    tmp, over = planned
    cfg = ROOT / "configs" / "mistral-large-123b-sft.yaml"
    assert "go together" in horizon("train", cfg, *over, "--dry-run", "--host-gib", 100).output
    assert "with --dry-run" in horizon("train", cfg, *over, "--host-gib", 100, "--device-gib", 80).output
    assert "--dry-run" in horizon("train", cfg, *over, "--json", tmp / "x.json").output


def test_a_start_that_does_not_fit_names_the_rung_that_would(tiny_store, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    cfg = write_config(
        tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", engine={"dtype": "bfloat16"}
    )
    rungs = plan_ladder(load_config(cfg), Store.open(tiny_store).arch)
    need = {r: p.host_total + p.device_total for r, p in rungs.items()}
    between = (need["exact"] + need["lean"]) // 2
    assert need["lean"] < between < need["exact"]
    monkeypatch.setattr(preflight, "host_available", lambda: (between, "test limit"))
    r = horizon("train", cfg)
    assert r.exit_code == 2 and "does not fit" in r.output and "largest rung that fits: lean" in r.output
    assert "optim.memory: lean" in r.output and not (tmp_path / "run").exists()


def test_a_4bit_store_ladder_shows_full_finetuning_as_not_applicable(tmp_path):
    """An NF4 store can only be a QLoRA base: exact, lean and lora (a bf16 base) are shown but not
    applicable, never 'fits' nor the largest rung that fits, in the table and in --json."""
    from tests.support.oracle import make_store

    _, store = make_store(tmp_path / "q", "llama", dtype="bfloat16", quantize="nf4")
    data = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [3, 4, 5, 6, 7, 8]}] * 8)  # no tokenizer
    cfg = write_config(tmp_path / "c.yaml", store.root, data, tmp_path / "run", lora={"r": 4})
    out = tmp_path / "plan.json"
    r = horizon("train", cfg, "--dry-run", "--json", out, "--host-gib", 64, "--device-gib", 80)
    assert r.exit_code == 0, r.output
    rows = [ln.split() for ln in r.output.splitlines() if ln.startswith("│")]
    ladder_rows = [" ".join(w) for w in rows if w[1] in ("exact", "lean", "lora")]
    assert len(ladder_rows) == 3 and all("n/a" in ln for ln in ladder_rows), r.output
    plan = json.loads(out.read_text())
    assert plan["memory"] == "qlora" and plan["applicable"] and plan["fits"]
    for rung in ("exact", "lean", "lora"):
        p = plan["ladder"][rung]
        assert p["applicable"] is False and p["fits"] is False and "4-bit" in p["not_applicable"]
        assert p["host_fits"] and p["device_fits"]  # the plan itself would fit this machine
    assert plan["ladder"]["qlora"]["applicable"] and "not_applicable" not in plan["ladder"]["qlora"]
    assert plan["largest_rung_that_fits"] == "qlora"


def test_dry_run_on_a_lone_config_json_with_chat_data_names_the_directory(planned):
    """data.format auto finds chat, which needs a tokenizer: the error says the config.json's
    directory has none (it is not a store)."""
    tmp, over = planned
    cfg = ROOT / "configs" / "mistral-large-123b-sft.yaml"
    # a machine it fits (a start checks the fit before the data, and so does a dry run)
    r = horizon("train", cfg, *over, "data.format=auto", "--dry-run", "--host-gib", 4096, "--device-gib", 192)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    msg = errors[0]
    assert f"model.path: {tmp / 'ml'} holds a config.json but no tokenizer files" in msg
    assert "and format 'chat' needs a tokenizer" in msg and "store" not in msg
