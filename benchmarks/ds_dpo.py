"""Peer (c) in DPO mode (job['preference'] == 'dpo'): TRL's DPOTrainer itself under DeepSpeed ZeRO-3
with CPU offload, on the CPU (DS_ACCELERATOR=cpu, a world of one gloo process), as a TRL user would
run full-parameter DPO that does not fit one device:

- DPOConfig(deepspeed=<the SFT peer's ZeRO-3 config + an AdamW `optimizer` block>): transformers
  builds the policy's engine and, from that block with offload_optimizer on the CPU,
  DeepSpeedCPUAdam. Both models are loaded after DPOConfig exists, so HfDeepSpeedConfig is alive and
  from_pretrained partitions them as they load (zero.Init).
- The reference is a second copy of the checkpoint passed as `ref_model`; DPOTrainer prepares it
  with trl's prepare_deepspeed (the same stage-3 config without optimizer, eval mode) and runs it
  under no_grad each step. TRL would load the same copy itself (create_model_from_path) when
  ref_model is None, but the scale study's random checkpoints carry no `architectures` field.
- loss_type sigmoid, beta 0.1 (horizon's default), DPOTrainer's own _compute_loss: log-probs summed
  over the completion, TRL's fused head (no full logits), its metrics.
- The data: rows 2k, 2k+1 of the job are one pair (benchmarks/bench_scale.py --preference writes the
  second with the first's prompt half), given to DPOTrainer already tokenized in the columns its
  own _prepare_dataset produces (prompt_ids, chosen_ids, rejected_ids): the override skips only
  the string tokenisation (and the EOS it appends to string completions). One pair per step
  (per_device_train_batch_size 1, job batch 2 = two sequences), sequential sampler: the same
  sequences, labels and order as the horizon peer's `--preference dpo --batch 2`.
"""

from __future__ import annotations

import time

from common import RssSampler, read_rows, rss


def pair_records(rows: list[list[int]], steps: int, pairs_per_step: int) -> list[dict]:
    """Rows 2k (chosen) and 2k+1 (rejected) as TRL's tokenized pair columns; the prompt is the
    first half of the chosen row, which the rejected row must share."""
    n = steps * pairs_per_step
    recs = []
    for k in range(n):
        c, r = rows[(2 * k) % len(rows)], rows[(2 * k + 1) % len(rows)]
        half = len(c) // 2
        if c[:half] != r[:half]:
            raise ValueError(f"pair {k}: rows {2 * k} and {2 * k + 1} do not share a prompt half")
        recs.append({"prompt_ids": c[:half], "chosen_ids": c[half:], "rejected_ids": r[half:]})
    return recs


def step_recorder(records: list, times: list):
    """A TrainerCallback that appends each step's wall time to `times` and each logged step's
    record (those with a loss: logging_steps 1; the summary has train_loss) to `records`."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                records.append(dict(logs))

    return Record()


def run_dpo(job: dict, cfg: dict) -> dict:
    import deepspeed
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    if job["batch"] % 2 or job["micro"] != job["batch"]:
        raise ValueError("DPO peer: batch counts sequences (2 per pair) and micro must equal batch")
    o = job["optim"]
    cfg = {
        **cfg,
        "train_batch_size": job["batch"] // 2,
        "train_micro_batch_size_per_gpu": job["batch"] // 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": o["lr"], "betas": o["betas"], "eps": o["eps"],
                                                  "weight_decay": o["weight_decay"]}},
    }  # fmt: skip
    bf16 = job["dtype"] == "bfloat16"
    args = DPOConfig(
        output_dir=str(job["work"]) + f"/{job['tag']}-trl", per_device_train_batch_size=job["batch"] // 2,
        gradient_accumulation_steps=1, max_steps=job["steps"], learning_rate=o["lr"],
        adam_beta1=o["betas"][0], adam_beta2=o["betas"][1], adam_epsilon=o["eps"],
        weight_decay=o["weight_decay"], max_grad_norm=o["grad_clip"], lr_scheduler_type="constant",
        warmup_steps=0, bf16=bf16, use_cpu=True, gradient_checkpointing=True, deepspeed=cfg,
        logging_steps=1, save_strategy="no", report_to="none", beta=0.1, loss_type="sigmoid",
        max_length=None, train_sampling_strategy="sequential", dataloader_num_workers=0,
        seed=job.get("seed", 0), disable_tqdm=True,
    )  # fmt: skip
    dtype = torch.bfloat16 if bf16 else torch.float32

    def load():  # under zero.Init: args made the HfDeepSpeedConfig
        m = LlamaForCausalLM.from_pretrained(job["hf_dir"], dtype=dtype, attn_implementation="sdpa")
        m.config.use_cache = False
        return m

    model, ref = load(), load()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"t0": 0}, unk_token="t0")), pad_token="t0"
    )  # only its pad id is used: the pairs come tokenized, of equal length (no padding)
    data = Dataset.from_list(pair_records(read_rows(job["data"]), job["steps"], job["batch"] // 2))

    class Pretokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    trainer = Pretokenized(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tok)
    records, times = [], []

    trainer.add_callback(step_recorder(records, times))
    rss_setup = rss()
    with RssSampler() as s:
        trainer.train()
    engine = trainer.model_wrapped
    inner = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    return {
        "losses": [r["loss"] for r in records],
        "grad_norms": [r.get("grad_norm", float("nan")) for r in records],
        "rewards_margin": [r.get("rewards/margins") for r in records],
        "logps_chosen": [r.get("logps/chosen") for r in records],
        "step_s": times,
        "tokens": [job["batch"] * len(read_rows(job["data"])[0])] * len(times),
        "rss_train_peak": s.peak,
        "rss_setup": rss_setup,
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
        "micro_batch": job["micro"],
        "notes": f"TRL {__import__('trl').__version__} DPOTrainer (sigmoid, beta 0.1), ZeRO-3 offload "
        f"param+optimizer, policy optimizer {type(inner).__name__}, reference "
        f"{type(trainer.ref_model).__name__} (stage 3, no optimizer), deepspeed {deepspeed.__version__}",
    }
