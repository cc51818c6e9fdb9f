"""`horizon train`: config -> checks -> (resume) -> data -> engine -> loop -> checkpoint -> export.

Everything that can be checked before training is checked first, so that bad input exits 2
before any time is spent: the config, the store, the run dir, the memory plan, the data.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import psutil
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from ..config import Config, dump_yaml, load_config
from ..engine.fit import check_device_fit
from ..engine.plan import MemoryPlan, memory_plan
from ..errors import InputError
from ..fsutil import write_text_atomic
from ..inspect import fmt_bytes
from ..store import Store
from . import checkpoint
from .metrics import tensorboard_writer


def run_training(
    config_path: Path, overrides: list[str], dry_run: bool = False, console: Console | None = None
):
    console = console or Console()
    cfg = load_config(config_path, overrides)
    store = Store.open(cfg.model.path)
    plan = plan_for(cfg, store)
    if dry_run:
        show_dry_run(cfg, store, plan, console)
        return None
    check_fits(plan, device_is_host(cfg))
    check_device_fit(plan, cfg.engine)
    if cfg.log.tensorboard:
        tensorboard_writer(None)  # fail now, not after loading the model
    run_dir = prepare_run_dir(cfg, store)
    from .loop import Trainer

    return Trainer(cfg, store, run_dir, console).run()


def plan_for(cfg: Config, store: Store) -> MemoryPlan:
    e = cfg.engine
    seq = min(cfg.data.max_seq_len, store.arch.max_positions)
    return memory_plan(
        store.arch,
        e.dtype,
        e.grad_dtype,
        batch=cfg.train.batch_size,
        micro_batch=cfg.train.micro_batch_size,
        seq=seq,
        prefetch=e.prefetch,
        loss_chunk=e.loss_chunk,
    )


def show_dry_run(cfg: Config, store: Store, plan: MemoryPlan, console: Console) -> None:
    console.print(Syntax(dump_yaml(cfg), "yaml", theme="ansi_dark", background_color="default"))
    console.print(plan_table(plan, store))
    ok, why = fits(plan, device_is_host(cfg))
    console.print(("[green]fits[/]: " if ok else "[red]does not fit[/]: ") + why)


def plan_table(plan: MemoryPlan, store: Store) -> Table:
    t = Table(title=f"memory plan ({plan.params:,} parameters)", title_justify="left")
    t.add_column("where")
    t.add_column("category")
    t.add_column("bytes", justify="right")
    for k, v in plan.host.items():
        t.add_row("host", k, fmt_bytes(v))
    t.add_row("host", "[bold]total", f"[bold]{fmt_bytes(plan.host_total)}")
    t.add_row("host", "state bytes per parameter", f"{plan.bytes_per_param:.2f}")
    for k, v in plan.device.items():
        t.add_row("device", k, fmt_bytes(v))
    t.add_row("device", "[bold]peak", f"[bold]{fmt_bytes(plan.device_total)}")
    return t


def fits(plan: MemoryPlan, device_is_host: bool = False) -> tuple[bool, str]:
    """On `device: cpu` the device's buffers live in host RAM too."""
    avail = psutil.virtual_memory().available
    need = plan.host_total + (plan.device_total if device_is_host else 0)
    ok = need <= avail
    what = "host + device (both in RAM)" if device_is_host else "host"
    return ok, f"{what} needs {fmt_bytes(need)}, {fmt_bytes(avail)} available"


def device_is_host(cfg: Config) -> bool:
    from ..engine.schedule import resolve_device

    return resolve_device(cfg.engine) == "cpu"


def check_fits(plan: MemoryPlan, on_host: bool) -> None:
    ok, why = fits(plan, on_host)
    if not ok:
        raise InputError(
            f"memory plan does not fit this machine: {why} (see `horizon train CONFIG --dry-run`)"
        )


def model_fingerprint(store: Store) -> str:
    """Identity of the starting model: its architecture and every tensor checksum."""
    h = hashlib.sha256(json.dumps(store.arch.to_dict(), sort_keys=True).encode())
    for u in store.units:
        for t in u.tensors:
            h.update(f"{t.hf}:{t.crc32};".encode())
    return h.hexdigest()[:16]


def prepare_run_dir(cfg: Config, store: Store) -> Path:
    run_dir = Path(cfg.output.dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise InputError(f"output.dir: {run_dir} is not writable ({e.strerror or e})") from None
    ck = checkpoint.latest(run_dir)
    if ck is not None:
        trainer = json.loads((ck / "state" / "trainer.json").read_text())
        if trainer.get("model_fingerprint") != model_fingerprint(store):
            raise InputError(
                f"output.dir: {run_dir} holds a checkpoint of a different model ({ck.name}); "
                "use another output.dir or remove the run dir"
            )
        if trainer.get("dtype") != cfg.engine.dtype:
            raise InputError(
                f"engine.dtype: {cfg.engine.dtype} differs from the checkpoint's {trainer.get('dtype')} in {ck}"
            )
    write_text_atomic(run_dir / "config.yaml", dump_yaml(cfg))
    return run_dir
