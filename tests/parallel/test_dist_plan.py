"""The memory plan of a sharded run: per rank 1/N of the state, per node the ranks it holds,
`--dry-run --world-size N` (and torchrun's environment) showing it, a batch that does not split
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from horizon_cli.arch import spec_from_hf
from horizon_cli.config import load_config
from horizon_cli.errors import InputError
from horizon_cli.parallel.topology import World, world_for
from horizon_cli.planning.ladder import fit_parts, plan_ladder
from horizon_cli.preflight import given_machine
from tests.conftest import chat_rows, horizon, write_config, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PER_BATCH = ("saved activations", "staging")


@pytest.fixture(scope="module")
def mistral():
    cfg = load_config(
        ROOT / "configs" / "mistral-large-123b-sft.yaml", ["train.batch_size=96", "train.micro_batch_size=1"]
    )
    return cfg, spec_from_hf(json.loads((FIXTURES / "mistral-large-2407.config.json").read_text()))


@pytest.mark.parametrize("world", [2, 3, 8, 32])
def test_a_rank_holds_one_nth_of_the_state(mistral, world):
    cfg, spec = mistral
    one, many = plan_ladder(cfg, spec), plan_ladder(cfg, spec, world=World(world, min(world, 8)))
    for rung in ("exact", "lean", "qlora"):
        a, b = one[rung], many[rung]
        assert b.world == world and b.host.keys() == a.host.keys()
        for key, v in a.host.items():
            if key in PER_BATCH:  # a rank's share of the batch (96 sequences split evenly)
                assert b.host[key] == v // world, (rung, key)
            elif key.startswith("adapter"):  # replicated: every rank trains its own copy
                assert b.host[key] == v, (rung, key)
            elif not key.startswith("1-D"):  # (norms sit together: one rank may hold them all)
                assert b.host[key] == pytest.approx(v / world, rel=0.05), (rung, key)
        if rung != "qlora":  # (qlora: the replicated adapters' state is not divided)
            assert b.state_bytes == pytest.approx(a.state_bytes / world, rel=0.05), rung
            assert b.bytes_per_param == pytest.approx(a.bytes_per_param, rel=0.05), rung
        # the device all-gathers whole layers: the buffers of one rank equal one GPU's
        assert b.device["weight buffers"] == a.device["weight buffers"], rung
        assert b.node_host_total == b.host_total * b.per_node
        assert b.all_host_total == b.host_total * world


def test_one_rank_is_todays_plan(mistral):
    cfg, spec = mistral
    a, b = plan_ladder(cfg, spec)["exact"], plan_ladder(cfg, spec, world=World(1, 1))["exact"]
    assert (a.host, a.device) == (b.host, b.device) and a.node_host_total == a.host_total
    assert not any("reduce-scatter" in k for k in a.device)


def test_fits_compares_a_node_with_the_machine(mistral):
    """Exact does not fit one 1.5 TB node; on two nodes of 8 each node holds half of it."""
    cfg, spec = mistral
    machine = given_machine(1.5e12 / 2**30, 141e9 / 2**30)
    assert fit_parts(plan_ladder(cfg, spec)["exact"], machine) == (False, False, True)
    assert fit_parts(plan_ladder(cfg, spec, world=World(8, 8))["exact"], machine) == (False, False, True)
    assert fit_parts(plan_ladder(cfg, spec, world=World(16, 8))["exact"], machine) == (True, True, True)


def test_world_from_flags_and_torchrun():
    assert world_for(None, None, {}) == World(1, 1)
    assert world_for(4, None, {}) == World(4, 4)
    assert world_for(16, 8, {"WORLD_SIZE": "2"}).nodes == 2  # the flags win
    assert world_for(None, None, {"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3"}) == World(6, 3)
    assert world_for(None, None, {"WORLD_SIZE": "6"}) == World(6, 6)
    for args, what in [
        ((6, 4), "--nproc-per-node"),
        ((0, None), "--world-size"),
        ((None, 2), "--nproc-per-node"),
    ]:
        with pytest.raises(InputError, match=what):
            world_for(*args, {})
    with pytest.raises(InputError, match="WORLD_SIZE"):
        world_for(None, None, {"WORLD_SIZE": "two"})
    with pytest.raises(InputError, match="LOCAL_WORLD_SIZE"):
        world_for(None, None, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3"})


@pytest.fixture
def tiny_cfg(tiny_store, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    return write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run"), tmp_path


def dry_json(cfg: Path, out: Path, *args) -> dict:
    r = horizon("train", cfg, "--dry-run", "--json", out, *args)
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def test_dry_run_world_size_reports_ranks_and_nodes(tiny_cfg):
    cfg, tmp = tiny_cfg  # batch 4, micro-batch 2
    one = dry_json(cfg, tmp / "1.json")
    two = dry_json(cfg, tmp / "2.json", "--world-size", 2)
    assert (one["world_size"], one["nodes"]) == (1, 1) and one["host_bytes_per_node"] == one["host_bytes"]
    assert (two["world_size"], two["nproc_per_node"], two["nodes"]) == (2, 2, 1)
    assert (
        two["host_bytes_per_rank"] == two["host_bytes"]
        and two["device_bytes_per_rank"] == two["device_bytes"]
    )
    assert two["host_bytes_per_node"] == 2 * two["host_bytes"] == two["host_bytes_all_nodes"]
    for key, v in one["host"].items():
        assert two["host"][key] == pytest.approx(v / 2, rel=0.05), key
    assert two["ladder"]["lean"]["host_bytes_per_node"] == 2 * two["ladder"]["lean"]["host_bytes"]
    four = dry_json(cfg, tmp / "4.json", "train.micro_batch_size=1", "--world-size", 4, "--nproc-per-node", 2)
    assert (four["nodes"], four["host_bytes_per_node"]) == (2, 2 * four["host_bytes"])
    assert not (tmp / "run").exists()


def test_dry_run_under_torchrun_plans_its_world(tiny_cfg, monkeypatch):
    cfg, tmp = tiny_cfg
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    plan = dry_json(cfg, tmp / "env.json", "train.micro_batch_size=1")
    assert (plan["world_size"], plan["nproc_per_node"], plan["nodes"]) == (4, 2, 2)
    monkeypatch.setenv("RANK", "1")  # the other ranks check and stay quiet: rank 0 reports
    r = horizon("train", cfg, "train.micro_batch_size=1", "--dry-run", "--json", tmp / "rank1.json")
    assert r.exit_code == 0 and "memory plan" not in r.output and not (tmp / "rank1.json").exists()


def test_a_batch_that_does_not_split_is_refused(tiny_cfg):
    cfg, tmp = tiny_cfg  # batch 4 = 2 micro-batches of 2: not one each on 4 ranks
    r = horizon("train", cfg, "--dry-run", "--world-size", 4)
    assert (
        r.exit_code == 2
        and r.output.startswith("error: train.batch_size: 4 ")
        and "multiple of 8" in r.output
    )
    assert len(r.output.strip().splitlines()) == 1


def test_world_size_needs_a_dry_run(tiny_cfg):
    cfg, tmp = tiny_cfg
    for flags in (["--world-size", 2], ["--world-size", 2, "--nproc-per-node", 1]):
        r = horizon("train", cfg, *flags)
        assert r.exit_code == 2 and "add --dry-run" in r.output and "torchrun" in r.output, r.output
    assert not (tmp / "run").exists()
    r = horizon("train", cfg, "--dry-run", "--world-size", 4, "--nproc-per-node", 3)
    assert r.exit_code == 2 and "error: --nproc-per-node: 3 ranks per node" in r.output
