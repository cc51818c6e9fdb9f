"""Sequence tiles on more of transformers' own layers (issue 30, items 2 and 4; tests/engine/test_seq_tile.py
has the first five families): tiled against untiled — forward, every gradient, three AdamW steps
within 1e-6 (fp32) — for Gemma 3's text layer (norms before and after both attention and MLP, a
sliding window, a rope of its own per layer kind) and two Mamba-style hybrids (Bamba: Mamba-2
mixers beside attention, each with an MLP; Jamba: Mamba mixers beside attention, MoE blocks), whose
scans stay whole (a short convolution and a cache: never token-local) while their MLP / MoE is
tiled. A layer with no token-local child (Mamba) runs untiled, bit for bit, and `horizon inspect`
and `--dry-run` say so. RoPE scaling from config.json (Llama-3.1's llama3 natively, YaRN through
transformers' rotary) at sequences beyond the original positions: tiled = untiled, and the tiled
engine's logits equal transformers'."""

from __future__ import annotations

import pytest
import torch
import transformers

from horizon_cli.arch.tiling import blocks, untiled_kinds
from horizon_cli.convert import convert
from horizon_cli.data.batch import MicroBatch
from horizon_cli.store import Store
from tests.conftest import horizon, write_config, write_jsonl
from tests.engine.test_seq_tile import compare, engine, tiled_count, tiled_runs  # noqa: F401 (tiled_runs: autouse)
from tests.support.oracle import engine_weights, make_store, micro_batches, one_thread, random_rows, rel_err  # noqa: F401

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0)  # fmt: skip
BAMBA = dict(SMALL, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16,
             attn_layer_indices=[1])  # fmt: skip
JAMBA = dict(SMALL, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
             attn_layer_period=2, attn_layer_offset=0, mamba_d_state=8, mamba_expand=2, mamba_dt_rank=4,
             use_mamba_kernels=False, output_router_logits=True)  # fmt: skip


def hf_store(tmp_path, model_type: str, **cfg) -> Store:
    """A tiny model of transformers' own (its init, seed 0), converted to an fp32 store."""
    torch.manual_seed(0)
    c = transformers.AutoConfig.for_model(model_type, **cfg)
    transformers.AutoModelForCausalLM.from_config(c).float().save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    return Store.open(tmp_path / "store")


def test_gemma3_text_tiles_its_mlp_between_its_four_norms(tmp_path):
    _, store = make_store(tmp_path, "gemma3")
    assert set(blocks(store.arch.generic).values()) == {("mlp",)}
    compare(store, 7)


@pytest.mark.parametrize(
    "family,cfg,block",
    [("bamba", BAMBA, "feed_forward"), pytest.param("jamba", JAMBA, "feed_forward", marks=pytest.mark.slow)],
)  # jamba: slow (its Mamba's reference scan runs token by token on the CPU)
def test_mamba_hybrids_tile_their_mlp_and_keep_the_scan_whole(tmp_path, family, cfg, block):
    store = hf_store(tmp_path, family, **cfg)
    found = blocks(store.arch.generic)
    assert len(found) == 2 and set(found.values()) == {(block,)}, found  # the mixer is not among them
    steps = [micro_batches(random_rows(4, 96, seed=s, lo=12, hi=24), 2) for s in range(3)]
    compare(store, 7, steps=steps)


@pytest.fixture(scope="module")
def mamba_store(tmp_path_factory):
    cfg = dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4, pad_token_id=0
    )
    return hf_store(tmp_path_factory.mktemp("mamba"), "mamba", **cfg)


def test_a_layer_without_a_token_local_block_runs_untiled(mamba_store):
    """Mamba's layer holds a norm and its mixer only: nothing is tiled, and engine.seq_tile changes
    nothing (the same model bit for bit after three steps)."""
    assert untiled_kinds(mamba_store.arch.generic)
    steps = [micro_batches(random_rows(4, 96, seed=s, lo=20, hi=40), 2) for s in range(3)]
    out, count = [], tiled_count()
    for t in (0, 7):
        eng = engine(mamba_store, t)
        try:
            for mbs in steps:
                eng.step(mbs, 1e-4)
            eng.wait()
            out.append({k: v.clone() for k, v in engine_weights(eng).items()})
        finally:
            eng.close()
    assert tiled_count() == count, "no block was run tile by tile"
    assert all(torch.equal(out[0][k], out[1][k]) for k in out[0])


def test_inspect_and_dry_run_say_the_layer_runs_untiled(mamba_store, tmp_path):
    said = "nothing in layer kind(s)"
    r = horizon("inspect", mamba_store.root)
    assert r.exit_code == 0 and said in r.output and "untiled: no token-local block found" in r.output, (
        r.output
    )
    data = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": list(range(3, 40))}] * 4)
    cfg = write_config(tmp_path / "c.yaml", mamba_store.root, data, tmp_path / "run",
                       engine={"device": "cpu", "dtype": "float32", "seq_tile": 8})  # fmt: skip
    r = horizon("train", cfg, "--dry-run")
    assert r.exit_code == 0, r.output
    assert f"sequence tiles: {said}" in r.output and "untiled: no token-local block found" in r.output, (
        r.output
    )


LLAMA3 = dict(rope_theta=10000.0, max_position_embeddings=256, head_dim=16, num_attention_heads=2,
              num_key_value_heads=1, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32})  # fmt: skip
YARN = dict(SMALL, head_dim=8, max_position_embeddings=256,
            rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
            rope_theta=10000.0)  # fmt: skip


def long_rows(seed: int) -> list[MicroBatch]:
    """Two rows of 150-200 tokens: far past the 32 original positions, tiles of 16 over both."""
    return micro_batches(random_rows(2, 96, seed=seed, lo=150, hi=200), 2)


@pytest.mark.parametrize("how", ["llama3", "yarn"])
def test_rope_scaling_beyond_the_original_positions(tmp_path, how):
    """llama3 (the native layer: its rope type) and YaRN (not native: transformers' own layer and
    rotary) from config.json: the tiled engine's logits at positions up to 200 equal transformers'
    (1e-5), and tiled training equals untiled (1e-6)."""
    if how == "llama3":
        model, store = make_store(tmp_path, "llama", vocab_size=96, **LLAMA3)
        assert store.arch.generic is None and store.arch.rope["rope_type"] == "llama3"
    else:
        store = hf_store(tmp_path, "llama", **YARN)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
        assert store.arch.generic is not None and model.config.rope_parameters["rope_type"] == "yarn"
    (mb,) = long_rows(9)
    eng, count = engine(store, 16), tiled_count()
    try:
        ours = eng.logits(mb)
    finally:
        eng.close()
    assert tiled_count() > count
    with torch.no_grad():
        ref = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
    n = int(mb.lengths.min()) if mb.lengths is not None else mb.input_ids.shape[1]
    assert n > 150 and rel_err(ours[:, :n], ref[:, :n]) < 1e-5
    compare(store, 16, steps=[long_rows(s) for s in range(3)])


@pytest.mark.slow  # two processes of their own, each importing transformers and warming up
def test_the_plan_covers_a_tiled_moe_layers_measured_peak(tmp_path):
    """A one-layer Qwen3-MoE, narrow with wide experts (hidden 128, 8 experts of 1024, 2 active), one
    engine step on 2,048 tokens in a process of its own (tests.support.layer_peak): untiled
    and tiled by 512, the measured peak within the plan's layer working set plus the layer's weight
    gradients, and falling with the tile. (The plan once left out the MoE block's whole output
    beside its tiles: the tiled peak was above it.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    cfg = dict(vocab_size=64, hidden_size=128, intermediate_size=2048, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
               max_position_embeddings=2048, pad_token_id=0)  # fmt: skip
    store = hf_store(tmp_path, "qwen3_moe", **cfg)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    runs = []
    for tile in (0, 512):
        job = json.dumps({"store": str(store.root), "tokens": 2048, "tile": tile})
        out = subprocess.run([sys.executable, "-m", "tests.support.layer_peak", job], capture_output=True,
                             text=True, env=env, timeout=300, check=True)  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for r in runs:
        assert 0.6 * r["plan_bytes"] <= r["peak_bytes"] <= r["plan_bytes"] + r["weight_grad_bytes"], r
    assert runs[1]["peak_bytes"] < 0.6 * runs[0]["peak_bytes"], runs
