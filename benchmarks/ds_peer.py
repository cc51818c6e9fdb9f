"""Peer (c): DeepSpeed ZeRO-3, parameters and optimizer offloaded to the CPU, DeepSpeedCPUAdam.

A world of one process (gloo, DS_ACCELERATOR=cpu). bf16 uses DeepSpeed's `bf16` config (bf16
parameters and compute, fp32 master weights in the offloaded optimizer); fp32 runs with neither
bf16 nor fp16 enabled. The HF model gets the same activation checkpointing as peer (b), and is
built under zero.Init (HfDeepSpeedConfig) so it is partitioned as it loads, as HF documents for
ZeRO-3. DeepSpeed scales the loss by 1 / gradient accumulation steps; with micro = batch there is
one micro-batch and the HF mean loss is the token-level mean. job['preference'] 'dpo': TRL's
DPOTrainer on the same ZeRO-3 config, policy and a stage-3 reference (benchmarks/ds_dpo.py).
"""

from __future__ import annotations

import os
import socket

from common import peer_main, read_rows, rss, step_batches, timed_steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process_env() -> None:
    """DeepSpeed on the CPU as one process (its launcher's variables, unless already set)."""
    for k, v in dict(
        DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
        LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", CROSS_RANK="0", CROSS_SIZE="1",
    ).items():  # fmt: skip
        os.environ.setdefault(k, v)


def ds_config(job: dict) -> dict:
    o = job["optim"]
    off = {"device": "cpu", "pin_memory": False}
    return {
        "train_batch_size": job["batch"],
        "train_micro_batch_size_per_gpu": job["micro"],
        "gradient_accumulation_steps": job["batch"] // job["micro"],
        "gradient_clipping": o["grad_clip"],
        "zero_optimization": {
            "stage": 3,
            "offload_param": off,
            "offload_optimizer": off,
            **job.get("zero", {}),
        },
        "bf16": {"enabled": job["dtype"] == "bfloat16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": False,
    }


def run(job: dict) -> dict:
    one_process_env()
    if job.get("preference"):  # TRL's DPOTrainer on this config (benchmarks/ds_dpo.py)
        from ds_dpo import run_dpo

        return run_dpo(job, ds_config(job))
    import deepspeed
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = ds_config(job)
    keep = HfDeepSpeedConfig(cfg)  # noqa: F841 - must stay alive: from_pretrained uses zero.Init
    dtype = torch.bfloat16 if job["dtype"] == "bfloat16" else torch.float32
    model = LlamaForCausalLM.from_pretrained(job["hf_dir"], dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    model.train()
    o = job["optim"]
    opt = DeepSpeedCPUAdam(
        model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
        weight_decay=o["weight_decay"], adamw_mode=True,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    rss_setup = rss()

    def step(mbs: list) -> tuple[float, float]:
        total = 0.0
        for ids in mbs:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            total += float(loss.detach()) / len(mbs)
        engine.step()
        norm = engine.get_global_grad_norm()
        return total, float(norm) if norm is not None else float("nan")

    rows = read_rows(job["data"])
    batches = step_batches(rows, job["steps"], job["batch"], job["micro"])
    res = timed_steps(step, batches)
    res.update(params=n_params, micro_batch=job["micro"], rss_setup=rss_setup)
    res["notes"] = f"ZeRO-3 offload param+optimizer, DeepSpeedCPUAdam, deepspeed {deepspeed.__version__}"
    return res


if __name__ == "__main__":
    peer_main(run)
