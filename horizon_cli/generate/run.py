"""`horizon generate`: flags and prompts checked -> source -> plan (shown) -> engine -> batches -> output.

Everything that can be wrong with the input is found before a weight is loaded (exit 2, one
line): the flags, SRC, the prompts file and every prompt (tokenizer present, length within the
model's positions; --stop needs a tokenizer), the output file, and the plan against the device.
A --max-new-tokens the model's positions cannot hold after a prompt is said in one note line. The output is written at
the end, atomically; without --output each completion prints as it finishes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from .. import preflight
from ..config.schema import OptimConfig
from ..data.prompts import Prompt, encode, read_records
from ..engine import Engine
from ..errors import InputError
from ..fsutil import write_text_atomic
from ..model.sample import Sampler
from ..progress import byte_progress
from ..runtime.device import check_device
from ..vision.prompts import image_prompts
from ..vision.run import vision_stage
from .budget import GenPlan
from .decoder import Completion, Decoder, SweepStats
from .model_source import Source, open_source
from .plan import plan_batches, plan_table


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    batch_size: int = 32

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens: {self.max_new_tokens}; give at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InputError(f"--temperature: {self.temperature}; give 0 (greedy) or a positive number")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InputError(f"--top-p: {self.top_p}; give a number in (0, 1]")
        if self.top_k < 0:
            raise InputError(f"--top-k: {self.top_k}; give 0 (off) or a positive number")
        if self.batch_size < 1:
            raise InputError(f"--batch-size: {self.batch_size}; give at least 1")
        if self.temperature == 0 and (self.top_p < 1 or self.top_k):
            raise InputError("--top-p/--top-k shape sampling: give a --temperature above 0 with them")


def run_generate(
    src: str | Path,
    prompts_file: str | Path | None,
    prompts: list[str],
    settings: Settings,
    output: Path | None,
    console: Console,
    engine: dict | None = None,
    echo=None,
) -> list[dict]:
    """The output records, in input order. echo(line): where completions print as they finish
    when there is no output file (default: the console)."""
    settings.check()
    if (prompts_file is None) == (not prompts):
        raise InputError("give the prompts: --prompts FILE or --prompt TEXT (one of the two)")
    preflight.check_output_file(output, "--output")
    source = open_source(src, engine)
    check_device(source.engine)
    tokenizer = source.tokenizer()
    if prompts_file is not None:
        records = read_records(prompts_file)
    else:
        records = [({"prompt": t}, f"--prompt {i + 1}") for i, t in enumerate(prompts)]
    spec = source.store.arch
    if settings.stop and tokenizer is None:  # stop strings are found in the decoded text
        raise InputError(
            f"--stop: stop strings are matched on the decoded text, and {source.store.root} has no "
            "tokenizer files (a row still stops at an EOS id or its token limit)"
        )
    base = Path(prompts_file).parent if prompts_file is not None else Path.cwd()
    pics = image_prompts(source.store, records, base, 768 * 768, 32 * 32)  # with images: the processor's
    plain = [({"input_ids": pics[k][0]}, at) if k in pics else (r, at) for k, (r, at) in enumerate(records)]
    items = encode(plain, tokenizer, spec.vocab, spec.max_positions, str(source.store.root))
    for k in pics:
        items[k] = Prompt(records[k][0], items[k].ids, records[k][1])
    note = positions_note(items, settings.max_new_tokens, spec.max_positions)
    if note:
        console.print(f"note: {note}", highlight=False, markup=False)
    tower = tower_rows(source, pics, len(items), settings.batch_size)
    plan = plan_batches(source, [p.ids for p in items], settings.max_new_tokens, settings.batch_size, tower)
    console.print(f"generate: {len(items)} prompt(s) on {source.describe()}", highlight=False)
    console.print(plan_table(plan))
    eng = build(source, console, bool(pics))
    try:
        media = {k: m for k, (_, m) in pics.items()}
        rows = generate_all(eng, source, items, settings, plan, tokenizer, console, output, echo, media)
    finally:
        eng.close()
    if output is not None:
        write_text_atomic(output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        console.print(f"[green]wrote[/] {len(rows)} completion(s) to {output}", highlight=False)
    return rows


def tower_rows(source: Source, pics: dict, n: int, batch_size: int) -> dict[str, int] | None:
    """The vision tower's rows of the plan for the batch whose images are the largest (None: no
    prompt with images)."""
    if not pics:
        return None
    from ..vision.plan import generation_bytes

    batches = [
        [pics[k][1] for k in range(a, min(n, a + batch_size)) if k in pics] for a in range(0, n, batch_size)
    ]
    widest = max(batches, key=lambda ms: sum(v.numel() for m in ms for v in m.values()))
    return generation_bytes(source.store, widest, getattr(torch, source.engine.dtype))


def positions_note(items: list[Prompt], max_new: int, positions: int) -> str:
    """What a --max-new-tokens beyond the model's positions does ("" when every prompt has room):
    a row stops at the model's last position, finish_reason length."""
    short = [p for p in items if positions - len(p.ids) < max_new]
    if not short:
        return ""
    longest = max(short, key=lambda p: len(p.ids))
    return (
        f"--max-new-tokens {max_new} is more than the model's {positions} positions leave after "
        f"{len(short)} of the {len(items)} prompt(s) (the longest, {longest.where}, leaves "
        f"{positions - len(longest.ids)}): those stop at the last position (finish_reason length)"
    )


def build(source: Source, console: Console, images: bool = False) -> Engine:
    """The forward-only engine on the source (a LoRA run's adapters applied; images: the vision
    tower's merge in front of layer 0, vision.embed, with a LoRA run's projector adapters)."""
    if source.engine.compute_threads:
        torch.set_num_threads(source.engine.compute_threads)
    lora = source.lora
    mode = ("projector", lora) if lora is not None and lora.tower else ("frozen", None)  # its adapters on
    with byte_progress(console, "load weights", source.store.nbytes()) as advance:
        return Engine(
            source.store,
            source.engine,
            OptimConfig(),
            progress=advance,
            lora=lora,
            forward_only=True,
            stage=vision_stage(source.store, *mode) if images else None,
        )


def generate_all(
    eng,
    source,
    items: list[Prompt],
    settings: Settings,
    plan: GenPlan,
    tokenizer,
    console,
    output,
    echo,
    media=None,
) -> list[dict]:
    """Every batch of prompts through the decoder, with progress; the output records."""
    say = echo or (lambda line: console.print(line, highlight=False, markup=False))
    done: list[Completion] = []
    speed = _Speed(plan)

    def finished(c: Completion) -> None:
        done.append(c)
        if output is None:
            text = c.text if c.text is not None else json.dumps(c.ids)
            say(f"--- {items[c.index].where} ({c.finish}, {len(c.ids)} tokens)\n{text}")

    def swept(s: SweepStats) -> None:
        speed.add(s)
        status.update(f"generate: {len(done)}/{len(items)} done, {speed.text()}")

    decoder = Decoder(
        eng,
        Sampler(settings.temperature, settings.top_p, settings.top_k, settings.seed),
        max_new_tokens=settings.max_new_tokens,
        eos_ids=source.eos_ids(),
        tokenizer=tokenizer,
        stops=list(settings.stop),
        host_kv=plan.kv_where == "host",
        on_done=finished,
        on_sweep=swept,
        media=media,
    )
    results: list[Completion] = []
    with console.status("generate: prefill") as status:
        for a in range(0, len(items), settings.batch_size):
            batch = [(i, items[i].ids) for i in range(a, min(len(items), a + settings.batch_size))]
            results += decoder.run(batch)
    console.print(f"generate: {len(items)} done, {speed.text()}", highlight=False)
    return [_record(items[c.index], c, tokenizer is not None) for c in results]


def _record(p: Prompt, c: Completion, text: bool) -> dict:
    out = dict(p.record)
    if text:
        out["completion"] = c.text
    out["completion_ids"] = c.ids
    out["finish_reason"] = c.finish
    return out


class _Speed:
    """Decode and prefill speeds so far, and the link bound of the sweeps that ran."""

    def __init__(self, plan: GenPlan):
        self.plan = plan
        self.decode = [0, 0.0, 0]  # tokens, seconds, sweeps
        self.prefill = [0, 0.0]
        self.t0 = time.perf_counter()

    def add(self, s: SweepStats) -> None:
        if s.prefill:
            self.prefill[0] += s.tokens
            self.prefill[1] += s.seconds
        else:
            self.decode[0] += s.tokens
            self.decode[1] += s.seconds
            self.decode[2] += 1

    def text(self) -> str:
        parts = []
        if self.prefill[1]:
            parts.append(f"prefill {self.prefill[0] / self.prefill[1]:,.0f} tok/s")
        tok, sec, sweeps = self.decode
        if sec:
            parts.append(f"decode {tok / sec:,.1f} tok/s")
            if self.plan.sweep_s:
                bound = tok / (sweeps * self.plan.sweep_s)
                parts.append(f"link bound {bound:,.1f} tok/s at {self.plan.link_gbps:g} GB/s")
        return ", ".join(parts) or "prefill"
