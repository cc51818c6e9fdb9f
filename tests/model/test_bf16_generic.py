"""The generic path in bf16 (the default compute dtype) on models whose transformers code is
dtype-sensitive: a causal-mask buffer built in the default dtype (OpenAI GPT), sinusoidal positions
(XGLM), a residual stream kept in fp32 and cast before the final norm (Zaya), Mamba's mixer.
benchmarks/investigations/census_bf16.py found each crashing in bf16 (every fp32 census row was exact). Oracle:
transformers' own model of the same checkpoint in bf16 (`from_pretrained(dtype=bfloat16)`): the
logits of a micro-batch agree to bf16 rounding, and a training step runs with a finite loss."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.convert import convert
from horizon_cli.engine import Engine
from horizon_cli.store import Store
from tests.support.census_horizon import tiny
from tests.support.oracle import micro_batches, one_thread, random_rows, rel_err  # noqa: F401 (autouse fixture)


@pytest.mark.parametrize("mt,layers", [("openai-gpt", 2), ("xglm", 2), ("zaya", 2), ("mamba", 2)])
def test_bf16_generic_matches_transformers_in_bf16(tmp_path, mt, layers):
    model, _ = tiny(mt, layers)
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="bfloat16")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    ecfg = EngineConfig(device="cpu", dtype="bfloat16", loss_chunk=16)
    eng = Engine(Store.open(tmp_path / "store"), ecfg, OptimConfig(kernel="torch"))
    try:
        vocab = model.get_output_embeddings().weight.shape[0]
        rows = random_rows(4, vocab, seed=1, lo=10, hi=12)
        mbs = micro_batches(rows, 2)
        ours = eng.logits(mbs[0]).float()
        with torch.no_grad():
            want = ref(input_ids=mbs[0].input_ids).logits.float()
        for r, (ids, _) in enumerate(rows[:2]):
            assert rel_err(ours[r, : len(ids)], want[r, : len(ids)]) < 3e-2, mt
        res = eng.step(mbs, 1e-3)
        eng.wait()
        assert math.isfinite(res.loss) and not res.skipped, mt
    finally:
        eng.close()
