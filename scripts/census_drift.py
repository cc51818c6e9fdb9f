"""How far transformers drifts from itself on a census model: is a mismatch horizon's, or the tiny
model's conditioning?

The census (tests/census_horizon.py) compares horizon, which runs each step in 2 micro-batches,
with transformers on the whole batch at once. This runs transformers + torch.optim.AdamW both ways
on the census's own tiny model, data and hyperparameters (fp32, 3 steps) and prints the census's
figures between the two runs: a model whose fp32 summation order alone moves them past the
census's 1e-5 cannot come out exact, whatever horizon does.

    PYTHONPATH=$PWD python scripts/census_drift.py gemma4_text 7
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests")]


def train(model, data, micro: bool) -> list[float]:
    """3 AdamW steps as the census's reference, the batch whole or in 2 micro-batches of 2 rows
    (every row has the same number of labelled tokens: the mean is the micro-batches' mean)."""
    from census_horizon import HP, STEPS

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=HP["lr"], betas=tuple(HP["betas"]), eps=HP["eps"], weight_decay=0.0)
    norms = []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ids, labels = data.step(s)
        parts = [(ids[a : a + 2], labels[a : a + 2], 0.5) for a in (0, 2)] if micro else [(ids, labels, 1.0)]
        for x, y, w in parts:
            (model(input_ids=x, labels=y).loss * w).backward()
        norms.append(float(sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None) ** 0.5))
        opt.step()
    return norms


def main() -> None:
    from census_config import build, text_config, tiny_config
    from census_horizon import Data, perturb, rel_err

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("type")
    ap.add_argument("layers", type=int, nargs="?", default=None)
    a = ap.parse_args()
    cfg = tiny_config(a.type, a.layers)
    torch.manual_seed(0)
    whole = build(a.type, cfg).float()
    perturb(whole)
    emb = whole.get_input_embeddings()
    vocab = getattr(text_config(cfg), "vocab_size", None) or 128
    data = Data(min(vocab, emb.num_embeddings) if isinstance(emb, torch.nn.Embedding) else vocab)
    split = copy.deepcopy(whole)
    n1, n2 = train(whole, data, False), train(split, data, True)
    w = split.state_dict()
    worst = max((rel_err(w[k], v), k) for k, v in whole.state_dict().items() if v.is_floating_point())
    whole.eval()
    split.eval()
    ids, _ = data.probe()
    with torch.no_grad():
        logits = rel_err(split(input_ids=ids).logits, whole(input_ids=ids).logits)
    print(f"{a.type}: transformers in 2 micro-batches against itself on the whole batch, 3 steps:")
    print(f"  grad_norm_err {max(abs(x - y) / y for x, y in zip(n2, n1, strict=True)):.2e}")
    print(f"  weight_err    {worst[0]:.2e} {worst[1]}")
    print(f"  logits_err    {logits:.2e}")


if __name__ == "__main__":
    main()
