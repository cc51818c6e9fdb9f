"""Oracles for the engine: a store built from a tiny HF model, random batches, and a resident
reference run (the HF model + torch.optim.AdamW) under DESIGN.md's loss semantics."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.convert import convert
from horizon_cli.data.batch import IGNORE, MicroBatch
from horizon_cli.engine import Engine
from horizon_cli.runtime.trace import Tracer
from horizon_cli.store import Store
from tests.support.tiny import make_model, save


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and far faster than on two when other work shares
    the cores (thread contention). Autouse in every module that imports it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_store(tmp: Path, family="llama", tie=False, dtype="float32", quantize="", **over):
    model = make_model(family, tie=tie, **over)
    save(model, tmp / "hf")
    convert(tmp / "hf", tmp / "store", dtype=dtype, quantize=quantize)
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


def real_tokens(mb: MicroBatch) -> torch.Tensor:
    """(b, T) 1 for real tokens, 0 for right padding."""
    T = mb.input_ids.shape[1]
    if mb.lengths is None:
        return torch.ones_like(mb.input_ids)
    return (torch.arange(T)[None, :] < mb.lengths[:, None]).long()


def hf_loss_backward(model, mbs: list[MicroBatch]) -> float:
    """DESIGN.md semantics: summed CE over every label token of the global batch / their count.

    With the config's auxiliary loss on (MoE, output_router_logits), the objective adds
    coef * transformers' own load_balancing_loss_func over the router logits of the *whole* global
    batch (every micro-batch's real tokens, padding masked), as docs/architectures.md defines it."""
    n = sum(mb.label_tokens for mb in mbs)
    aux = bool(getattr(model.config, "output_router_logits", False))
    total, objective, routers, masks = 0.0, 0.0, [], []
    for mb in mbs:
        mask = (mb.input_ids != -1).long()  # right padding sits after every real token (causal)
        out = model(input_ids=mb.input_ids, attention_mask=mask, output_router_logits=aux)
        loss = label_ce_sum(out.logits, mb.labels)
        if aux:
            routers.append(out.router_logits)
            masks.append(real_tokens(mb).reshape(-1))
            objective = objective + loss / n
        else:
            (loss / n).backward()
        total += loss.item()
    if aux:
        lb = sys.modules[type(model).__module__].load_balancing_loss_func
        per_layer = tuple(torch.cat(ls) for ls in zip(*routers, strict=True))
        value = lb(per_layer, model.num_experts, model.num_experts_per_tok, torch.cat(masks))
        (objective + model.router_aux_loss_coef * value).backward()
    return total / n


def label_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the labelled positions (logits taken in fp32)."""
    logits = logits.float()
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


def hf_batch_loss(model, mbs: list[MicroBatch], inputs=None, backward: bool = True) -> float:
    """Summed CE over the global batch's label tokens / their count, each micro-batch's share
    backpropagated (backward). inputs(mb): the model's keyword arguments (default: input_ids only)."""
    n = sum(mb.label_tokens for mb in mbs)
    total = 0.0
    for mb in mbs:
        kw = inputs(mb) if inputs is not None else {"input_ids": mb.input_ids}
        loss = label_ce_sum(model(**kw).logits, mb.labels)
        if backward:
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


def hf_train_hp(model, batches: list[list[MicroBatch]], hp: dict) -> list[float]:
    """hf_train with a run's optimizer settings, as OptimConfig names them (lr, betas, eps,
    weight_decay, grad_clip)."""
    return hf_train(model, batches, lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                    wd=hp["weight_decay"], clip=hp["grad_clip"])  # fmt: skip


def engine_weights(engine: Engine) -> dict[str, torch.Tensor]:
    """transformers' in-memory name -> fp32 master tensor held by the engine (frozen buffers too)."""
    out = {}
    for st in engine.host.units.values():
        views = st.views(st.master())
        for p in st.layout.tensors:
            out[p.hf] = views[p.name].clone()
    return out


def engine_grads(engine: Engine) -> dict[str, torch.Tensor]:
    """transformers' in-memory name -> the step's gradient (trainable tensors)."""
    out = {}
    for st in engine.host.units.values():
        views = st.views(st.dense_grad())
        out.update({p.hf: views[p.name] for p in st.layout.tensors if p.trainable})
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def check_grads(eng: Engine, model, tol: float = 1e-5) -> None:
    """Every trainable tensor's gradient against the HF model's .grad, and no name missing."""
    hf = dict(model.named_parameters())
    grads = engine_grads(eng)
    assert set(grads) == set(hf), set(grads) ^ set(hf)
    for name, g in grads.items():
        assert rel_err(g, hf[name].grad) < tol, name


def check_step_against_hf(eng: Engine, model, tol: float = 1e-5) -> None:
    """One fp32 step of 4 random rows in 2 micro-batches: the padded micro-batch's logits (real
    positions), the mean loss, the squared gradient norm and every gradient against transformers."""
    rows = random_rows(4, model.config.vocab_size, seed=1, lo=10, hi=24)
    mbs = micro_batches(rows, 2)
    ours = eng.logits(mbs[0])
    ref = model(input_ids=mbs[0].input_ids).logits.detach()
    for r, (ids, _) in enumerate(rows[:2]):
        assert rel_err(ours[r, : len(ids)], ref[r, : len(ids)]) < tol
    loss_sum, tokens, sq = eng.forward_backward(mbs)
    eng.t.synchronize()
    model.zero_grad()
    ref_loss = hf_loss_backward(model, mbs)
    assert abs(loss_sum / tokens - ref_loss) / ref_loss < tol
    ref_sq = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
    assert abs(sq - ref_sq) / ref_sq < tol
    check_grads(eng, model, tol)


class StartSignal(Tracer):
    """Sets `started` when the compute span `name` begins for the `nth` time (tests that hold one
    thread until another reaches a point); `enabled` also records the spans."""

    def __init__(self, name: str, nth: int, enabled: bool = False):
        super().__init__(enabled=enabled)
        self.name, self.nth, self.seen, self.started = name, nth, 0, threading.Event()

    @contextlib.contextmanager
    def span(self, lane, name, **args):
        if lane == "compute" and name == self.name:
            self.seen += 1
            if self.seen == self.nth:
                self.started.set()
        with super().span(lane, name, **args):
            yield
