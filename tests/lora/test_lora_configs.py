"""The shipped LoRA configs: their memory plans for Llama-3.1-70B (bf16 and NF4 bases) fit the
machines they name, at the host bytes per parameter LoRA promises (~2 bf16, ~0.6 NF4)."""

from pathlib import Path

import pytest

from horizon_cli.arch import spec_from_hf
from horizon_cli.config import load_config
from horizon_cli.lora.setup import lora_setup
from horizon_cli.planning.ladder import plan_for
from horizon_cli.planning.memory import memory_plan
from tests.config.test_configs import LLAMA_31_70B

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    "name,quant,ram,bpp",
    [("llama70b-lora.yaml", "", 256e9, (2.0, 2.1)), ("llama70b-qlora.yaml", "nf4", 64e9, (0.55, 0.65))],
)
def test_llama70b_lora_plans_fit_a_24_gb_gpu(name, quant, ram, bpp):
    cfg = load_config(CONFIGS / name)
    spec = spec_from_hf(LLAMA_31_70B)
    setup = lora_setup(cfg.lora, spec)
    e, t = cfg.engine, cfg.train
    plan = plan_for(cfg, spec, "qlora" if quant else "lora", setup)  # what `horizon train --dry-run` plans
    assert 70e9 < plan.params < 71e9
    assert bpp[0] < plan.bytes_per_param < bpp[1]
    assert plan.host_total < ram * 0.85
    assert plan.device_total < 24e9 * 0.6
    assert sum(map(len, setup.targets)) == 7 * 80  # every linear layer of every decoder layer
    full = memory_plan(spec, e.dtype, e.grad_dtype, t.batch_size, t.micro_batch_size, cfg.data.max_seq_len)
    assert plan.state_bytes < full.state_bytes / 6  # against 14 B/param for full fine-tuning
