"""Every shipped config loads, begins with the command that runs it, and (for the 70B one) fits
the machine it was written for according to the memory plan."""

from pathlib import Path

import pytest

from horizon_cli.arch import spec_from_hf
from horizon_cli.config import load_config
from horizon_cli.errors import InputError
from horizon_cli.planning.ladder import plan_for

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))

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
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "llama70b-sft.yaml")
    plan = plan_for(cfg, spec_from_hf(LLAMA_31_70B), "exact")  # what `horizon train --dry-run` plans
    assert 70e9 < plan.params < 71e9
    assert plan.host_total < 1.5e12 * 0.8  # leave the OS and page cache a fifth
    assert plan.device_total < 141e9 * 0.5
    assert plan.bytes_per_param < 14.1


# Real sizes (config.json as released; gpt-oss-120b without its MXFP4 quantization_config, i.e. the
# bf16 weights) -> (shipped config, host RAM of the machine it names, parameters, active per token)
GENERIC_CONFIGS = {
    "qwen3-30b-a3b": ("qwen3-30b-a3b-sft.yaml", 768e9, 30.5e9, 3.3e9),
    "gpt-oss-120b": ("gpt-oss-120b-sft.yaml", 3e12, 116.8e9, 5.7e9),
    "gemma-3-27b": ("gemma-3-27b-sft.yaml", 768e9, 27.0e9, 27.0e9),
}


@pytest.mark.parametrize("model", sorted(GENERIC_CONFIGS))
def test_generic_config_fits_its_machine(model):
    """The MoE / generic configs: the memory plan (generic layers, every expert of a layer in its
    streamed buffer) fits one H200 and the host RAM the config names, with a fifth to spare."""
    import json

    from horizon_cli.arch.names import param_split

    name, ram, params, active = GENERIC_CONFIGS[model]
    hf = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / f"{model}.config.json").read_text())
    spec = spec_from_hf(hf)
    assert spec.path == "generic"
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
    plan = plan_for(cfg, spec, "exact")
    split = param_split(spec)
    assert abs(plan.params - params) / params < 0.01
    assert abs(split["active"] - active) / active < 0.05
    assert plan.host_total < ram * 0.8
    assert plan.device_total < 141e9 * 0.8
    assert plan.bytes_per_param < 14.2


def test_llama70b_grpo_plans_its_rollouts_on_paper():
    """The GRPO config's plan (rl/plan.py, what its dry run prints): it fits like SFT of the same
    tokens, and its rollout on paper is what the config's header says (link-bound, the KV cache of
    128 completions on the device)."""
    from horizon_cli.recipes.grpo.plan import rollout_plan

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "llama70b-grpo.yaml")
    spec = spec_from_hf(LLAMA_31_70B)
    plan = plan_for(cfg, spec, "exact")
    assert plan.host_total < 1.5e12 * 0.85 and plan.device_total < 141e9 * 0.5  # 1.21 TB: 0.29 TB left
    assert cfg.rl is not None and cfg.rl.beta == 0  # dapo, no reference: beta > 0 needs its room (below)
    roll = rollout_plan(cfg, None, spec, cfg.engine.dtype, "", 141 * 2**30 - plan.device_total)
    assert roll is not None and roll["rows"] == 128 and roll["sweeps"] == 1024
    assert 129 * 2**30 < roll["sweep_bytes"] < 130 * 2**30  # bf16 weights, one sweep
    assert roll["kv_bytes"] == 50 * 2**30 and roll["kv_where"] == "device"
    assert 2700 < roll["streamed_s"] < 2900  # streamed: link-bound
    assert (roll["engine"], roll["weights"]) == ("resident", "nf4") and roll["rollout_s"] <= 120
    # beta > 0: the reference's bf16 copy on the host and its weight buffers on the device (a
    # forward-only engine's, for the run) leave the copy and the cache short of room at 16 prompts
    ref = load_config(
        Path(__file__).resolve().parents[2] / "configs" / "llama70b-grpo.yaml", ["rl.beta=0.04"]
    )
    with_ref = plan_for(ref, spec, "exact")
    assert with_ref.host_total - plan.host_total == with_ref.host["reference (streaming copy)"] > 130 * 2**30
    assert 5 * 2**30 < with_ref.device["reference (weight buffers)"] < 6 * 2**30
    with pytest.raises(InputError, match="need more than 9/10 of the device"):
        rollout_plan(ref, None, spec, ref.engine.dtype, "", 141 * 2**30 - with_ref.device_total)
    fewer = load_config(Path(__file__).resolve().parents[2] / "configs" / "llama70b-grpo.yaml",
                        ["rl.beta=0.04", "train.batch_size=14"])  # fmt: skip
    roll14 = rollout_plan(
        fewer, None, spec, fewer.engine.dtype, "", 141 * 2**30 - plan_for(fewer, spec, "exact").device_total
    )
    assert roll14 is not None and roll14["engine"] == "resident"  # the header's "14 prompts fit then"
    assert 80 < roll14["rollout_s"] < 82 and 200 < roll14["step_s"] < 204


def test_llama70b_grpo_tools_plans_its_rollouts_on_paper():
    """The tool-calling GRPO config: its tool file loads (rl.tools), it fits, and its rollout on
    paper is what its header says (tool results fed within max_completion_length's sweeps)."""
    from horizon_cli.recipes.grpo.plan import rollout_plan
    from horizon_cli.recipes.grpo.tools import load_toolbox

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "llama70b-grpo-tools.yaml")
    assert cfg.rl is not None
    cfg.rl.tools = [str(root / t) for t in cfg.rl.tools]
    box = load_toolbox(cfg.rl)
    assert box is not None and [f.__name__ for f in box.tools()] == ["calculator"]
    assert box.functions[0](expression="(12 + 7) * 3") == "57"
    spec = spec_from_hf(LLAMA_31_70B)
    plan = plan_for(cfg, spec, "exact")
    assert plan.host_total < 1.5e12 * 0.85 and plan.device_total < 141e9 * 0.5
    roll = rollout_plan(cfg, None, spec, cfg.engine.dtype, "", 141 * 2**30 - plan.device_total)
    assert roll is not None and roll["rows"] == 96 and roll["sweeps"] == 1280
    assert roll["kv_bytes"] == 45 * 2**30 and roll["kv_where"] == "device"
    assert 3500 < roll["streamed_s"] < 3600  # streamed: link-bound
    assert (roll["engine"], roll["weights"]) == ("resident", "nf4") and roll["rollout_s"] <= 120
