"""A reward model from real weights (issue 43 item 3): SmolLM2-135M-Instruct's decoder with a seeded
one-label score head, saved as LlamaForSequenceClassification, converted to a bf16 store, and its
scores of 12 chat completions by horizon's streamed reward model (fp32 compute on the CPU) against
TRL 1.16's reward-model path on the same weights (the decoder's bf16 upcast to fp32, the head as the
checkpoint stores it, fp32: the store carries it so).

    make smollm2                                   # the model, offline (scripts/smollm2.py)
    python -m benchmarks.investigations.reward_model_smollm2 [--hf .cache/smollm2/hf]

Prints both score lists, the largest difference and each side's seconds (bench_out/reward_model.json).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import transformers

from horizon_cli.config.schema import DataConfig, EngineConfig
from horizon_cli.convert import convert
from horizon_cli.engine.ranks import OneProcess
from horizon_cli.recipes.grpo.reward_model import RewardModel, batch_scores
from tests.rl.test_reward_model import trl_scores

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write the number thirty-one in digits."}],
    [{"role": "user", "content": "Say hi."}],
]
COMPLETIONS = [
    [{"role": "assistant", "content": "Paris."}],
    [{"role": "assistant", "content": "31"}],
    [{"role": "assistant", "content": "I like turtles, and I will not say it."}],
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", default=".cache/smollm2/hf", help="SmolLM2-135M-Instruct's HF directory")
    ap.add_argument("--json", default="bench_out/reward_model.json")
    a = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        lm = transformers.AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32)
        cfg = lm.config
        cfg.num_labels, cfg.architectures = 1, ["LlamaForSequenceClassification"]
        rm = transformers.LlamaForSequenceClassification(cfg)
        rm.model.load_state_dict(lm.model.state_dict())
        torch.manual_seed(0)
        rm.score.weight.data.normal_(0, 0.05)
        rm.save_pretrained(out / "hf")
        tok = transformers.AutoTokenizer.from_pretrained(a.hf)
        tok.save_pretrained(out / "hf")
        convert(out / "hf", out / "store", dtype="bfloat16")
        model = RewardModel(str(out / "store"), "rl.rewards[0]", DataConfig())
        model.open(EngineConfig(device="cpu", dtype="float32"), None)
        t0 = time.perf_counter()
        got = batch_scores(model, OneProcess(), PROMPTS * 4, COMPLETIONS * 4, None, 4)
        horizon_s = time.perf_counter() - t0
        model.close()
        ref = transformers.LlamaForSequenceClassification.from_pretrained(
            out / "hf", dtype=torch.bfloat16
        ).float()
        ref.score.weight.data.copy_(rm.score.weight.data)  # the head as stored (fp32), not narrowed
        ref.save_pretrained(out / "ref")
        tok.save_pretrained(out / "ref")
        t0 = time.perf_counter()
        want = trl_scores(out / "ref", PROMPTS * 4, COMPLETIONS * 4)
        trl_s = time.perf_counter() - t0
    result = {
        "horizon": got.tolist(),
        "trl": want.tolist(),
        "max_abs_diff": float((got - want).abs().max()),
        "horizon_s": horizon_s,
        "trl_s_with_load": trl_s,
    }
    print(json.dumps(result, indent=1))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
