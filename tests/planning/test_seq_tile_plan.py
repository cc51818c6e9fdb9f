"""Sequence tiles in the memory plan (planning.tiling): the layer working set the plan counts
against what one layer's forward + backward really takes on the CPU, tiled and untiled; the tile
`auto` picks; the longest sequence each rung fits; engine.seq_tile's refusals and the dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from horizon_cli.arch import spec_from_hf
from horizon_cli.config import load_config
from horizon_cli.parallel.topology import World
from horizon_cli.planning.fit import Machine
from horizon_cli.planning.ladder import longest_seq, plan_for
from horizon_cli.planning.tiling import STEP, slack
from tests.conftest import horizon, write_config, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
LLAMA_31_8B = dict(
    model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0,
)  # fmt: skip
H200 = Machine(1536 * GIB, 141 * GIB, "one H200 + 1.5 TiB")


def test_the_plan_covers_the_measured_peak_and_tiles_lower_it():
    """A narrow layer with a wide MLP (hidden 128, intermediate 2048) at 2,048 tokens in fp32, in a
    process of its own (tests.support.layer_peak): each run's peak resident memory is within
    the plan's layer working set plus the weight gradients (a plan row of their own), and falls
    with the tile."""
    args = dict(hidden=128, intermediate=2048, tokens=2048, tiles=[0, 1024, 256], warm_tokens=512)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.layer_peak", json.dumps(args)],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    runs = got["runs"]
    for r in runs:
        assert 0 < r["peak_bytes"] <= r["plan_bytes"] + got["weight_grad_bytes"], r
        assert r["peak_bytes"] >= 0.6 * r["plan_bytes"], r  # the plan is not far above it either
    peaks = [r["peak_bytes"] for r in runs]
    assert peaks[0] > peaks[1] > peaks[2], peaks
    assert peaks[2] < 0.4 * peaks[0], peaks


def test_packed_rows_build_no_dense_mask_under_tiles():
    """A row of 4 packed documents at 2,048 tokens: untiled the CPU holds the dense (T, T) mask
    (and SDPA's additive copy), tiled only a query tile's rows of it — the tiled peak within the
    plan and above the unpacked one's (whose causal rows need no mask rows: attend.causal_rows) by
    at most those rows, bool and additive, the untiled one above its unpacked peak by at least T²."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = {}
    for docs in (0, 4):
        args = dict(hidden=128, intermediate=2048, tokens=2048, tiles=[0, 256], warm_tokens=512, docs=docs)
        out = subprocess.run(
            [sys.executable, "-m", "tests.support.layer_peak", json.dumps(args)],
            capture_output=True, text=True, env=env, timeout=300, check=True,
        )  # fmt: skip
        got[docs] = json.loads(out.stdout.strip().splitlines()[-1])
    (plain_untiled, plain_tiled), (packed_untiled, packed_tiled) = got[0]["runs"], got[4]["runs"]
    assert packed_untiled["peak_bytes"] >= plain_untiled["peak_bytes"] + 2048 * 2048, got
    assert packed_tiled["peak_bytes"] <= packed_tiled["plan_bytes"] + got[4]["weight_grad_bytes"], got
    assert packed_tiled["peak_bytes"] <= plain_tiled["peak_bytes"] + 256 * 2048 * (1 + 4), got


def cfg_for(tmp_path: Path, seq: int, tile="auto", micro: int = 1):
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text(json.dumps(LLAMA_31_8B))
    data = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [3, 4, 5]}])
    path = write_config(tmp_path / "c.yaml", tmp_path / "m", data, tmp_path / "run",
                        engine={"dtype": "bfloat16", "seq_tile": tile, "keep_activations": 0})  # fmt: skip
    return load_config(
        path, [f"data.max_seq_len={seq}", f"train.batch_size={micro}", f"train.micro_batch_size={micro}"]
    )


def test_auto_tiles_what_does_not_fit_untiled(tmp_path):
    """Llama-3.1-8B at 131,072 tokens a micro-batch of 4 on one H200: untiled the layer working
    set alone is 128 GiB and the plan does not fit; auto picks the largest tile that does (the
    working set then falls by the MLP's share), and untiled when it fits (8,192 tokens)."""
    spec = spec_from_hf(LLAMA_31_8B)
    untiled = plan_for(cfg_for(tmp_path, 131072, 0, micro=4), spec, "exact", where=H200)
    auto = plan_for(cfg_for(tmp_path, 131072, micro=4), spec, "exact", where=H200)
    assert untiled.seq_tile == 0 and slack(untiled, H200) < 0
    assert auto.seq_tile > 0 and slack(auto, H200) >= 0
    assert auto.untiled_work == untiled.device["layer working set"] == 128 * GIB
    small = plan_for(cfg_for(tmp_path, 131072, 256, micro=4), spec, "exact", where=H200)
    work = [p.device["layer working set"] for p in (untiled, auto, small)]
    assert work[0] > work[1] > work[2] and work[2] < 0.35 * work[0]  # the MLP's 3 I of 6.5 H per token
    bigger = plan_for(cfg_for(tmp_path, 131072, 2 * auto.seq_tile, micro=4), spec, "exact", where=H200)
    assert slack(bigger, H200) < 0  # the largest tile of auto's sizes that fits
    short = plan_for(cfg_for(tmp_path, 8192), spec, "exact", where=H200)
    assert short.seq_tile == 0


def test_longest_sequence_is_the_last_that_fits(tmp_path):
    spec = spec_from_hf(LLAMA_31_8B)
    cfg = cfg_for(tmp_path, 8192)
    path = tmp_path / "c.yaml"
    for rung in ("exact", "lora"):
        n = longest_seq(cfg, spec, rung, None, World(), H200, 1 << 24)
        assert n > spec.max_positions  # memory allows more than the model's positions here

        def plan_at(seq, rung=rung):
            big = spec_from_hf({**LLAMA_31_8B, "max_position_embeddings": 1 << 24})
            c = load_config(
                path, [f"data.max_seq_len={seq}", "train.batch_size=1", "train.micro_batch_size=1"]
            )
            return plan_for(c, big, rung, where=H200)

        assert slack(plan_at(n), H200) >= 0 > slack(plan_at(n + STEP), H200)


@pytest.mark.parametrize("bad", ["-1", "big", "true"])
def test_bad_seq_tile_is_one_line(tmp_path, bad):
    data = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [3, 4, 5]}])
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "m", data, tmp_path / "run")
    r = horizon("train", cfg, f"engine.seq_tile={bad}", "--dry-run")
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "engine.seq_tile" in lines[0], r.output


def test_dry_run_shows_tiles_and_the_longest_sequence(tmp_path):
    cfg = cfg_for(tmp_path, 131072)
    out = tmp_path / "plan.json"
    path = tmp_path / "c.yaml"
    r = horizon("train", path, "data.max_seq_len=131072", "train.batch_size=4", "train.micro_batch_size=4",
                "--dry-run", "--json", out, "--host-gib", 1536, "--device-gib", 141)  # fmt: skip
    assert cfg.engine.seq_tile == "auto" and r.exit_code == 0, r.output
    plan = json.loads(out.read_text())
    assert plan["seq_tile"] > 0 and plan["layer_work_untiled_bytes"] == 128 * GIB
    assert f"tiles of {plan['seq_tile']:,} tokens; untiled it would be" in r.output, r.output
    assert set(plan["longest_seq"]) == {"exact", "exact+release", "lean", "lean+release", "lora", "qlora"}
    assert plan["longest_seq"]["lean"] >= plan["longest_seq"]["exact"] > 131072
    assert "longest trainable sequence on" in r.output
    assert "sequence tiles: every token-local part of every layer" in r.output
    assert "attention per query tile" in r.output


def test_horizon_train_tiles_and_records_the_tile(tiny_store, tmp_path):
    """`horizon train` with engine.seq_tile: 8 trains the losses of an untiled run (within fp32
    rounding) and records the tile in config.yaml; auto records the plan's tile (0: it fits)."""
    import yaml

    from tests.conftest import chat_rows

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
    losses = {}
    for tile in (0, 8, "auto"):
        run = tmp_path / f"run{tile}"
        cfg = write_config(tmp_path / f"c{tile}.yaml", tiny_store, data, run, engine={"device": "cpu",
                           "dtype": "float32", "seq_tile": tile, "keep_activations": 0})  # fmt: skip
        r = horizon("train", cfg, "train.steps=3")
        assert r.exit_code == 0, r.output
        assert yaml.safe_load((run / "config.yaml").read_text())["engine"]["seq_tile"] == (
            0 if tile == "auto" else tile
        )
        losses[tile] = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses[8] == pytest.approx(losses[0], rel=1e-6) and losses["auto"] == losses[0]


@pytest.mark.slow  # a stop and resume under tiles; resume itself stays fast (tests/train/test_train_resume.py)
def test_a_tiled_run_resumes_bitwise(tiny_store, tmp_path):
    """Four tiled steps, then two more resumed from the step-4 checkpoint, train steps 5 and 6 as
    an uninterrupted tiled run does, bit for bit (a constant schedule: train.steps may grow)."""
    from tests.conftest import chat_rows

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
    engine = {"device": "cpu", "dtype": "float32", "seq_tile": 8, "keep_activations": 0}
    sections = dict(engine=engine, schedule={"kind": "constant", "warmup_steps": 0})
    whole = write_config(tmp_path / "a.yaml", tiny_store, data, tmp_path / "a", **sections)
    part = write_config(tmp_path / "b.yaml", tiny_store, data, tmp_path / "b", **sections)
    assert horizon("train", whole).exit_code == 0
    assert horizon("train", part, "train.steps=4").exit_code == 0
    r = horizon("train", part)
    assert r.exit_code == 0, r.output

    def metrics(run):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {m["step"]: (m["loss"], m["grad_norm"]) for m in rows}

    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [a[s] for s in (5, 6)] == [b[s] for s in (5, 6)]


@pytest.mark.parametrize("rung", ["exact", "lora"])
def test_a_kept_layer_is_planned_as_the_tiled_layer_saves_it(tmp_path, rung):
    """Llama-3.1-8B at 65,536 tokens in tiles of 4,096: a kept layer's graph is the tiled layer's
    (the MLP's intermediates not saved whole: planning.memory.kept_graph_bytes), below the
    untiled one's by the MLP's 4 I less 3 H a token; its weights unchanged."""
    spec = spec_from_hf(LLAMA_31_8B)
    whole = plan_for(cfg_for(tmp_path, 65536, 0), spec, rung, where=H200)
    tiled = plan_for(cfg_for(tmp_path, 65536, 4096), spec, rung, where=H200)
    assert tiled.seq_tile == 4096 and whole.seq_tile == 0
    assert tiled.kept_layer[0] == whole.kept_layer[0]
    cut = 65536 * (4 * spec.intermediate - 3 * spec.hidden) * 2  # bf16
    assert whole.kept_layer[1] - tiled.kept_layer[1] == cut
