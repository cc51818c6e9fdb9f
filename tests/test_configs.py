"""Every shipped config loads, begins with the command that runs it, and (for the 70B one) fits
the machine it was written for according to the memory plan."""

from pathlib import Path

import pytest

from horizon_cli.arch import spec_from_hf
from horizon_cli.config import load_config
from horizon_cli.engine.plan import memory_plan

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))

LLAMA_31_70B = dict(
    model_type="llama",
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)


def test_there_are_shipped_configs():
    names = {p.name for p in CONFIGS}
    assert {"llama70b-sft.yaml", "llama8b-sft.yaml", "demo.yaml"} <= names
    assert any(n.startswith("qwen") for n in names)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_names_its_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# horizon train configs/{path.name}"), first
    load_config(path)


def test_llama70b_fits_one_h200_and_1_5_tb():
    cfg = load_config(Path(__file__).parent.parent / "configs" / "llama70b-sft.yaml")
    e, t = cfg.engine, cfg.train
    plan = memory_plan(
        spec_from_hf(LLAMA_31_70B),
        e.dtype,
        e.grad_dtype,
        batch=t.batch_size,
        micro_batch=t.micro_batch_size,
        seq=cfg.data.max_seq_len,
        prefetch=e.prefetch,
        loss_chunk=e.loss_chunk,
    )
    assert 70e9 < plan.params < 71e9
    assert plan.host_total < 1.5e12 * 0.8  # leave the OS and page cache a fifth
    assert plan.device_total < 141e9 * 0.5
    assert plan.bytes_per_param < 14.1
