"""Peer (a): horizon, driven one of two ways (job['driver']):

  cli     `horizon train CONFIG` in this process (train.run.run_training, the function the CLI
          command calls): the data pipeline, the loop, metrics.jsonl, the final checkpoint. Step
          times, losses and tokens are read back from metrics.jsonl. export and the loss plot off.
  engine  Engine.step on MicroBatches built here (what the loop calls each step), no data
          pipeline and no checkpoint: used by the scale study, where writing a multi-GB
          checkpoint would dominate.

Either way the engine runs with engine.device cpu, the job's dtype, the native AdamW kernel when
it builds (optim.kernel auto), micro-batches of job['micro'] rows, engine.keep_activations
job['keep'] (default auto: as `horizon train` decides it; the engine driver asks the same plan).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from common import RssSampler, peer_main, read_rows, rss, step_batches


def plan_of(cfg_path: Path) -> dict:
    """The memory plan `horizon train --dry-run` shows for this config (train.run.plan_for)."""
    from horizon_cli.config import load_config
    from horizon_cli.lora.setup import lora_for
    from horizon_cli.planning.ladder import plan_for, run_rung
    from horizon_cli.store import Store

    cfg = load_config(cfg_path, [])
    store = Store.open(cfg.model.path)
    from horizon_cli.preflight import local_machine

    # with its kept layers (engine.keep_activations: auto fits them to this machine, as `train` does)
    p = plan_for(cfg, store, run_rung(cfg, store), lora_for(cfg.lora, store), where=local_machine(cfg))
    return {
        "params": p.params,
        "host": p.host,
        "host_total": p.host_total,
        "device": p.device,
        "device_total": p.device_total,  # engine.device cpu: "device" buffers are host RAM too
        "state_bytes": p.state_bytes,
        "bytes_per_param": p.bytes_per_param,
        "kept_layers": p.kept,
        "kept_bytes": p.kept_bytes,
    }


def write_config(job: dict, run_dir: Path) -> Path:
    import yaml

    o = job["optim"]
    cfg = {
        "model": {"path": job["store"]},
        "data": {"path": job["data"], "format": "tokens", "max_seq_len": job["seq"], "shuffle": False},
        "train": {"steps": job["steps"], "batch_size": job["batch"], "micro_batch_size": job["micro"]},
        "optim": {k: o[k] for k in ("lr", "betas", "eps", "weight_decay", "grad_clip")}
        | {"kernel": "auto", "memory": o.get("memory", "exact")},
        "schedule": {"kind": "constant"},
        "engine": {
            "device": "cpu",
            "dtype": job["dtype"],
            "compute_threads": job["threads"],
            "keep_activations": job.get("keep", "auto"),
        },  # fmt: skip
        "output": {"dir": str(run_dir), "export": False},
        "log": {"every": 1, "plot": False},
    }
    if job.get("lora"):  # LoRA on the store (benchmarks/bench_scale.py --lora)
        cfg["lora"] = job["lora"]
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(f"# .venv/bin/horizon train {path}\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_cli(job: dict) -> dict:
    from horizon_cli.train.run import run_training

    run_dir = Path(job["work"]) / "horizon-run"
    shutil.rmtree(run_dir, ignore_errors=True)  # never resume an earlier run
    cfg = write_config(job, run_dir)
    with RssSampler() as s:
        run_training(cfg, [])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "step_s": [r["step_s"] for r in rows],  # interval between step ends: includes the overlapped
        "tokens": [r["input_tokens"] for r in rows],  # optimizer of the previous step
        "rss_step_ends": [r["host_rss_bytes"] for r in rows],
        "rss_train_peak": s.peak,  # whole run_training: data, engine load, steps, final checkpoint
        "kept_layers": rows[-1].get("kept_layers"),
        "config": str(cfg),
        "plan": plan_of(cfg),
    }


def _malloc_trim() -> None:
    """Experiment (--horizon-malloc-trim): hand glibc's freed heap pages back to the kernel."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def run_engine(job: dict) -> dict:
    import torch

    from horizon_cli.config import load_config
    from horizon_cli.data.batch import MicroBatch
    from horizon_cli.engine import Engine
    from horizon_cli.store import Store

    cfg_path = write_config(job, Path(job["work"]) / "horizon-run")  # the settings the CLI would use
    cfg = load_config(cfg_path, [])
    torch.set_num_threads(cfg.engine.compute_threads)
    from horizon_cli.lora.setup import lora_for
    from horizon_cli.planning.ladder import plan_for, run_rung
    from horizon_cli.preflight import local_machine

    store = Store.open(cfg.model.path)
    lora = lora_for(cfg.lora, store)
    objective = None
    if job.get("preference"):  # rows 2k, 2k + 1 a pair: the second half of each row its completion
        from horizon_cli.config.schema import PreferenceConfig
        from horizon_cli.recipes.preference.loss import PairObjective

        objective = PairObjective(PreferenceConfig(loss=job["preference"]))
    keep = plan_for(cfg, store, run_rung(cfg, store), lora, where=local_machine(cfg)).kept  # as `train`
    engine = Engine(
        store,
        cfg.engine,
        cfg.optim,
        max_tokens=job["batch"] * job["seq"],
        lora=lora,
        keep=keep,
        objective=objective,
    )
    trim = _malloc_trim if job.get("malloc_trim") else lambda: None
    trim()
    o = job["optim"]
    rss_setup = rss()
    batches = step_batches(read_rows(job["data"]), job["steps"], job["batch"], job["micro"])
    losses, norms, times, tokens, ends = [], [], [], [], []
    with RssSampler() as s:
        steps = [
            [MicroBatch(ids, ids, torch.arange(ids.shape[1]).expand_as(ids).contiguous()) for ids in ids_list]
            for ids_list in batches
        ]
        if objective is not None:  # the reference pass before step 1 (initial weights), as `train` does
            steps = [_pairs(engine, mbs) for mbs in steps]
        for k, (ids_list, mbs) in enumerate(zip(batches, steps, strict=True)):
            t0 = time.perf_counter()
            r = engine.step(mbs, o["lr"], engine.objective.divisor(mbs))
            if k == len(batches) - 1:
                engine.wait()  # the last update, which the next step would otherwise overlap
            trim()
            times.append(time.perf_counter() - t0)
            losses.append(r.loss)
            norms.append(r.grad_norm)
            tokens.append(sum(int(i.numel()) for i in ids_list))
            ends.append(rss())
    kernel = engine.optimizer.kernel_name
    engine.close()
    return {
        "losses": losses,
        "grad_norms": norms,
        "step_s": times,
        "tokens": tokens,
        "rss_step_ends": ends,
        "rss_train_peak": s.peak,
        "rss_setup": rss_setup,
        "kernel": kernel,
        "kept_layers": keep,
        "plan": plan_of(cfg_path),
    }


def _pairs(engine, mbs):
    """Rows as pairs: the first half of each row its prompt (no loss), the rest its completion; the
    reference log-probs from the engine's forward-only pass over them (the memory it takes counts)."""
    import torch

    from horizon_cli.data.batch import IGNORE
    from horizon_cli.data.pairs import PairPayload

    for mb in mbs:
        mb.labels = mb.input_ids.clone()
        mb.labels[:, : mb.labels.shape[1] // 2] = IGNORE
        mb.lengths = torch.full((mb.input_ids.shape[0],), mb.input_ids.shape[1])
    ref = engine.sequence_logps(mbs)
    pairs = sum(mb.input_ids.shape[0] for mb in mbs) // 2
    chosen = sum(int((mb.labels[0::2, 1:] != IGNORE).sum()) for mb in mbs)
    seq = sum(mb.input_ids.shape[0] // 2 * (mb.input_ids.shape[1] - 1) for mb in mbs)
    for mb, lp in zip(mbs, ref, strict=True):
        mb.payload = PairPayload(pairs=pairs, chosen_tokens=chosen, chosen_seq_tokens=seq, ref=lp)
    return mbs


def run(job: dict) -> dict:
    import transformers  # noqa: F401 - the CLI loads the store's tokenizer

    import horizon_cli
    import horizon_cli.train.loop  # noqa: F401 - what `horizon train` imports before any model memory

    imports = rss()

    res = run_cli(job) if job.get("driver", "cli") == "cli" else run_engine(job)
    if "kernel" not in res:
        from horizon_cli.optim.kernel import pick_kernel

        res["kernel"] = pick_kernel("auto")[1]  # what optim.kernel auto chose (cached: no rebuild)
    plan = res["plan"]
    res.update(
        params=plan["params"], micro_batch=job["micro"], driver=job.get("driver", "cli"), rss_imports=imports
    )
    res["notes"] = (
        f"horizon {getattr(horizon_cli, '__version__', '?')}, driver {res['driver']}, "
        f"kept layers {res.get('kept_layers')}"
    )
    return res


if __name__ == "__main__":
    peer_main(run)
