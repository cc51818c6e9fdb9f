"""The census's weight check against transformers' own noise floor, for one type.

    OMP_NUM_THREADS=1 python -m benchmarks.investigations.census_noise TYPE LAYERS [--micro 2] [--f64] [--work DIR]

The tiny model of the census row (tests/support/census_config, tests/support/census_horizon), horizon's 3 steps
(`--micro`: its micro-batch size; 2 is the census's), and transformers + torch.optim.AdamW run
four ways on the same batches: "full" (each batch at once), "accum" (horizon's micro-batches,
gradient accumulation), "threads2" (full, on 2 threads) and, with --f64, "f64" (full, float64).
Prints the weight distance after step 3 between each pair (the census's compare: relative to each
tensor's largest element), the gradient distance at each step (horizon's g_t read back from its
checkpoints: g_t = (m_t - beta1 m_{t-1}) / (1 - beta1)), and, for the worst weight element of
horizon against "full", its gradients at steps 1-3 in both runs (Adam conditioning: |g| ~ eps).
docs/benchmarks.md's census section records what it gave.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

import numpy as np
import torch


def oracle(ch, m0, data, micro: int, threads: int = 1, dtype=torch.float32):
    """(weights after the last step, every step's gradients) of transformers + torch AdamW."""
    torch.set_num_threads(threads)
    model = copy.deepcopy(m0).to(dtype).train()
    params = [p for p in model.parameters() if p.requires_grad]
    hp = ch.HP
    opt = torch.optim.AdamW(params, lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"], weight_decay=0.0)
    grads = []
    for s in range(ch.STEPS):
        opt.zero_grad(set_to_none=True)
        ids, labels = data.step(s)
        total = int((labels[:, 1:] != -100).sum())
        for mi, ml in zip(ids.chunk(micro), labels.chunk(micro), strict=True):
            (model(input_ids=mi, labels=ml).loss * (int((ml[:, 1:] != -100).sum()) / total)).backward()
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None})
        opt.step()
    torch.set_num_threads(1)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}, grads


def horizon_grads(ch, run: Path, work: Path, cls, t: int) -> dict:
    """Step t's gradients from the checkpoints' first moments, loaded by transformers."""
    b1 = ch.HP["betas"][0]
    ck, g = run / "checkpoints" / f"step_{t}", work / f"g{t}-store"
    shutil.rmtree(g, ignore_errors=True)
    shutil.copytree(ck, g)
    for u in json.loads((g / "manifest.json").read_text())["units"]:
        m = np.fromfile(ck / "state" / f"{u['name']}.m.bin", dtype=np.float32).astype(np.float64)
        prev = run / "checkpoints" / f"step_{t - 1}" / "state" / f"{u['name']}.m.bin"
        mp = np.fromfile(prev, dtype=np.float32).astype(np.float64) if t > 1 else 0.0
        buf = np.zeros(u["nbytes"] // 4, dtype=np.float32)
        buf[: m.size] = ((m - b1 * mp) / (1 - b1)).astype(np.float32)
        buf.tofile(g / u["file"])
    from horizon_cli.export import export

    shutil.rmtree(work / f"g{t}", ignore_errors=True)
    export(g, work / f"g{t}", verify=False)
    return dict(ch.load(work / f"g{t}", cls)[0].named_parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("type")
    ap.add_argument("layers", type=int)
    ap.add_argument("--micro", type=int, default=2, help="horizon's micro_batch_size (census: 2)")
    ap.add_argument("--f64", action="store_true", help="also a float64 oracle")
    ap.add_argument("--work", default="/tmp/census-noise")
    args = ap.parse_args()
    from typer.testing import CliRunner

    from horizon_cli.cli import app
    from horizon_cli.convert import convert
    from horizon_cli.export import export
    from tests.support import census_horizon as ch
    from tests.support.census_horizon import quiet

    quiet()
    ch.MICRO = args.micro
    work = Path(args.work) / args.type
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    m0, data = ch.tiny(args.type, args.layers)
    m0.save_pretrained(work / "hf")
    convert(work / "hf", work / "store", dtype="float32")
    r = CliRunner().invoke(app, ["train", str(ch.train_config(work, data))])
    assert r.exit_code == 0, r.output
    export(work / "run", work / "export")
    cls = type(m0)
    hz = {k: v for k, v in ch.load(work / "export", cls)[0].state_dict().items() if v.is_floating_point()}
    hg = [horizon_grads(ch, work / "run", work, cls, t) for t in range(1, ch.STEPS + 1)]
    runs = {"horizon": (hz, hg), "full": oracle(ch, m0, data, 1)}
    runs["accum"] = oracle(ch, m0, data, ch.BATCH // ch.MICRO if ch.MICRO < ch.BATCH else 1)
    runs["threads2"] = oracle(ch, m0, data, 1, threads=2)
    if args.f64:
        try:
            runs["f64"] = oracle(ch, m0, data, 1, dtype=torch.float64)
        except RuntimeError as e:  # grouped_mm (fused experts) has no float64
            print(f"no float64 oracle: {str(e).splitlines()[0]}")
    print(f"{args.type} ({args.layers} layers), horizon micro-batch {ch.MICRO}, eps {ch.HP['eps']}")
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            w, wn = ch.compare(runs[a][0], runs[b][0])[:2]
            gs = [ch.compare(runs[a][1][t], runs[b][1][t], ch.GRAD_FLOOR)[0] for t in range(ch.STEPS)]
            print(
                f"  {a:>8} vs {b:<8} weights {w:.2e} ({wn or '-'})  grads " + " ".join(f"{g:.1e}" for g in gs)
            )
    full = runs["full"][0]
    k = ch.compare(hz, full)[1]
    if k:
        i = int(((hz[k].double() - full[k].double()).abs()).flatten().argmax())
        print(
            f"  worst element {k}[{i}]: horizon {float(hz[k].flatten()[i]):.8g} full {float(full[k].flatten()[i]):.8g}"
        )
        for t in range(ch.STEPS if k in hg[0] else 0):  # a buffer, or a tied name: no gradient
            gf, gh = runs["full"][1][t][k], hg[t][k]
            print(
                f"    step {t + 1}: g full {float(gf.flatten()[i]):.5e} horizon {float(gh.flatten()[i]):.5e}"
                f" (|g| / the tensor's largest {abs(float(gf.flatten()[i])) / float(gf.abs().max()):.1e})"
            )


if __name__ == "__main__":
    main()
