"""How much of a census mismatch is transformers' own micro-batching: per type, transformers
against itself (the census oracle's 4 rows at once vs the same 4 rows as 2 micro-batches of 2, the
split horizon's census run uses), and horizon's census run against the micro-batched oracle.

The census (tests/census_horizon.py) compares horizon's 2 x 2 micro-batches with a resident run of
4 rows at once. Where a model's gradients are sums that cancel (hyper-connection biases, Gated
DeltaNet's A_log), fp32 summation order alone moves them by ~1e-5, and Adam's eps-linear range
carries that into the weights. The census's tolerances and data are used unchanged.

    PYTHONPATH=$PWD nice -n 5 python scripts/census_microbatch.py --types deepseek_v4,qwen4_exp_text
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import census_horizon as ch  # noqa: E402
from census_config import build, text_config, tiny_config  # noqa: E402

WHOLE = ch.reference  # the census's own oracle: 4 rows at once


def micro_reference(model, data) -> dict:
    """census_horizon.reference with each step's 4 rows as 2 micro-batches of 2, each loss
    weighted by its share of the label tokens (the step loss is the mean over all of them)."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    hp = ch.HP
    opt = torch.optim.AdamW(params, lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"], weight_decay=0.0)
    losses, norms, g1 = [], [], {}
    for s in range(ch.STEPS):
        opt.zero_grad(set_to_none=True)
        ids, labels = data.step(s)
        n = int((labels[:, 1:] != -100).sum())
        total = 0.0
        for a in range(0, ch.BATCH, ch.MICRO):
            lab = labels[a : a + ch.MICRO]
            k = int((lab[:, 1:] != -100).sum())
            loss = model(input_ids=ids[a : a + ch.MICRO], labels=lab).loss * (k / n)
            loss.backward()
            total += loss.item()
        losses.append(total)
        norms.append(float(sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None) ** 0.5))
        if s == 0:
            g1 = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return {"losses": losses, "norms": norms, "g1": g1}


def self_check(mt: str, layers: int) -> dict:
    """transformers' 4-row run against its 2 x 2 run: step-1 gradients (the census's floor) and the
    weights after the census's 3 steps."""
    cfg = tiny_config(mt, layers)
    torch.manual_seed(0)
    model = build(mt, cfg).float()
    ch.perturb(model)
    vocab = getattr(text_config(cfg), "vocab_size", None) or 128
    emb = model.get_input_embeddings()
    data = ch.Data(min(vocab, emb.num_embeddings) if isinstance(emb, torch.nn.Embedding) else vocab)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ra, rb = WHOLE(a, data), micro_reference(b, data)
    g, gname, _ = ch.compare(rb["g1"], ra["g1"], ch.GRAD_FLOOR)
    want = {k: v for k, v in a.state_dict().items() if v.is_floating_point()}
    w, wname, _ = ch.compare(b.state_dict(), want)
    return {"grad_err": g, "grad_worst": gname, "weight_err": w, "weight_worst": wname}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", required=True)
    ap.add_argument("--census", default=str(HERE.parent / "docs" / "census.json"))
    a = ap.parse_args()
    rows = json.loads(Path(a.census).read_text())
    for mt in a.types.split(","):
        layers = rows[mt]["depth"]["layers"]
        out = {"type": mt, "layers": layers, "transformers_4_vs_2x2": self_check(mt, layers)}
        ch.reference = micro_reference  # the census pipeline, its oracle micro-batched as horizon is
        with tempfile.TemporaryDirectory() as tmp:
            res = ch.run_type(mt, layers, Path(tmp))
        keys = (
            "result",
            "worst",
            "loss_err",
            "grad_norm_err",
            "grad_err",
            "weight_err",
            "logits_err",
            "message",
        )
        out["horizon_vs_2x2"] = {k: res[k] for k in keys if k in res}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
