"""Experiment trackers: a run with `log.wandb` (W&B's offline mode) and `log.mlflow` (MLflow's local
file store) logs every metrics.jsonl row at its step and the resolved config, and a resumed run
continues the same tracker runs; a missing package is refused in one line before anything starts."""

from __future__ import annotations

import json
import struct
import sys

import pytest

from horizon_cli.train.metrics import read_metrics
from tests.conftest import chat_rows, write_config, write_jsonl
from tests.train.test_train_cli import horizon, one_error_line

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")


def wandb_records(path) -> list:
    """The records of an offline W&B run file (a LevelDB-style log of protobuf records after a
    7-byte header; blocks of 32 KiB)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, out, part = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            out.append(part + chunk)
            part = b""
        elif kind in (2, 3):
            part += chunk
    recs = []
    for d in out:
        r = pb.Record()
        r.ParseFromString(d)
        recs.append(r)
    return recs


def wandb_history(run_dir) -> tuple[dict[int, dict], dict, set[str]]:
    """{step: {key: value}}, the config, and the run ids, over every offline run file."""
    hist, config, ids = {}, {}, set()
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
                hist[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
            elif kind == "run":
                ids.add(r.run.run_id)
                for u in r.run.config.update:
                    config["/".join(u.nested_key) or u.key] = json.loads(u.value_json)
    return hist, config, ids


def test_wandb_and_mlflow_get_every_row_and_the_config(tiny_store, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(8))
    run = tmp_path / "run"
    log = {"wandb": True, "mlflow": True, "wandb_project": "tiny"}
    # a constant schedule: train.steps may grow on resume (train/compat.py)
    cfg = write_config(
        tmp_path / "c.yaml", tiny_store, data, run, train={"steps": 3}, log=log, schedule={"kind": "constant"}
    )
    assert horizon("train", cfg).exit_code == 0
    assert horizon("train", cfg, "train.steps=5").exit_code == 0  # resumed: the same tracker runs go on
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    ids = json.loads((run / "trackers.json").read_text())

    hist, config, run_ids = wandb_history(run)
    assert run_ids == {ids["wandb"]}
    assert sorted(hist) == [1, 2, 3, 4, 5]
    for r in rows:
        got = hist[r["step"]]
        assert got["loss"] == pytest.approx(r["loss"], rel=1e-12) and got["lr"] == pytest.approx(r["lr"])
        assert got["weight_loads"] == r["weight_loads"] and "skipped" not in got
    assert config["optim"]["lr"] == 3.0e-3 and config["log"]["wandb_project"] == "tiny"

    client = mlflow.tracking.MlflowClient((run / "mlruns").as_uri())
    loss = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "loss")}
    assert loss == {r["step"]: pytest.approx(r["loss"]) for r in rows}
    params = client.get_run(ids["mlflow"]).data.params
    assert params["optim.lr"] == "0.003" and params["train.steps"] == "3"  # the config at the start
    arts = {a.path for a in client.list_artifacts(ids["mlflow"])}
    assert {"config_step_0.yaml", "config_step_3.yaml"} <= arts  # and at every (re)start


def test_missing_tracker_package_is_refused_before_anything(tiny_store, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    for key, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
        monkeypatch.setitem(sys.modules, module, None)  # `import wandb` now raises ImportError
        run = tmp_path / f"run-{key}"
        cfg = write_config(tmp_path / f"{key}.yaml", tiny_store, data, run, log={key: True})
        msg = one_error_line(horizon("train", cfg))
        assert f"log.{key}: needs the {module} package" in msg and f"horizon-cli[{key}]" in msg
        assert not run.exists()


def run_files(run) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_tracker_that_cannot_start_leaves_the_run_dir_as_it_was(tiny_store, tmp_path, monkeypatch):
    """MLflow at an address nobody listens on (loopback, no retries, a short timeout): the start
    stops in one line, before config.yaml or the cache are written; a new run dir is gone, an
    existing one holds exactly what it held."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(8))
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "c.yaml", tiny_store, data, run, train={"steps": 2}, schedule={"kind": "constant"}
    )
    away = ["log.mlflow=true", "log.mlflow_uri=http://127.0.0.1:9"]

    r = horizon("train", cfg, *away)
    assert r.exit_code == 1 and "error: log: could not start the experiment tracker" in r.output, r.output
    assert "Traceback" not in r.output and not run.exists()

    assert horizon("train", cfg).exit_code == 0  # a run dir with a checkpoint (step 2) and its cache
    before = run_files(run)
    assert "config.yaml" in before and any(k.startswith("cache/") for k in before)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # its resume cannot start MLflow, after W&B started (and wrote its offline run into the run dir)
    r = horizon("train", cfg, "train.steps=4", "log.wandb=true", *away)
    assert r.exit_code == 1 and "could not start the experiment tracker" in r.output, r.output
    assert run_files(run) == before and not (run / "wandb").exists()


def tensorboard_scalars(logdir, key: str) -> list[tuple[int, float]]:
    """(step, value) of a scalar as TensorBoard shows it: its reader drops the events a restarted
    writer purged (SessionLog START at the purge step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), purge_orphaned_data=True)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(key)]


@pytest.mark.slow  # a kill and a resume under both trackers (the first test keeps them fast)
def test_a_killed_run_resumed_logs_each_step_once(tiny_store, tmp_path, monkeypatch):
    """SIGKILL at step 7 after a checkpoint at step 4 (steps 5 and 6 logged), then resumed: MLflow's
    history and TensorBoard's scalars hold each step once, with the values metrics.jsonl holds (the
    resume retrains 5 and 6 bitwise the same)."""
    import os
    import subprocess

    pytest.importorskip("tensorboard")

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the run's file store here (MLflow 3)
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(8))
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", tiny_store, data, run, train={"steps": 8}, log={"mlflow": True, "tensorboard": True},
                       output={"dir": str(run), "save_every": 4, "keep_last": 2, "export": False})  # fmt: skip
    cmd = [sys.executable, "-m", "horizon_cli", "train", str(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        cmd, env={**env, "HORIZON_FAULT": "step:7"}, capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr
    ids = json.loads((run / "trackers.json").read_text())
    client = mlflow.tracking.MlflowClient((run / "mlruns").as_uri())
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "loss")] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in tensorboard_scalars(run / "tensorboard", "loss")] == [1, 2, 3, 4, 5, 6]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    for key in ("loss", "lr"):
        hist = sorted((m.step, m.value) for m in client.get_metric_history(ids["mlflow"], key))
        assert [s for s, _ in hist] == list(range(1, 9)), (key, hist)
        assert [v for _, v in hist] == pytest.approx([r[key] for r in rows], rel=1e-12)
        tb = tensorboard_scalars(run / "tensorboard", key)  # float32 scalars
        assert [s for s, _ in tb] == list(range(1, 9)), (key, tb)
        assert [v for _, v in tb] == pytest.approx([r[key] for r in rows], rel=1e-6)
