"""Peer (b): transformers, resident, activation checkpointing, torch.optim.AdamW(fused=True).

fp32: fp32 weights and compute. bf16: fp32 master weights with bf16 autocast compute (what the HF
Trainer's `bf16=True` does), so like horizon the optimizer sees fp32 weights. job['pure']
(peer "hf-pure" in bench_peers.py): the model cast to bf16 instead, weights, grads and AdamW moments all
bf16 and no fp32 master (faster and leaner, numerically not the same training). Micro-batch: the
job's (default: the whole batch of 4 in one forward). Loss: summed CE over the global batch /
its label tokens (`num_items_in_batch`), i.e. the token-level mean horizon uses.
"""

from __future__ import annotations

from contextlib import nullcontext

from common import peer_main, read_rows, rss, step_batches, timed_steps


def run(job: dict) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    pure = job.get("pure", False) and job["dtype"] == "bfloat16"
    dtype = torch.bfloat16 if pure else torch.float32
    model = LlamaForCausalLM.from_pretrained(job["hf_dir"], dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    o = job["optim"]
    opt = torch.optim.AdamW(
        params, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"], fused=True
    )
    bf16 = job["dtype"] == "bfloat16" and not pure  # autocast
    rss_setup = rss()

    def step(mbs: list) -> tuple[float, float]:
        n = sum(int(m[:, 1:].numel()) for m in mbs)  # label tokens after the shift (no padding)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids in mbs:
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
            with ctx:
                loss = model(input_ids=ids, labels=ids, num_items_in_batch=n).loss  # sum / n
            loss.backward()
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(params, o["grad_clip"]) if o["grad_clip"] else torch.zeros(())
        opt.step()
        return total, float(norm)

    rows = read_rows(job["data"])
    batches = step_batches(rows, job["steps"], job["batch"], job["micro"])
    res = timed_steps(step, batches)
    res.update(params=sum(p.numel() for p in params), micro_batch=job["micro"], rss_setup=rss_setup)
    res["notes"] = (
        "fp32 master + bf16 autocast" if bf16 else ("bf16 weights + optimizer, no master" if pure else "fp32")
    )
    return res


if __name__ == "__main__":
    peer_main(run)
