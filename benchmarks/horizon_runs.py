"""`horizon train` in a child process, for the benchmarks that compare ways of training
(benchmarks/bench_dist.py, benchmarks/bench_lora.py): the checkpoint and token rows they share, a run's
config, one timed run, and what is kept of interleaved repeats.

A run's tokens/s leaves out its first step (it compiles kernels for new shapes); of the repeats
the best tokens/s is kept, with every repeat's figure and the share of the CPU other processes
used meanwhile (the machine is shared).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import yaml
from common import SHAPES, make_rows, write_rows
from runner import ChildRun, GiB, child_env, run_child


def prepare(work: Path, size: str, seq: int, n_rows: int, stores: dict[str, str]) -> dict[str, Path]:
    """A random Llama-shaped checkpoint (SHAPES[size], bf16) converted once per entry of `stores`
    (directory under `work` -> `--quantize` value) and `n_rows` token rows, made once and reused
    by later runs. Returns the stores' paths by name, and the rows' as "data"."""
    paths = {name: work / name for name in stores}
    data = work / "rows.jsonl"
    if not all((p / "manifest.json").is_file() for p in paths.values()) or not data.is_file():
        from prepare import save_stream

        from horizon_cli.convert import convert

        hf = work / "hf"
        save_stream({"shape": SHAPES[size], "seq": seq, "hf_dtype": "bfloat16", "seed": 0}, hf)
        for name, quant in stores.items():
            convert(hf, paths[name], dtype="bfloat16", force=True, quantize=quant)
        shutil.rmtree(hf)
        write_rows(make_rows(n_rows, seq, SHAPES[size]["vocab"]), data)
    return {**paths, "data": data}


def write_config(run: Path, store: Path, data: Path, a, steps: int, engine: dict, **sections) -> Path:
    """The run's config beside its dir (`a`: the benchmark's seq, batch and micro), `tokens` rows in
    order, a constant lr, no checkpoints or export; `sections` add to or replace top-level ones."""
    cfg = {
        "model": {"path": str(store)},
        "data": {"path": str(data), "format": "tokens", "max_seq_len": a.seq, "shuffle": False},
        "train": {"steps": steps, "batch_size": a.batch, "micro_batch_size": a.micro},
        "optim": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.0, "grad_clip": 1.0},
        "schedule": {"kind": "constant"},
        "engine": {"device": "cpu", **engine},
        "output": {"dir": str(run), "export": False, "save_every": 0},
        "log": {"every": 1, "plot": False},
        **sections,
    }
    path = run.parent / f"{run.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# .venv/bin/horizon train {path}\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path


def train(cmd: list[str], run: Path, threads: int, limit_gib: float) -> tuple[ChildRun, list[dict], Path]:
    """Run `cmd` (a `horizon train` of the config written for `run`), stop the benchmark if it
    fails, and return the child, the run's metrics rows and its log; the run dir is removed."""
    log = run.parent / f"{run.name}.log"
    child = run_child(cmd, log, child_env(threads), limit_bytes=int(limit_gib * GiB))
    if child.rc != 0:
        raise SystemExit(f"{run.name}: exit {child.rc} {child.killed} (see {log})")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    shutil.rmtree(run, ignore_errors=True)
    return child, rows, log


def horizon_cmd() -> list[str]:
    return [sys.executable, "-m", "horizon_cli", "train"]


def tokens_per_s(rows: list[dict]) -> float:
    timed = rows[1:]  # the first step compiles kernels for new shapes
    return sum(r["input_tokens"] for r in timed) / sum(r["step_s"] for r in timed)


def best(runs: list[dict]) -> dict:
    """Of a mode's repeats: the best tokens/s (and that run's losses), every repeat's tokens/s and
    the others' CPU share."""
    top = max(runs, key=lambda r: r["tokens_per_s"])
    return {
        "tokens_per_s": top["tokens_per_s"],
        "all_tokens_per_s": [r["tokens_per_s"] for r in runs],
        "others_cpu": [r["others_cpu"] for r in runs],
        "losses": top["losses"],
    }


def save(out: dict, path: Path) -> None:
    print(json.dumps(out["modes"], indent=1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
