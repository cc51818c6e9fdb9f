"""Sequence tiles (engine.seq_tile) under torchrun: 2 ranks (gloo, CPU) with tiles train what one
untiled process trains — losses, eval losses, grad norms and the exported weights within fp32
rounding (tiles change only the order in which the tiles' weight gradients are added) — for the
native layer and for a transformers MoE layer (its load-balancing loss from the global batch's
router statistics, the router outputs caught tile by tile). Every rank is checked to have run
tiles. And `--dry-run --world-size 2` plans one rank's layer working set with its tiles."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import horizon, store_with_tokenizer
from tests.parallel.test_dist import FP32, assert_same_run, aux_losses, config, one_rank, torchrun

TILE = 8  # chat rows of ~20-30 tokens, two a micro-batch: every micro-batch runs several tiles


@pytest.fixture(scope="module")
def moe_store(tmp_path_factory):
    return store_with_tokenizer(tmp_path_factory.mktemp("moe"), "qwen3_moe", output_router_logits=True)


@pytest.mark.slow  # torchrun x 2; tiles = untiled stays fast in tests/engine/test_seq_tile.py
def test_two_tiled_ranks_train_what_one_untiled_rank_trains(tiny_store, moe_store, tmp_path):
    eng = {"device": "cpu", "dtype": "float32", "keep_activations": 0}
    cfgs = {}
    for name, store in (("llama", tiny_store), ("moe", moe_store)):
        for tile, where in ((0, "1"), (TILE, "2")):
            n = f"{name}{where}"
            cfgs[n] = config(tmp_path, store, n, **{**FP32, "engine": {**eng, "seq_tile": tile}})
    for n in ("llama1", "moe1"):
        one_rank(cfgs[n])
    r = torchrun(2, tmp_path, cfgs["llama2"], cfgs["moe2"], cli=False, script="dist_tile_train.py")
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(2):
        counts = json.loads((tmp_path / f"tiles{rank}.json").read_text())
        assert counts["llama2"] > 0 and counts["moe2"] > 0, (rank, counts)
    for name in ("llama", "moe"):
        assert (
            yaml.safe_load((tmp_path / f"{name}2" / "config.yaml").read_text())["engine"]["seq_tile"] == TILE
        )
        assert_same_run(tmp_path / f"{name}1", tmp_path / f"{name}2")
    a, b = aux_losses(tmp_path / "moe1"), aux_losses(tmp_path / "moe2")
    assert max(abs(x - y) / x for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)


def test_dry_run_world_size_2_shows_each_ranks_tiles(tmp_path):
    """Llama-3.1-8B at 131,072 tokens, 4 rows per rank's micro-batch, on 2 ranks of one H200 each:
    the rank's layer working set is tiled (auto) and the untiled figure shown beside it, the same
    as one rank's (a rank runs whole layers on its own micro-batches: tiles are per rank)."""
    from tests.planning.test_seq_tile_plan import cfg_for

    cfg_for(tmp_path, 131072)
    plans = {}
    for world in (1, 2):
        out = tmp_path / f"plan{world}.json"
        r = horizon("train", tmp_path / "c.yaml", "data.max_seq_len=131072", f"train.batch_size={4 * world}",
                    "train.micro_batch_size=4", "--dry-run", "--json", out, "--host-gib", 1536,
                    "--device-gib", 141, "--world-size", world)  # fmt: skip
        assert r.exit_code == 0, r.output
        assert "untiled it would be" in r.output, r.output
        plans[world] = json.loads(out.read_text())
    one, two = plans[1], plans[2]
    assert two["seq_tile"] > 0 and two["layer_work_untiled_bytes"] == one["layer_work_untiled_bytes"]
    assert f"tiles of {two['seq_tile']:,} tokens; untiled it would be" in r.output, r.output
    assert two["seq_tile"] >= one["seq_tile"]  # a rank holds half the host state: no less room
