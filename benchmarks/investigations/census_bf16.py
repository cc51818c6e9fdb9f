"""The census in the default compute dtype: does every type horizon trains exactly in fp32 also
train in bf16? (No oracle at 1e-5 here: bf16 rounds differently from any reference. The check is
that convert (a bf16 store) -> `horizon train` (2 steps, engine.dtype bfloat16) -> export runs,
the losses are finite and within 2 % of horizon's own fp32 run's, and the export loads.)

    nice -n 10 python -m benchmarks.investigations.census_bf16 docs/census.json [--types a,b] [--json out.json]

Each type runs in a subprocess of its own; the rows print as they finish.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the children run as modules from here


def one(mt: str, layers: int) -> dict:
    import yaml
    from typer.testing import CliRunner

    from horizon_cli.cli import app
    from horizon_cli.convert import convert
    from horizon_cli.export import export
    from tests.support import census_horizon as ch
    from tests.support.census_horizon import quiet

    quiet()
    ch.STEPS = 2
    model, data = ch.tiny(mt, layers)
    losses = {}
    with tempfile.TemporaryDirectory(prefix=f"bf16-{mt}-") as t:
        tmp = Path(t)
        model.save_pretrained(tmp / "hf")
        for dtype in ("float32", "bfloat16"):
            run = tmp / dtype
            run.mkdir()
            convert(tmp / "hf", run / "store", dtype=dtype)
            path = ch.train_config(run, data)
            c = yaml.safe_load(path.read_text())
            c["engine"]["dtype"] = dtype
            path.write_text(yaml.safe_dump(c))
            r = CliRunner().invoke(app, ["train", str(path)])
            if r.exit_code != 0:
                exc = (
                    r.exception
                    if r.exception is not None and not isinstance(r.exception, SystemExit)
                    else None
                )
                lines = [ln for ln in r.output.splitlines() if ln.strip()]
                msg = next((ln for ln in lines if ln.startswith("error:")), (lines or [""])[-1])
                if exc is not None:
                    msg = f"{msg} {ch.err(exc)} at {ch.where(exc)}"
                return {"result": "failed", "stage": f"train {dtype}", "message": msg[:400]}
            metrics = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
            losses[dtype] = [m["loss"] for m in metrics]
            if dtype == "bfloat16":
                export(run / "run", run / "export")
                ch.load(run / "export", type(model))
    f, b = losses["float32"], losses["bfloat16"]
    if not all(math.isfinite(x) for x in b):
        return {"result": "failed", "stage": "loss", "losses": b}
    err = max(abs(x - y) / abs(y) for x, y in zip(b, f, strict=True))
    return {"result": "ok" if err <= 0.02 else "off", "loss_rel": err, "losses": b, "fp32": f}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("census", nargs="?")
    ap.add_argument("--types")
    ap.add_argument("--json")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--one", nargs=2, metavar=("TYPE", "LAYERS"))
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.one:
        res = one(a.one[0], int(a.one[1]))
        Path(a.out).write_text(json.dumps(res, default=str))
        return
    rows = json.loads(Path(a.census).read_text())
    types = (
        a.types.split(",")
        if a.types
        else sorted(t for t, r in rows.items() if (r.get("horizon") or {}).get("result") == "exact")
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out: dict = {}
    with tempfile.TemporaryDirectory() as t:
        for k, mt in enumerate(types):
            layers = str((rows.get(mt, {}).get("depth") or {}).get("layers") or 2)
            res_path = Path(t) / f"{mt}.json"
            t0 = time.time()
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.investigations.census_bf16",
                "--one",
                mt,
                layers,
                "--out",
                str(res_path),
            ]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env, cwd=ROOT)
                tail = (p.stdout + p.stderr)[-400:]
            except subprocess.TimeoutExpired:
                tail = f"timeout after {a.timeout} s"
            res = (
                json.loads(res_path.read_text())
                if res_path.is_file()
                else {"result": "failed", "message": tail}
            )
            out[mt] = res
            msg = res.get("message") or f"loss_rel {res.get('loss_rel', float('nan')):.2e}"
            print(
                f"[{k + 1}/{len(types)}] {mt}: {res['result']} {msg} ({time.time() - t0:.0f} s)", flush=True
            )
            if a.json:
                Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    bad = {t: r for t, r in out.items() if r["result"] != "ok"}
    print(f"{len(out) - len(bad)} of {len(out)} train in bf16; not: {', '.join(sorted(bad)) or 'none'}")


if __name__ == "__main__":
    main()
