"""The `horizon` command line: parse arguments, call one function of the Python API (api.py) per
command, map errors to exit codes.

Exit status: 0 success; 2 bad usage, config or input (one `error: ...` line); 1 failure at run
time. `--debug` (before or after the command) shows the traceback instead.
"""

from __future__ import annotations

import functools
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from . import __version__
from .errors import HorizonError


class _Commands(TyperGroup):
    """`--debug` is global but may also follow the command (`horizon train cfg.yaml --debug`)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)  # after `--` every word is an argument
        if "--debug" in args[:end]:
            args = ["--debug"] + [a for a in args[:end] if a != "--debug"] + args[end:]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=_Commands,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Fine-tune LLMs on one machine: host RAM holds the model, the GPU streams one layer at a time.",
)
console = Console(stderr=True)
state = {"debug": False}


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"horizon {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    state["debug"] = debug


def command(fn):
    """Run a command body, turning horizon errors into one line and an exit status."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HorizonError as e:
            if state["debug"]:
                raise
            console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt as e:  # ctrl-c, or SIGTERM where a command maps it (errors.Terminated)
            code = getattr(e, "exit_code", 130)
            console.print("[yellow]interrupted[/]" if code == 130 else "[yellow]terminated[/]")
            raise typer.Exit(code) from None

    return wrapper


@app.command()
@command
def convert(
    src: Annotated[
        str, typer.Argument(help="HF checkpoint directory, or a Hugging Face Hub id (owner/name).")
    ],
    dst: Annotated[Path, typer.Argument(help="Store directory to create.")],
    dtype: Annotated[str, typer.Option(help="Store dtype: bfloat16, float16 or float32.")] = "bfloat16",
    force: Annotated[bool, typer.Option("--force", help="Replace DST if it exists.")] = False,
    quantize: Annotated[
        str, typer.Option(help="nf4: decoder-layer linear weights as 4-bit NF4 (a base for LoRA).")
    ] = "",
    revision: Annotated[
        str | None, typer.Option(help="A hub id's branch, tag or commit (default: main).")
    ] = None,
) -> None:
    """Convert an HF checkpoint (a directory or a hub id) into a horizon store (streams tensor by tensor)."""
    from . import api
    from .errors import InputError

    if dtype not in ("bfloat16", "float16", "float32"):
        raise InputError(f"--dtype: {dtype!r} is not allowed (bfloat16, float16 or float32)")
    r = api.convert(src, dst, dtype=dtype, force=force, console=console, quantize=quantize, revision=revision)
    q = f", linear weights {quantize}" if quantize else ""
    what = f"; a reward model ({r.reward}): it scores as rl.rewards[i].model" if r.reward else ""
    console.print(
        f"[green]converted[/] {r.params:,} parameters into {dst} ({dtype}{q}, {r.units} units){escape(what)}"
    )


@app.command()
@command
def export(
    src: Annotated[Path, typer.Argument(help="A store, or a run dir (its latest checkpoint).")],
    dst: Annotated[Path, typer.Argument(help="HF checkpoint directory to create.")],
    force: Annotated[bool, typer.Option("--force", help="Replace DST if it exists.")] = False,
    adapter: Annotated[
        bool, typer.Option("--adapter", help="A LoRA run: write its PEFT adapter alone (not merged).")
    ] = False,
) -> None:
    """Export a store or a run's latest checkpoint as an HF checkpoint (LoRA runs: merged)."""
    from . import api

    r = api.export(src, dst, force=force, console=console, adapter=adapter)
    if r.adapter:
        console.print(f"[green]exported[/] the PEFT adapter of {r.source} -> {dst}")
        return
    console.print(f"[green]exported[/] {r.source} -> {dst} ({r.shards} shard(s), {r.dtype})")


@app.command()
@command
def inspect(
    store: Annotated[Path, typer.Argument(help="Store directory.")],
    verify: Annotated[bool, typer.Option("--verify", help="Check every tensor's checksum.")] = False,
) -> None:
    """Show a store's architecture, sizes and host bytes per parameter."""
    from . import api

    api.inspect(store, verify=verify, console=Console())


@app.command(context_settings={"allow_extra_args": False})
@command
def train(
    config: Annotated[Path, typer.Argument(help="YAML config.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotted KEY=VALUE overrides, e.g. optim.lr=2e-5.")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Validate, print the config, memory plan and ladder, exit.")
    ] = False,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="With --dry-run: write the plan and ladder as JSON.")
    ] = None,
    host_gib: Annotated[
        float | None,
        typer.Option("--host-gib", help="With --dry-run: plan for a machine with this much RAM."),
    ] = None,
    device_gib: Annotated[
        float | None, typer.Option("--device-gib", help="With --dry-run: ...and a CUDA device of this size.")
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option("--world-size", help="With --dry-run: plan per rank and per node for this many ranks."),
    ] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option("--nproc-per-node", help="With --world-size: ranks (GPUs) per node (default: all)."),
    ] = None,
) -> None:
    """Train from a config; resumes from the run dir's latest checkpoint when there is one."""
    from . import api
    from .errors import InputError

    if (host_gib is None) != (device_gib is None):
        raise InputError("--host-gib and --device-gib go together: they describe the machine to plan for")
    if json_out is not None and not dry_run:
        raise InputError("--json writes the plan of a dry run: add --dry-run")
    machine = (host_gib, device_gib) if host_gib is not None and device_gib is not None else None
    if not dry_run:
        if machine is not None or (world_size, nproc_per_node) != (None, None):
            _needs_dry_run(machine is not None)
        api.train(config, overrides or [], console=Console())
        return
    api.plan(
        config,
        overrides or [],
        machine=machine,
        world_size=world_size,
        nproc_per_node=nproc_per_node,
        json_out=json_out,
        console=Console(),
    )


@app.command()
@command
def generate(
    src: Annotated[Path, typer.Argument(help="A store, or a run dir (its newest intact checkpoint).")],
    prompts_file: Annotated[
        Path | None,
        typer.Option("--prompts", help="JSONL prompts: each line a prompt, messages or input_ids field."),
    ] = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt text (repeatable).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="New tokens per prompt at most.")] = 256,
    temperature: Annotated[float, typer.Option(help="0: greedy; above 0: sampling.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Sampling: nucleus probability (1: off).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sampling: the k most likely tokens only (0: off).")] = 0,
    seed: Annotated[int, typer.Option(help="Sampling: the seed (each prompt its own stream).")] = 0,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop at this text (repeatable).")] = None,
    batch_size: Annotated[int, typer.Option(help="Prompts that share each sweep of the weights.")] = 32,
    output: Annotated[Path | None, typer.Option(help="Write the completions as JSONL here.")] = None,
) -> None:
    """Generate with the streamed engine: one sweep of the layers per new token for a whole batch."""
    from . import api

    api.generate(
        src,
        prompts=prompt or [],
        prompts_file=prompts_file,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop or [],
        batch_size=batch_size,
        output=output,
        console=console,
        echo=typer.echo,
    )


@app.command(name="eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@command
def eval_(
    ctx: typer.Context,
    src: Annotated[Path, typer.Argument(help="A store, or a run dir (its newest intact checkpoint).")],
) -> None:
    """Score a model with lm-evaluation-harness (lm_eval's arguments follow: --tasks, --include_path, ...)."""
    from . import api

    api.evaluate(src, ctx.args)


@app.command()
@command
def profile(
    config: Annotated[
        Path | None, typer.Argument(help="YAML config (default: a built-in tiny model).")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON.")] = None,
    trace: Annotated[Path | None, typer.Option("--trace", help="Write a Chrome/Perfetto trace.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG timeline.")] = None,
) -> None:
    """Measure link bandwidth, per-layer times and how well transfers overlap compute."""
    from . import api

    api.profile(config, json_out=json_out, trace=trace, plot=plot, console=Console())


def _needs_dry_run(machine: bool) -> None:
    """--host-gib/--device-gib and --world-size/--nproc-per-node only plan."""
    from .errors import InputError

    if machine:
        raise InputError("--host-gib/--device-gib plan for another machine: use them with --dry-run")
    raise InputError(
        "--world-size/--nproc-per-node plan a dry run for that many ranks: add --dry-run "
        "(a run takes its world size from torchrun)"
    )


def main() -> None:
    code = 0
    try:
        app()
    except HorizonError as e:  # only with --debug: show the traceback, keep the exit status
        traceback.print_exc()
        code = e.exit_code
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    from .parallel.launch import exit_rank, under_torchrun

    if under_torchrun():  # a rank: no interpreter teardown after its work (parallel.launch.exit_rank)
        exit_rank(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
