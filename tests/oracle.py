"""Oracles for the engine: a store built from a tiny HF model, random batches, and a resident
reference run (the HF model + torch.optim.AdamW) under DESIGN.md's loss semantics."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_models import make_model, save

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.convert import convert
from horizon_cli.data.batch import IGNORE, MicroBatch
from horizon_cli.engine.schedule import Engine
from horizon_cli.store import Store


def make_store(tmp: Path, family="llama", tie=False, dtype="float32", **over):
    model = make_model(family, tie=tie, **over)
    save(model, tmp / "hf")
    convert(tmp / "hf", tmp / "store", dtype=dtype)
    return model, Store.open(tmp / "store")


# scripts/gpu_check.sh runs the same oracles on a GPU with HORIZON_TEST_DEVICE=cuda
DEVICE = os.environ.get("HORIZON_TEST_DEVICE", "cpu")


def make_engine(store, dtype="float32", **optim) -> Engine:
    return Engine(
        store, EngineConfig(device=DEVICE, dtype=dtype, loss_chunk=16), OptimConfig(kernel="torch", **optim)
    )


def random_rows(n: int, vocab: int, seed: int = 0, lo: int = 6, hi: int = 24, prompt: int = 3):
    """n rows of random length with the first `prompt` labels masked (as a prompt would be)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        L = int(torch.randint(lo, hi, (1,), generator=g))
        ids = torch.randint(0, vocab, (L,), generator=g).tolist()
        labels = [IGNORE] * prompt + ids[prompt:]
        rows.append((ids, labels))
    return rows


def micro_batches(rows, micro: int, pad_id: int = 0) -> list[MicroBatch]:
    return [MicroBatch.from_rows(rows[i : i + micro], pad_id) for i in range(0, len(rows), micro)]


def hf_loss_backward(model, mbs: list[MicroBatch]) -> float:
    """DESIGN.md semantics: summed CE over every label token of the global batch / their count."""
    n = sum(mb.label_tokens for mb in mbs)
    total = 0.0
    for mb in mbs:
        mask = (mb.input_ids != -1).long()  # right padding sits after every real token (causal)
        logits = model(input_ids=mb.input_ids, attention_mask=mask).logits.float()
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            mb.labels[:, 1:].reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        (loss / n).backward()
        total += loss.item()
    return total / n


def hf_train(model, batches: list[list[MicroBatch]], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, wd=0.0, clip=1.0):
    """Resident reference: returns the loss of every step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    losses = []
    for mbs in batches:
        opt.zero_grad(set_to_none=True)
        losses.append(hf_loss_backward(model, mbs))
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
    return losses


def engine_weights(engine: Engine) -> dict[str, torch.Tensor]:
    """HF name -> fp32 master weight held by the engine."""
    out = {}
    for st in engine.host.units.values():
        views = st.views(st.master())
        for s in st.layout.slots:
            out[s.hf] = views[s.name].clone()
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
