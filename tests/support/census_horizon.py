"""Census: horizon on one tiny model through its public entry points, against transformers.

Shared by scripts/census.py (the whole mapping, every fact recorded) and tests/census/test_census.py
(the parametrised test over transformers' causal-LM mapping).

save_pretrained -> horizon_cli.convert.convert (fp32 store) -> `horizon train` (3 AdamW steps,
4 rows a step in 2 micro-batches, clipping off, a checkpoint every step) -> horizon_cli.export.export
-> AutoModelForCausalLM.from_pretrained, against two oracles: the same model trained resident with
torch.optim.AdamW on the same batches, its loss the one transformers computes from `labels`,
(1) each batch in the same 2 micro-batches as horizon, each micro-batch's loss weighted by its
share of the batch's label tokens and the gradients accumulated (what transformers' Trainer does
with gradient_accumulation_steps), and (2) each batch at once. Both are exact arithmetic of the
same step; they differ only in fp32's order of summation.

The criterion (`exact`), every figure relative to its tensor's largest element: the three losses
and every step-1 gradient within 1e-5 of oracle (1); what three steps of Adam made of them (the
gradient norms of steps 2-3, the exported weights, the logits) within 1e-5 of oracle (1) or the
two oracles' own measured distance (`*_noise`, per type here), whichever is larger; and every
figure within 1e-5 plus that distance of oracle (2). Why not 1e-5 of oracle (2), nor always 1e-5
after 3 steps: Adam divides by sqrt(v) + eps, so a gradient element near eps that is a sum of
larger terms (|g| ~ 1e-5 of its tensor's largest) turns its fp32 rounding into a weight difference
up to 1e-3 of lr; the two oracles' weights differ by 1.2e-5 to 3.2e-5 after 3 steps in EXAONE 4,
EXAONE-MoE, ModernBERT-decoder and Doge, where horizon is within 3e-9 to 1.5e-7 of oracle (1) (and
of oracle (2) within 1e-7, bitwise for three of them, when it trains
each batch as one micro-batch); in models whose tiny census config is badly conditioned
(hyper-connection biases initialised at zero, Gemma 4's unscaled q.k) the two oracles' step-1
gradients and logits differ too, and Gemma 4's tiny model multiplies a 1e-7 difference of its
step-1 gradients about 50-fold a step (transformers against itself: step-1..3 gradients 9e-7,
1.7e-5, 1.2e-4 apart; horizon against oracle (1): 1.4e-7, 7.9e-6, 2.7e-5). A bug in the optimizer
(shared by every type) shows on the well-conditioned types, where the distance is ~1e-6.
A wrong scale or a lost term in the gradients or the update moves the weights by far more than
1e-5 from oracle (1) (tests/census/test_census_criterion.py: each such mutant comes out `mismatch`).

Step-1 gradients come from the step-1 checkpoint's first moment: with clipping off,
m1 = (1 - beta1) * g1, so g1 = m1 / (1 - beta1) to an ulp. The checkpoint's store with its unit
files replaced by g1 is exported (checksums off: the bytes are no longer the weights) and loaded by
transformers, which maps every tensor back to its in-memory name (fused experts included).
"""

from __future__ import annotations

import copy
import json
import shutil
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

# Adam normalises each gradient element: one near zero that is a sum of larger terms (fp32 order
# of summation differs between the two runs) moves its weight by up to ~lr either way. eps 1e-6
# keeps those elements in Adam's linear range (|g| << eps: step ~ lr g / eps) and leaves the
# others normalised; with eps 1e-8 a 6-layer Gemma 3 differed from the full-batch oracle by 8e-5
# after 3 steps, all its gradients within 5e-7 (the criterion: the module docstring)
HP: dict[str, Any] = dict(
    lr=3e-4, betas=[0.9, 0.95], eps=1e-6, weight_decay=0.0, grad_clip=0.0, kernel="torch"
)
STEPS, BATCH, MICRO = 3, 4, 2
TOL = 1e-5
GRAD_FLOOR = 1e-4  # a gradient below 1e-4 of the largest is compared against that (compare)


T = 24  # sequence length: longer than the tiny sliding windows / chunks (8)


class Data:
    """Fixed random rows: 4 a step, the first 3 labels masked (a prompt), plus a probe batch."""

    def __init__(self, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        hi = max(vocab - 8, 8)
        self.ids = torch.randint(3, hi, (16, T), generator=g)

    def labels(self, ids: torch.Tensor) -> torch.Tensor:
        lab = ids.clone()
        lab[:, :3] = -100
        return lab

    def step(self, s: int):
        ids = self.ids[4 * s : 4 * s + 4]
        return ids, self.labels(ids)

    def rows(self, n: int):
        return [
            (r.tolist(), lab.tolist()) for r, lab in zip(self.ids[:n], self.labels(self.ids[:n]), strict=True)
        ]

    def probe(self):
        ids = self.ids[12:14]
        return ids, self.labels(ids)


def quiet() -> None:
    """Warnings and transformers' logs off, one thread: a census process prints only its rows."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("torch").setLevel(logging.ERROR)
    torch.set_num_threads(1)


def perturb(model) -> None:
    """Norms, biases and correction biases away from their init, so every variant shows (as the
    tests do: (1 + w) norms, zero-init biases)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias", "sinks", "_bias")) and p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("_bias") and b.is_floating_point():
                b.add_(torch.randn_like(b) * 0.1)


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:600]


def where(e: BaseException) -> str:
    """The innermost frames of a failure (file:line function)."""
    tb = traceback.extract_tb(e.__traceback__)[-3:]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(tb))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def reference(model, data, micro: int = 1) -> dict:
    """Resident transformers + torch.optim.AdamW: loss, gradient norm of every step, step-1 grads.

    micro: each step's batch in that many micro-batches, each one's loss weighted by its share of
    the batch's label tokens and the gradients accumulated (transformers' Trainer with
    gradient_accumulation_steps: the arithmetic horizon's micro-batches do); 1: the batch at once."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=HP["lr"], betas=tuple(HP["betas"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
    )
    losses, norms, g1 = [], [], {}
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ids, labels = data.step(s)
        total, loss_s = int((labels[:, 1:] != -100).sum()), 0.0
        for mi, ml in zip(ids.chunk(micro), labels.chunk(micro), strict=True):
            loss = model(input_ids=mi, labels=ml).loss
            if micro > 1:
                loss = loss * (int((ml[:, 1:] != -100).sum()) / total)
            loss.backward()
            loss_s += loss.item()
        losses.append(loss_s)
        norms.append(float(sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None) ** 0.5))
        if s == 0:
            g1 = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return {"losses": losses, "norms": norms, "g1": g1}


def train_config(tmp: Path, data) -> Path:
    rows = [{"input_ids": ids, "labels": labels} for ids, labels in data.rows(STEPS * BATCH)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "model": {"path": str(tmp / "store")},
        "data": {"path": str(tmp / "data.jsonl"), "format": "tokens", "max_seq_len": 32, "shuffle": False},
        "train": {"steps": STEPS, "batch_size": BATCH, "micro_batch_size": MICRO, "seed": 0},
        "optim": HP,
        "schedule": {"kind": "constant", "warmup_steps": 0},
        "engine": {"device": "cpu", "dtype": "float32", "compute_threads": 1},
        "output": {"dir": str(tmp / "run"), "save_every": 1, "keep_last": STEPS, "export": False},
        "log": {"every": 1, "plot": False},
    }
    path = tmp / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def grads_of_checkpoint(ck: Path, out: Path) -> Path:
    """An HF checkpoint whose tensors are the step's gradients, from the first moment m1."""
    g = out.parent / "grad-store"
    shutil.copytree(ck, g)
    man = json.loads((g / "manifest.json").read_text())
    assert man["dtype"] == "float32", man["dtype"]
    scale = 1.0 - HP["betas"][0]
    for u in man["units"]:
        m = np.fromfile(g / "state" / f"{u['name']}.m.bin", dtype=np.float32)
        buf = np.zeros(u["nbytes"] // 4, dtype=np.float32)
        buf[: m.size] = m / np.float32(scale)
        buf.tofile(g / u["file"])
    from horizon_cli.export import export

    export(g, out, verify=False)
    return out


def load(path: Path, cls=None):
    """The checkpoint at path by `cls` (the oracle's own class: Emu3's text config is not in the
    auto mapping), else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM

    cls = cls or AutoModelForCausalLM
    model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return model.float().eval(), {k: sorted(map(str, v))[:8] for k, v in bad.items()}


def compare(tensors: dict, ref: dict, floor: float = 0.0) -> tuple[float, str, list[str]]:
    """Worst relative error over the tensors, each against its own largest element — or `floor`
    times the largest element of all, when that is larger: a gradient that is zero in exact
    arithmetic (OPT's key bias: softmax ignores it) is fp32 summation noise in both runs."""
    worst, name = 0.0, ""
    missing = sorted(set(ref) - set(tensors))
    top = max((float(b.detach().abs().max()) for b in ref.values() if b.numel()), default=0.0)
    for k, b in ref.items():
        if k in tensors:
            a, bb = tensors[k].detach().double(), b.detach().double()
            if a.shape != bb.shape:
                e = float("inf")
            else:
                scale = max(float(bb.abs().max()) if bb.numel() else 0.0, floor * top)
                diff = float((a - bb).abs().max()) if bb.numel() else 0.0
                e = diff / scale if scale > 0 else diff
            if e > worst:
                worst, name = e, k
    return worst, name, missing


def try_horizon(hf: Path, model_ref, data, trains: bool, tmp: Path) -> dict:
    """hf: the tiny model's save_pretrained dir; model_ref: a copy of it for the oracle run."""
    from horizon_cli.convert import convert
    from horizon_cli.errors import HorizonError

    try:
        convert(hf, tmp / "store", dtype="float32")
    except HorizonError as e:
        return {"result": "refused", "stage": "convert", "message": str(e)}
    except Exception as e:  # noqa: BLE001 (a census row, not a crash)
        return {"result": "failed", "stage": "convert", "message": err(e), "where": where(e)}
    arch = json.loads((tmp / "store" / "manifest.json").read_text())["arch"]
    out = {"path": arch.get("path", "native")}
    if not trains:
        return {**out, "result": "accepted", "message": "transformers cannot train it: no oracle"}
    try:
        return {**out, **train_and_compare(model_ref, data, tmp)}
    except Exception as e:  # noqa: BLE001
        return {**out, "result": "failed", "stage": "compare", "message": err(e), "where": where(e)}


def train_and_compare(model_ref, data, tmp: Path) -> dict:
    from typer.testing import CliRunner

    from horizon_cli.cli import app
    from horizon_cli.export import export

    cfg = train_config(tmp, data)
    r = CliRunner().invoke(app, ["train", str(cfg)])
    if r.exit_code != 0:
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        msg = next((ln for ln in lines if ln.startswith("error:")), (lines or [""])[-1])
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            msg = f"{msg} {err(r.exception)} at {where(r.exception)}"
        return {"result": "refused" if r.exit_code == 2 else "failed", "stage": "train", "message": msg}
    metrics = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    full_model = copy.deepcopy(model_ref)
    full = reference(full_model, data)  # the batch at once
    ref = reference(model_ref, data, BATCH // MICRO)  # the same micro-batches as horizon
    res = {"losses": [m["loss"] for m in metrics], "ref_losses": ref["losses"]}
    norms = [m["grad_norm"] for m in metrics]
    # each figure against the micro-batched oracle (the arithmetic horizon does) and against the
    # full-batch one, whose own distance from the micro-batched one is measured (`*_noise`)
    res["loss_err"], res["loss_err_full"] = (_rel(res["losses"], o["losses"]) for o in (ref, full))
    res["loss_noise"] = _rel(ref["losses"], full["losses"])
    res["grad_norm_err"], res["grad_norm_err_full"] = (_rel(norms, o["norms"]) for o in (ref, full))
    res["grad_norm_noise"] = _rel(ref["norms"], full["norms"])
    gmodel, gbad = load(
        grads_of_checkpoint(tmp / "run" / "checkpoints" / "step_1", tmp / "grads"), type(model_ref)
    )
    got = dict(gmodel.named_parameters())
    res["grad_err"], res["grad_worst"], gmiss = compare(got, ref["g1"], GRAD_FLOOR)
    res["grad_err_full"], res["grad_worst_full"] = compare(got, full["g1"], GRAD_FLOOR)[:2]
    res["grad_noise"] = compare(ref["g1"], full["g1"], GRAD_FLOOR)[0]
    export(tmp / "run", tmp / "export")
    emodel, ebad = load(tmp / "export", type(model_ref))
    want, want_full = (_weights(m) for m in (model_ref, full_model))
    got = emodel.state_dict()
    res["weight_err"], res["weight_worst"], wmiss = compare(got, want)
    res["weight_err_full"], res["weight_worst_full"] = compare(got, want_full)[:2]
    res["weight_noise"] = compare(want, want_full)[0]  # the oracle's own floor: two valid orders
    model_ref.eval()
    full_model.eval()
    ids, _ = data.probe()
    with torch.no_grad():
        logits, ref_logits, full_logits = (m(input_ids=ids).logits for m in (emodel, model_ref, full_model))
    res["logits_err"], res["logits_err_full"] = rel_err(logits, ref_logits), rel_err(logits, full_logits)
    res["logits_noise"] = rel_err(ref_logits, full_logits)
    problems = {k: v for k, v in {"grad_load": gbad, "export_load": ebad}.items() if v}
    if gmiss or wmiss:
        problems["missing"] = (gmiss + wmiss)[:8]
    if problems:
        res["problems"] = problems
    # each figure against its bound: the losses and step-1 gradients 1e-5 of the micro-batched
    # oracle; what three steps of Adam made of them (gradient norms, weights, logits) 1e-5 of it or
    # the two oracles' own measured distance, whichever is larger; the full-batch oracle 1e-5
    # beyond that distance
    figures = ("loss_err", "grad_norm_err", "grad_err", "weight_err", "logits_err")
    noise = {k: res[k.replace("_err", "_noise")] for k in figures}
    bounds = {k: TOL if k in ("loss_err", "grad_err") else max(TOL, noise[k]) for k in figures}
    bounds.update({f"{k}_full": TOL + noise[k] for k in figures})
    over = {k: res[k] / b for k, b in bounds.items()}
    res["result"] = "exact" if max(over.values()) <= 1.0 and not problems else "mismatch"
    k = max(over, key=lambda name: over[name])
    names = {"grad_err": "grad_worst", "grad_err_full": "grad_worst_full", "weight_err": "weight_worst",
             "weight_err_full": "weight_worst_full"}  # fmt: skip
    worst = res.get(names.get(k, ""), "")
    bound = f" (bound {bounds[k]:.2e})" if bounds[k] != TOL else ""
    res["worst"] = f"{k} {res[k]:.2e}{bound} {worst}".strip() + (f" {problems}" if problems else "")
    return res


def _rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def _weights(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if v.is_floating_point()}


def tiny(mt: str, layers: int) -> tuple:
    """The census's tiny fp32 model of one type (census_config, seed 0, perturbed) and its data."""
    from tests.support.census_config import build, text_config, tiny_config

    cfg = tiny_config(mt, layers)
    torch.manual_seed(0)
    model: Any = build(mt, cfg).float()
    perturb(model)
    vocab = getattr(text_config(cfg), "vocab_size", None) or 128
    emb = model.get_input_embeddings()
    return model, Data(min(vocab, emb.num_embeddings) if isinstance(emb, torch.nn.Embedding) else vocab)


def run_type(mt: str, layers: int, tmp: Path) -> dict:
    """One type of the mapping, tiny (census_config), through horizon against transformers: the
    census row's `horizon` entry (result exact / mismatch / refused / failed, with the figures)."""
    model, data = tiny(mt, layers)
    model.save_pretrained(tmp / "hf")
    return try_horizon(tmp / "hf", model, data, True, tmp)
