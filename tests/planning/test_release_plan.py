"""Gradient release in the plan (issue 39): a release rung's host gradients are RELEASE_CHUNKS
chunk buffers (of at most RELEASE_CHUNK elements, fewer when every unit is smaller) plus the
embedding's fp32 gradient; a rank of several holds RELEASE_BUFFERS buffers of its largest slice; the ladder shows
exact+release and lean+release; `optim.grad_release: auto` turns release on exactly when the run
does not fit without it and fits with it, says so, and the run's config records what it chose."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from horizon_cli import preflight
from horizon_cli.arch import spec_from_hf
from horizon_cli.config import load_config
from horizon_cli.optim.modes import RELEASE_CHUNK
from horizon_cli.parallel.shard import SHARD_ALIGN, shard_size
from horizon_cli.planning.ladder import fit_parts, plan_ladder
from horizon_cli.planning.memory import RUNGS, memory_plan
from horizon_cli.preflight import given_machine
from horizon_cli.train.compat import changes
from tests.conftest import horizon, store_with_tokenizer, write_config, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
H200_1500 = (1500, 141)  # GiB: issue 39's machine
# a 12-layer Llama with an untied head, small enough that its layers outweigh its head
SMALL = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=1000,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def hand_count(c: dict) -> tuple[int, int, int]:
    """(one decoder layer, the head with its final norm, the embedding), counted by hand."""
    H, mlp, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = H // c["num_attention_heads"] * c["num_key_value_heads"]
    layer = 2 * H * H + 2 * H * kv + 3 * H * mlp + 2 * H  # q, o; k, v; gate, up, down; two norms
    return layer, V * H + H, V * H


def grads(plan) -> int:
    (key,) = [k for k in plan.host if k.startswith("gradients")]
    return plan.host[key]


@pytest.mark.parametrize(
    "rung, dtype, item",
    [("exact+release", "bfloat16", 2), ("exact+release", "float32", 4), ("lean+release", "float32", 2)],
)
def test_release_holds_three_chunks_and_the_embedding(rung, dtype, item):
    spec = spec_from_hf(SMALL)
    layer, head, embed = hand_count(SMALL)
    L = SMALL["num_hidden_layers"]
    rel, base = memory_plan(spec, dtype, memory=rung), memory_plan(spec, dtype, memory=rung.split("+")[0])
    assert rel.params == L * layer + head + embed
    assert RELEASE_CHUNK > layer > head and grads(rel) == 3 * layer * item + embed * 4  # chunks: a layer
    assert grads(base) == (L * layer + head) * item + embed * 4
    # a step of fewer tokens than the vocabulary: the untied table's gradient holds its rows only
    short = memory_plan(spec, dtype, memory=rung, batch=2, seq=128)
    assert grads(short) == 3 * layer * item + 2 * 128 * SMALL["hidden_size"] * 4
    assert "3 released chunks" in next(k for k in rel.host if k.startswith("gradients"))
    # everything else is the base mode's: same state layout, same device
    others = {k: v for k, v in rel.host.items() if not k.startswith("gradients")}
    assert others == {k: v for k, v in base.host.items() if not k.startswith("gradients")}
    assert rel.device == base.device
    saved = (grads(base) - grads(rel)) / rel.params
    assert rel.bytes_per_param == pytest.approx(base.bytes_per_param - saved)


def test_a_rank_releases_its_piece():
    spec = spec_from_hf(SMALL)
    layer, head, embed = hand_count(SMALL)
    rel = memory_plan(spec, "bfloat16", memory="exact+release", world=2)
    assert grads(rel) == 3 * shard_size(layer, 2, SHARD_ALIGN) * 2 + shard_size(embed, 2, SHARD_ALIGN) * 4


def test_model_scale_bytes_per_param_on_the_seeds_machine():
    """Mistral-Large-Instruct-2407 in exact with release, Qwen3-235B-A22B in lean with release,
    on one H200 and 1,500 GiB at 8 x 2048 tokens a step (the shipped configs)."""
    machine = given_machine(*H200_1500)
    ml = json.loads((FIXTURES / "mistral-large-2407.config.json").read_text())
    cfg = load_config(ROOT / "configs" / "mistral-large-123b-sft.yaml")
    assert cfg.train.batch_size * cfg.data.max_seq_len == 8 * 2048
    rungs = plan_ladder(cfg, spec_from_hf(ml), where=machine)
    layer, head, embed = hand_count(ml)
    p = rungs["exact+release"]
    assert layer > RELEASE_CHUNK  # 64 MiB chunks: 192 MiB of layer gradients whatever the model
    held = min(ml["vocab_size"], 8 * 2048) * ml["hidden_size"]  # the untied table's touched rows
    assert p.bytes_per_param == pytest.approx(12 + (3 * RELEASE_CHUNK * 2 + held * 4) / p.params, rel=1e-9)
    assert 12.0 < p.bytes_per_param <= 12.05 and 5.1 < rungs["lean+release"].bytes_per_param <= 5.2
    assert fit_parts(p, machine)[0] and not fit_parts(rungs["exact"], machine)[0]
    qwen = spec_from_hf(json.loads((FIXTURES / "qwen3-235b-a22b.config.json").read_text()))
    cfg = load_config(ROOT / "configs" / "qwen3-235b-a22b-sft.yaml")
    assert (cfg.optim.memory, cfg.optim.grad_release) == ("lean", "true")
    rungs = plan_ladder(cfg, qwen, where=machine)
    assert 234e9 < rungs["lean"].params < 236e9 and rungs["lean+release"].bytes_per_param <= 5.2
    assert fit_parts(rungs["lean+release"], machine)[0] and not fit_parts(rungs["lean"], machine)[0]


@pytest.fixture
def small_dir(tmp_path):
    """A dir holding only SMALL's config.json, token rows, and a config (bf16 on a CUDA device,
    no kept layers: the plans do not depend on the device's room)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(SMALL))
    data = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": list(range(3, 40))}] * 16)
    cfg = write_config(
        tmp_path / "c.yaml", tmp_path / "m", data, tmp_path / "run",
        data={"path": str(data), "format": "tokens", "max_seq_len": 256},
        engine={"device": "cuda", "dtype": "bfloat16", "keep_activations": 0},
    )  # fmt: skip
    return tmp_path, cfg


def host_needs(cfg: Path, *over: str) -> dict[str, float]:
    rungs = plan_ladder(load_config(cfg, list(over)), spec_from_hf(SMALL), where=given_machine(64, 80))
    return {r: p.node_host_total / 2**30 for r, p in rungs.items()}


def dry_run(tmp: Path, cfg: Path, host_gib: float, *over: str):
    out = tmp / "plan.json"
    r = horizon("train", cfg, *over, "--dry-run", "--json", out, "--host-gib", host_gib, "--device-gib", 80)
    return r, json.loads(out.read_text())


def test_auto_releases_exactly_when_the_plan_needs_it(small_dir):
    tmp, cfg = small_dir
    need = host_needs(cfg)
    assert need["exact+release"] < need["exact"]
    between = (need["exact+release"] + need["exact"]) / 2
    r, plan = dry_run(tmp, cfg, between)
    assert r.exit_code == 0, r.output
    assert "optim.grad_release: auto -> true: exact does not fit" in r.output
    assert "exact+release (this run)" in r.output and "lean+release" in r.output  # the ladder's table
    assert plan["memory"] == "exact+release" and plan["fits"]
    assert plan["grad_release"]["value"] == "true" and "exact+release does" in plan["grad_release"]["why"]
    assert list(plan["ladder"]) == list(RUNGS)
    assert [r for r, p in plan["ladder"].items() if p["grad_release"]] == ["exact+release", "lean+release"]
    assert "norm-first" in plan["grad_release"]["clipping"] and "norm-first" in r.output  # grad_clip 1.0
    said = " ".join(r.output.split())  # the plan table counts both passes' loads: 2 x 2 x 12
    assert "0 of 12, 48 layer loads per step (two passes: norm-first)" in said, said
    # room for exact: release stays off
    r, plan = dry_run(tmp, cfg, need["exact"] * 1.01)
    assert r.exit_code == 0 and "optim.grad_release: auto -> false: exact fits without it" in r.output
    assert plan["memory"] == "exact" and plan["grad_release"]["value"] == "false"
    assert plan["grad_release"]["clipping"] == ""
    # no room even with release: off, and the start is refused naming the rung that fits
    r, plan = dry_run(tmp, cfg, need["exact+release"] * 0.999)
    assert r.exit_code == 2 and "auto -> false: exact does not fit with it either" in r.output
    assert plan["memory"] == "exact" and "largest rung that fits: lean" in r.output


def test_release_named_by_the_config_and_clipping(small_dir):
    tmp, cfg = small_dir
    need = host_needs(cfg)
    r, plan = dry_run(tmp, cfg, need["exact"] * 2, "optim.grad_release=true", "optim.grad_clip=0")
    assert r.exit_code == 0 and "auto ->" not in r.output
    assert plan["memory"] == "exact+release" and plan["grad_release"]["why"] == ""
    assert (
        "one pass" in plan["grad_release"]["clipping"] and "bit for bit" in plan["grad_release"]["clipping"]
    )
    # false keeps exact even where only release would fit: refused, naming the release rung
    between = (need["exact+release"] + need["exact"]) / 2
    r, plan = dry_run(tmp, cfg, between, "optim.grad_release=false")
    assert r.exit_code == 2 and plan["memory"] == "exact"
    assert "largest rung that fits: exact+release (optim.memory: exact, optim.grad_release: true)" in r.output


def test_release_composes_with_lora_and_bad_values_are_refused(small_dir):
    tmp, cfg = small_dir
    r, plan = dry_run(tmp, cfg, 64, "optim.grad_release=true", "lora.r=4")
    assert r.exit_code == 0, r.output
    clipping = plan["grad_release"]["clipping"]  # grad_clip 1.0: the adapters' one pass, no norm-first
    assert (
        plan["memory"] == "lora"
        and "gradient release on a lora: run with optim.grad_clip 1 > 0: one pass" in clipping
    )
    assert "0 of 12, 24 layer loads per step" in " ".join(r.output.split()) and "two passes" not in r.output
    r, plan = dry_run(tmp, cfg, 64, "optim.grad_release=true", "lora.r=4", "optim.grad_clip=0")
    assert "the adapters' updates run inside the backward" in plan["grad_release"]["clipping"]
    r, plan = dry_run(tmp, cfg, 64, "lora.r=4")  # auto leaves a LoRA run's small gradients alone
    assert plan["grad_release"]["value"] == "false" and "lora" in plan["grad_release"]["why"]
    r = horizon("train", cfg, "optim.grad_release=maybe", "--dry-run")
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "optim.grad_release" in errors[0], r.output


def test_a_start_records_what_auto_chose(tmp_path, monkeypatch):
    """A real start where only exact+release fits: one line says release went on, and the run's
    config.yaml records optim.grad_release: true."""
    store = store_with_tokenizer(tmp_path / "s", "llama", num_hidden_layers=8, tie_word_embeddings=False)
    data = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": list(range(3, 40))}] * 8)
    cfg = write_config(
        tmp_path / "c.yaml", store, data, tmp_path / "run",
        data={"path": str(data), "format": "tokens", "max_seq_len": 32, "shuffle": False},
        train={"steps": 1, "batch_size": 2, "micro_batch_size": 1, "seed": 1},
        engine={"device": "cpu", "dtype": "float32", "keep_activations": 0},
    )  # fmt: skip
    from horizon_cli.store import Store

    rungs = plan_ladder(load_config(cfg), Store.open(store).arch)
    need = {r: p.host_total + p.device_total for r, p in rungs.items()}
    assert need["exact+release"] < need["exact"]
    between = (need["exact+release"] + need["exact"]) // 2
    monkeypatch.setattr(preflight, "host_available", lambda: (between, "test limit"))
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    assert "optim.grad_release: auto -> true" in r.output
    said = " ".join(r.output.split())  # grad_clip 1.0: each step's two passes counted at the start
    assert "(32 layer loads per step, two passes: norm-first; engine.keep_activations: 0)" in said, said
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["optim"]["grad_release"] == "true"
    shutil.rmtree(tmp_path / "run")
    r = horizon("profile", cfg)  # profiles what train would run: auto decided the same way
    assert r.exit_code == 0, r.output
    assert "optim.grad_release: auto -> true" in r.output
    assert "32 (2 per recomputed layer, 1 per kept layer, in each of 2 passes: norm-first)" in " ".join(
        r.output.split()
    )


def test_a_run_resumes_across_release():
    """Release changes neither the training nor the state files: a checkpoint written with it off
    resumes with it on (auto may resolve otherwise on another machine), and back."""
    off, on = (
        {"optim": {"grad_release": "false", "lr": 1e-5}},
        {"optim": {"grad_release": "true", "lr": 1e-5}},
    )
    assert changes(off, on) == [] and changes(on, off) == []
    assert changes(off, {"optim": {"grad_release": "true", "lr": 2e-5}}) == [("optim.lr", 1e-5, 2e-5)]
