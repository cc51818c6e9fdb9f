"""`horizon train configs/llama70b-grpo.yaml --dry-run` as a user runs it before converting the model
or fetching the prompts: a model dir with only Llama-3.1-70B's config.json, no prompts file, the
machine the config names (--host-gib 1536 --device-gib 141). It plans like the SFT 70B config's dry
run does in the same spot (the resolved config, the plan, the ladder, the fit) and adds the
rollout's plan, then ends as that one does: the start's own line for the missing data, exit 2, the
--json plan written all the same. The rollout's KV cache (50 GiB for 128 x 1,280 positions) is
planned on the device: the kept layers' graphs, which fill the device during a step, are gone
between steps, when the rollout runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.config.test_configs import LLAMA_31_70B
from tests.conftest import horizon
from tests.train.test_train_cli import one_error_line

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("llama70b")
    cfg = {**LLAMA_31_70B, "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
           "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def dry_run(name: str, model_dir: Path, tmp: Path):
    out = tmp / f"{name}.json"
    r = horizon(
        "train", CONFIGS / f"{name}.yaml", f"model.path={model_dir}", f"data.path={tmp / 'absent.jsonl'}",
        f"output.dir={tmp / 'run'}", "--dry-run", "--host-gib", "1536", "--device-gib", "141", "--json", out,
    )  # fmt: skip
    return r, json.loads(out.read_text())


def test_the_grpo_dry_run_plans_without_the_prompts_as_the_sft_one_does(model_dir, tmp_path):
    for name in ("llama70b-sft", "llama70b-grpo"):
        r, plan = dry_run(name, model_dir, tmp_path)
        assert r.exit_code == 2
        assert one_error_line(r) == f"error: data.path: {tmp_path / 'absent.jsonl'} not found"
        said = " ".join(r.output.split())
        assert "fits: host needs" in said and said.index("fits:") < said.index("error: data.path")
        assert plan["fits"] and 70e9 < plan["params"] < 71e9
        if name == "llama70b-grpo":
            roll = plan["rollouts"]
            assert roll["rows"] == 128 and roll["kv_bytes"] == 50 * 2**30
            assert plan["kept_bytes"] > 0  # the step's kept layers fill what the cache uses later
            assert roll["kv_where"] == "device" and 2700 < roll["streamed_s"] < 2900, roll
            assert (roll["engine"], roll["weights"]) == ("resident", "nf4") and roll["rollout_s"] <= 120, roll
            assert 35 * 2**30 < roll["copy_bytes"] < 38 * 2**30 and roll["step_s"] > roll["train_s"] > 0
            assert "KV cache about 50.00 GiB" in said and "on the device" in said
        else:
            assert "rollouts" not in plan
