"""Peer (c) in GRPO mode: TRL's GRPOTrainer itself under DeepSpeed ZeRO-3 with CPU offload, on the
CPU (DS_ACCELERATOR=cpu, a world of one gloo process), as a TRL user would run full-parameter GRPO
that does not fit one device (benchmarks/bench_grpo_peer.py runs it).

    <peer venv>/bin/python benchmarks/trl_grpo_peer.py JOB.json

- GRPOConfig(deepspeed=<the SFT peer's ZeRO-3 config (benchmarks/ds_peer.py) + an AdamW
  `optimizer` block>): transformers builds the engine and, from that block with offload_optimizer
  on the CPU, DeepSpeedCPUAdam. The model is loaded after GRPOConfig exists, so HfDeepSpeedConfig
  is alive and from_pretrained partitions it as it loads (zero.Init).
- Rollouts: TRL's default path, transformers `generate` on the model unwrapped for generation
  (`ds3_gather_for_generation: True`, TRL's default: the stage-3 parameters gathered whole for
  the generation), `use_vllm: False` (the default). beta 0 (TRL's default: no reference model),
  loss_type dapo (the default), temperature 1, no top-k / top-p.
- The prompts are random token ids, given as text of word-level tokens `t<id>` separated by
  spaces, which the benchmark's tokenizer (one word per id, no special tokens added) turns back
  into exactly those ids: the same prompt ids horizon reads from `prompt_input_ids`.
- The reward is benchmarks/grpo_reward.py's `even_share`, the same function horizon calls.
- Timing: each optimizer step (a callback), and inside it TRL's `_generate_and_score_completions`
  (rollout + rewards + advantages) and its `_generate_single_turn` (the generation alone).
"""

from __future__ import annotations

import time

from common import RssSampler, peer_main, rss
from ds_dpo import step_recorder
from ds_peer import ds_config, one_process_env
from grpo_reward import even_share


def word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", bos_token="t1")


def run(job: dict) -> dict:
    one_process_env()
    import deepspeed
    import torch
    import trl
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    o, n = job["optim"], job["prompts"] * job["G"]  # completions a step
    cfg = {
        **ds_config({**job, "batch": n}),
        "optimizer": {"type": "AdamW", "params": {"lr": o["lr"], "betas": o["betas"], "eps": o["eps"],
                                                  "weight_decay": o["weight_decay"]}},
    }  # fmt: skip
    bf16 = job["dtype"] == "bfloat16"
    args = GRPOConfig(
        output_dir=str(job["work"]) + f"/{job['tag']}-trl", per_device_train_batch_size=job["micro"],
        gradient_accumulation_steps=n // job["micro"], max_steps=job["steps"], learning_rate=o["lr"],
        adam_beta1=o["betas"][0], adam_beta2=o["betas"][1], adam_epsilon=o["eps"],
        weight_decay=o["weight_decay"], max_grad_norm=o["grad_clip"], lr_scheduler_type="constant",
        warmup_steps=0, bf16=bf16, use_cpu=True, gradient_checkpointing=True, deepspeed=cfg,
        logging_steps=1, save_strategy="no", report_to="none", num_generations=job["G"],
        max_completion_length=job["new"], beta=0.0, loss_type="dapo", temperature=1.0,
        shuffle_dataset=False, dataloader_num_workers=0, seed=job.get("seed", 0), disable_tqdm=True,
    )  # fmt: skip
    model = LlamaForCausalLM.from_pretrained(
        job["hf_dir"], dtype=torch.bfloat16 if bf16 else torch.float32, attn_implementation="sdpa"
    )  # under zero.Init: args made the HfDeepSpeedConfig
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    data = Dataset.from_list([{"prompt": " ".join(f"t{i}" for i in p)} for p in job["prompt_ids"]])
    timing: dict[str, list[float]] = {"generate_and_score_s": [], "generate_s": []}

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, *a, **k):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **k)
            timing["generate_and_score_s"].append(time.perf_counter() - t0)
            return out

        def _generate_single_turn(self, *a, **k):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*a, **k)
            timing["generate_s"].append(time.perf_counter() - t0)
            return out

    trainer = Timed(
        model=model, reward_funcs=[even_share], args=args, train_dataset=data,
        processing_class=word_tokenizer(job["vocab"]),
    )  # fmt: skip
    records, times = [], []

    trainer.add_callback(step_recorder(records, times))
    rss_setup = rss()
    with RssSampler() as s:
        trainer.train()
    engine = trainer.model_wrapped
    inner = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    return {
        "losses": [r["loss"] for r in records],
        "rewards": [r.get("reward") for r in records],
        "mean_length": [r.get("completions/mean_length") for r in records],
        "step_s": times,
        **timing,
        "rss_train_peak": s.peak,
        "rss_setup": rss_setup,
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
        "notes": f"TRL {trl.__version__} GRPOTrainer (dapo, beta 0, transformers generate, "
        f"ds3_gather_for_generation {args.ds3_gather_for_generation}), ZeRO-3 offload param+optimizer, "
        f"optimizer {type(inner).__name__}, deepspeed {deepspeed.__version__}",
    }


if __name__ == "__main__":
    peer_main(run)
