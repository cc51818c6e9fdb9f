"""horizon's Python API: each command as a function returning a result object. The CLI is a thin
shell over these (horizon_cli.cli); bad input raises `horizon_cli.errors.InputError` (a
`HorizonError` whose `exit_code` is 2), failures at run time `HorizonError` (exit code 1).

    import horizon_cli.api as horizon

    horizon.convert("hf/SmolLM2-135M", "stores/smollm2")
    plan = horizon.plan({"model": {"path": "stores/smollm2"}, "data": {"path": "sft.jsonl"},
                         "output": {"dir": "runs/a"}}, ["train.steps=100"])
    run = horizon.train("configs/demo.yaml", ["optim.lr=2e-5"])
    print(run.final_loss, run.export)
    horizon.export("runs/a", "hf/a")
    out = horizon.generate("runs/a", prompts=["What is the capital of France?"], max_new_tokens=32)
    print(out.rows[0]["completion"])

`console`: where progress and reports go (a rich Console; default: the terminal; pass
`Console(quiet=True)` for silence).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

Config = str | Path | Mapping[str, Any]  # a YAML file, or the same tree as a mapping


@dataclass(frozen=True)
class ConvertResult:
    store: Path
    params: int
    units: int
    dtype: str
    quantize: str
    reward: str = ""  # a reward model's class (rl.rewards[i].model), "" for a causal LM


@dataclass(frozen=True)
class PlanResult:
    """A dry run's plan: `report` holds every figure `--dry-run --json` writes."""

    fits: bool
    memory: str  # the rung this run trains on
    host_bytes: int
    device_bytes: int
    host_bytes_per_param: float
    report: dict = field(repr=False)


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    step: int
    checkpoint: Path
    final_loss: float | None = None
    export: Path | None = None  # <run>/export (when output.export)
    adapter: Path | None = None  # LoRA runs: <run>/adapter
    rank: int = 0  # under torchrun: this process's rank (rank 0 finishes the run)


@dataclass(frozen=True)
class ExportResult:
    dst: Path
    source: Path  # the store or checkpoint exported
    adapter: bool  # the PEFT adapter alone
    shards: int
    dtype: str


@dataclass(frozen=True)
class InspectResult:
    params: int
    path: str  # native | generic
    bytes: int
    info: dict = field(repr=False)  # every figure `horizon inspect` shows


def _console(console: Console | None) -> Console:
    return console if console is not None else Console()


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: str = "bfloat16",
    quantize: str = "",
    force: bool = False,
    revision: str | None = None,
    console: Console | None = None,
) -> ConvertResult:
    """An HF checkpoint directory, or a hub id (`owner/name`, fetched through huggingface_hub's
    cache at `revision`) -> a store (`horizon convert`)."""
    from .convert import convert as run

    info = run(
        src, dst, dtype=dtype, force=force, console=_console(console), quantize=quantize, revision=revision
    )
    return ConvertResult(Path(dst), info["params"], info["units"], dtype, quantize, info["reward"])


def _source(config: Config) -> tuple[Path | None, dict | None]:
    if isinstance(config, Mapping):
        return None, copy.deepcopy(dict(config))  # overrides must not change the caller's mapping
    return Path(config), None


def plan(
    config: Config,
    overrides: Sequence[str] = (),
    *,
    machine: tuple[float, float] | None = None,
    world_size: int | None = None,
    nproc_per_node: int | None = None,
    json_out: str | Path | None = None,
    console: Console | None = None,
) -> PlanResult:
    """Every check a real start makes, then the memory plan and ladder (`horizon train --dry-run`).
    machine: (host GiB, device GiB) of another machine to plan for. Where the start would stop
    (the plan does not fit, the run dir is in use, bad data, ...) raises `errors.DryRunRefused`,
    an InputError with the start's message whose `report` still holds the plan."""
    from .train import run_training

    path, base = _source(config)
    report = run_training(
        path,
        list(overrides),
        dry_run=True,
        console=_console(console),
        json_out=Path(json_out) if json_out is not None else None,
        machine=machine,
        ranks=(world_size, nproc_per_node),
        base=base,
    )
    return PlanResult(
        report["fits"],
        report["memory"],
        report["host_bytes"],
        report["device_bytes"],
        report["host_bytes_per_param"],
        report,
    )


def train(config: Config, overrides: Sequence[str] = (), *, console: Console | None = None) -> TrainResult:
    """Train (`horizon train`); run again on the same run dir to resume from its newest checkpoint."""
    from .train import run_training

    path, base = _source(config)
    out = run_training(path, list(overrides), console=_console(console), base=base)
    opt = lambda k: Path(out[k]) if out.get(k) else None  # noqa: E731
    ck = Path(out["checkpoint"])
    return TrainResult(
        ck.parent.parent,
        out["step"],
        ck,
        out.get("final_loss"),
        opt("export"),
        opt("adapter"),
        out.get("rank", 0),
    )


def export(
    src: str | Path,
    dst: str | Path,
    *,
    adapter: bool = False,
    force: bool = False,
    console: Console | None = None,
) -> ExportResult:
    """A store, or a run dir (its newest checkpoint) -> an HF checkpoint (`horizon export`)."""
    from .export import export as run

    info = run(src, dst, force=force, console=_console(console), adapter=adapter)
    return ExportResult(
        Path(dst), Path(info["source"]), bool(info.get("adapter")), info["shards"], info["dtype"]
    )


def inspect(store: str | Path, *, verify: bool = False, console: Console | None = None) -> InspectResult:
    """What a store holds and what training it costs (`horizon inspect`)."""
    from .inspect import inspect_store

    info = inspect_store(Path(store), verify=verify, console=_console(console))
    return InspectResult(info["params"], info["path"], info["bytes"], info)


@dataclass(frozen=True)
class GenerateResult:
    rows: list[dict]  # per prompt, in input order: its fields + completion, completion_ids, finish_reason
    output: Path | None = None


def generate(
    src: str | Path,
    *,
    prompts: Sequence[str] = (),
    prompts_file: str | Path | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop: Sequence[str] = (),
    batch_size: int = 32,
    output: str | Path | None = None,
    engine: Mapping[str, Any] | None = None,
    console: Console | None = None,
    echo=None,
) -> GenerateResult:
    """Streamed generation on a store or a run dir (`horizon generate`). engine: engine settings
    to override (device, dtype, prefetch, link_gbps, kv_cache, ...); echo(line): where completions
    print as they finish when there is no output file (default: the console)."""
    from .generate import Settings, run_generate

    settings = Settings(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop), batch_size)
    out = Path(output) if output is not None else None
    rows = run_generate(
        src, prompts_file, list(prompts), settings, out, _console(console), dict(engine or {}), echo
    )
    return GenerateResult(rows, out)


def evaluate(src: str | Path, args: Sequence[str] = ()) -> None:
    """lm-evaluation-harness on a store or run dir (`horizon eval SRC ARGS`): its command line with
    `--model horizon --model_args path=SRC` and `args` (--tasks, --include_path, --output_path, ...)."""
    from .generate.harness import run_lm_eval

    run_lm_eval(str(src), list(args))


def profile(
    config: str | Path | None = None,
    *,
    json_out: str | Path | None = None,
    trace: str | Path | None = None,
    plot: str | Path | None = None,
    console: Console | None = None,
) -> dict:
    """Link bandwidth, per-layer times and the overlap achieved (`horizon profile`): its JSON."""
    from .profile import run_profile

    return run_profile(
        Path(config) if config is not None else None,
        json_out=json_out,
        trace=trace,
        plot=plot,
        console=_console(console),
    )
