"""`horizon train`: config -> checks -> run dir (lock, resume) -> data -> engine -> loop -> export.

Everything that can be checked before training is checked first, so that bad input exits 2
before anything is written: the config, the store, the device, the memory plan, the run dir and
whether this config may resume it, the data. `--dry-run` runs the same checks and writes nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from .. import owner, preflight
from ..config import Config, dump_yaml, load_config
from ..data.prepare import check_lengths
from ..engine.adapters import LoraSetup, lora_for
from ..engine.fit import check_device_fit, device_fit
from ..engine.lora_plan import lora_memory_plan
from ..engine.plan import MemoryPlan, memory_plan
from ..errors import HorizonError, InputError, Terminated
from ..faults import phase
from ..inspect import fmt_bytes
from ..store import Store
from ..store import checkpoint as ckpt
from . import compat
from .loop import Trainer, load_data
from .metrics import tensorboard_writer
from .rundir import RunDir


def run_training(
    config_path: Path, overrides: list[str], dry_run: bool = False, console: Console | None = None
):
    console = console or Console()
    phase("startup")
    cfg = load_config(config_path, overrides)
    store = Store.open(cfg.model.path)
    lora = lora_for(cfg.lora, store, cfg.train.seed)  # targets and lora.init checked before any write
    check_lengths(cfg.data, store.arch.max_positions)
    device = preflight.check_device(cfg.engine)
    plan = plan_for(cfg, store, lora)
    if dry_run:
        return dry_run_report(cfg, store, plan, device, console)
    check_fits(plan, device == "cpu")
    check_device_fit(plan, cfg.engine)
    if cfg.log.tensorboard:
        tensorboard_writer(None)  # fail now, not after loading the model
    with stop_signals(), RunDir.claim(cfg, store, console) as rd:
        phase("locked")
        if rd.finished():
            console.print(
                f"{rd.path}: complete at step {rd.resume_step} (train.steps {cfg.train.steps}); nothing to do",
                highlight=False,
            )
            return {"step": rd.resume_step, "checkpoint": str(rd.candidates[0]), "complete": True}
        with runtime_failures():
            return Trainer(cfg, store, rd, console, lora).run()


def plan_for(cfg: Config, store: Store, lora: LoraSetup | None = None) -> MemoryPlan:
    e = cfg.engine
    seq = min(cfg.data.max_seq_len, store.arch.max_positions)
    if lora is not None:
        return lora_memory_plan(
            store.arch,
            lora.targets,
            lora.r,
            e.dtype,
            e.grad_dtype,
            batch=cfg.train.batch_size,
            micro_batch=cfg.train.micro_batch_size,
            seq=seq,
            prefetch=e.prefetch,
            loss_chunk=e.loss_chunk,
            quant=store.quant,
        )
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


# -- dry run -------------------------------------------------------------------------------------
def dry_run_report(cfg: Config, store: Store, plan: MemoryPlan, device: str, console: Console) -> None:
    """The checks of a real start that write nothing: the data is read and tokenized (not
    cached, not even where data.cache_dir says), the run dir's resume point checked against
    this config."""
    load_data(replace(cfg, data=replace(cfg.data, cache_dir=None)), store, None, console)
    run_dir = run_dir_status(cfg, store)
    console.print(Syntax(dump_yaml(cfg), "yaml", theme="ansi_dark", background_color="default"))
    console.print(plan_table(plan, store))
    ok, why = fits(plan, device == "cpu")
    console.print(("[green]fits[/]: " if ok else "[red]does not fit[/]: ") + why)
    dev_fit = device_fit(plan, cfg.engine)  # None on the CPU: the host line above counts the device
    if dev_fit is not None:
        console.print(
            ("[green]device fits[/]: " if dev_fit[0] else "[red]device does not fit[/]: ") + dev_fit[1]
        )
    console.print(f"output.dir: {run_dir}", highlight=False)


def run_dir_status(cfg: Config, store: Store) -> str:
    path = Path(cfg.output.dir)
    compat.check_accept_keys(cfg)
    holder = owner.probe(path)
    if holder:
        return f"{path} is in use by {holder}: a real start would stop here"
    good, _ = ckpt.intact(path)
    if not good:
        return f"{path}: a new run"
    probe = RunDir(cfg, store, Console(quiet=True))
    probe.candidates = good
    probe.check_resumable(good[0])
    if probe.trained:
        return f"{path}: complete at step {probe.resume_step}"
    return f"{path}: resumes from {good[0].name}"


def plan_table(plan: MemoryPlan, store: Store) -> Table:
    title = f"memory plan ({plan.params:,} parameters)"
    if cfg_lora_params(plan):
        title = f"memory plan ({plan.params:,} parameters, LoRA: {cfg_lora_params(plan):,} trained)"
    t = Table(title=title, title_justify="left")
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


def cfg_lora_params(plan: MemoryPlan) -> int:
    """Trained adapter parameters of a LoRA plan (0 otherwise), from its fp32-moments row."""
    return plan.host.get("adapter AdamW moments (fp32)", 0) // 8


# -- host memory ---------------------------------------------------------------------------------
def fits(plan: MemoryPlan, device_is_host: bool = False) -> tuple[bool, str]:
    """Against what this process may allocate (free RAM, RLIMIT_AS, the cgroup's limit). On
    `device: cpu` the device's buffers live in host RAM too."""
    avail, limit = preflight.host_available()
    need = plan.host_total + (plan.device_total if device_is_host else 0)
    what = "host + device (both in RAM)" if device_is_host else "host"
    return need <= avail, f"{what} needs {fmt_bytes(need)}, {fmt_bytes(avail)} available ({limit})"


def check_fits(plan: MemoryPlan, on_host: bool) -> None:
    ok, why = fits(plan, on_host)
    if not ok:
        raise InputError(
            f"memory plan does not fit this machine: {why} (see `horizon train CONFIG --dry-run`)"
        )


# -- stopping ------------------------------------------------------------------------------------
@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM stops the run like SIGINT: an exception unwinds it (temp dirs removed, the last
    checkpoint kept) and the command exits 143."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def runtime_failures() -> Iterator[None]:
    """Failures of the machine while training (a full disk, no memory, no threads) are one
    `error:` line and exit status 1, not a traceback."""
    try:
        yield
    except HorizonError:
        raise
    except MemoryError:
        raise HorizonError("out of host memory (MemoryError); the last checkpoint is intact") from None
    except OSError as e:
        raise HorizonError(f"{e.filename or 'I/O'}: {e.strerror or e}") from None
    except RuntimeError as e:
        if "can't start new thread" in str(e):
            raise HorizonError(f"cannot start a thread ({e}); the last checkpoint is intact") from None
        if "out of memory" in str(e).lower():
            raise HorizonError(f"{str(e).splitlines()[0]}; the last checkpoint is intact") from None
        raise
