"""Experiment trackers beside TensorBoard: Weights & Biases (`log.wandb`) and MLflow (`log.mlflow`),
each an optional extra. Each receives every metrics.jsonl row (its numbers, at its step) and the
resolved config, and the run dir remembers the tracker's run (trackers.json), so a resumed run
continues the same tracker run.

A missing package is refused before anything is loaded (run.py, with TensorBoard's check). The
trackers start before the run dir is written (train/loop.py: before RunDir.begin()): one that cannot
start (a server that cannot be reached) stops the start, and what the tracker start wrote into the
run dir (wandb/, mlruns/, trackers.json) is removed again with the rest of the failed start. A
tracker that fails while the run trains (a server gone) is switched off with one warning: the
training does not stop for a dashboard.

A resumed run retrains the steps after its checkpoint that a killed run had logged already: MLflow
keeps a metric's history (no step can be replaced), so a resumed run logs each metric only at steps
past those its tracker run holds (the resumed steps retrain bitwise the same). W&B drops steps below
its run's own step itself.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..config import Config, dump_yaml, to_dict
from ..errors import HorizonError, InputError
from ..fsutil import write_text_atomic

IDS = "trackers.json"
EXTRA = {"wandb": "wandb", "mlflow": "mlflow"}
WRITES = ("wandb", "mlruns")  # what a tracker start may write into the run dir, besides IDS


def check_trackers(cfg: Config) -> None:
    """InputError naming the key when a configured tracker's package is missing."""
    for key, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
        if getattr(cfg.log, key):
            try:
                __import__(module)
            except ImportError:
                raise InputError(
                    f"log.{key}: needs the {module} package (pip install 'horizon-cli[{EXTRA[key]}]')"
                ) from None


def numbers(row: dict) -> dict[str, float]:
    """A metrics row's numbers (what TensorBoard gets too): no step, no flags, no lists."""
    return {
        k: float(v)
        for k, v in row.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"
    }


def flat(tree: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = json.dumps(v) if not isinstance(v, str) else v
    return out


class Trackers:
    def __init__(self, cfg: Config, run_dir: Path, resume_step: int, console=None):
        self.run_dir, self.console = Path(run_dir), console
        ids_path = self.run_dir / IDS
        ids = json.loads(ids_path.read_text()) if resume_step and ids_path.is_file() else {}
        self.live: dict[str, _Wandb | _Mlflow] = {}
        before = written(self.run_dir)
        try:
            if cfg.log.wandb:
                self.live["wandb"] = _Wandb(cfg, self.run_dir, ids.get("wandb"))
            if cfg.log.mlflow:
                self.live["mlflow"] = _Mlflow(cfg, self.run_dir, ids.get("mlflow"), resume_step)
        except Exception as e:
            self.close()
            remove_new(self.run_dir, before)  # never what an earlier run wrote
            raise HorizonError(
                f"log: could not start the experiment tracker ({type(e).__name__}: {e})"
            ) from None
        if self.live:
            ids.update({k: t.id for k, t in self.live.items()})
            write_text_atomic(ids_path, json.dumps(ids) + "\n")

    def log(self, row: dict) -> None:
        vals, step = numbers(row), int(row["step"])
        for name, t in list(self.live.items()):
            try:
                t.log(vals, step)
            except Exception as e:  # a tracker never stops the training
                self.live.pop(name)
                if self.console is not None:
                    self.console.print(f"[yellow]warning:[/] log.{name}: switched off after an error ({e})")

    def close(self) -> None:
        while self.live:
            _, t = self.live.popitem()
            t.close()


def written(run_dir: Path) -> set[Path]:
    """Every file and folder a tracker start may have written under run_dir."""
    out = {run_dir / IDS} if (run_dir / IDS).exists() else set()
    for name in WRITES:
        top = run_dir / name
        if top.is_dir() and not top.is_symlink():
            out.add(top)
            for root, dirs, files in os.walk(top):
                out.update(Path(root) / n for n in (*dirs, *files))
    return out


def remove_new(run_dir: Path, before: set[Path]) -> None:
    for p in sorted(written(run_dir) - before, key=lambda q: len(q.parts)):  # outermost first
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists() or p.is_symlink():
            p.unlink(missing_ok=True)


class _Wandb:
    def __init__(self, cfg: Config, run_dir: Path, run_id: str | None):
        import wandb

        self.run = wandb.init(
            project=cfg.log.wandb_project,
            name=run_dir.name,
            id=run_id,
            config=to_dict(cfg),
            resume="allow" if run_id else None,
            dir=str(run_dir),
        )
        self.id = self.run.id

    def log(self, vals: dict[str, float], step: int) -> None:
        self.run.log(vals, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, cfg: Config, run_dir: Path, run_id: str | None, resume_step: int):
        uri = cfg.log.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the run's own file store (MLflow 3 wants to be told that a file store is meant)
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = c = MlflowClient(uri)
        if run_id is None:
            exp = c.get_experiment_by_name(cfg.log.mlflow_experiment)
            exp_id = exp.experiment_id if exp else c.create_experiment(cfg.log.mlflow_experiment)
            run_id = c.create_run(exp_id, run_name=run_dir.name).info.run_id
            for k, v in flat(to_dict(cfg)).items():  # params are write-once: the config at the start
                c.log_param(run_id, k, v[:500])
            self.held: dict[str, int] = {}
        else:  # resumed: the steps each metric's history holds already (a killed run's, past the checkpoint)
            keys = c.get_run(run_id).data.metrics
            self.held = {k: max((m.step for m in c.get_metric_history(run_id, k)), default=-1) for k in keys}
        c.log_text(run_id, dump_yaml(cfg), f"config_step_{resume_step}.yaml")  # and at every (re)start
        self.id = run_id

    def log(self, vals: dict[str, float], step: int) -> None:
        for k, v in vals.items():
            if step > self.held.get(k, -1):
                self.client.log_metric(self.id, k, v, step=step)

    def close(self) -> None:
        self.client.set_terminated(self.id)
