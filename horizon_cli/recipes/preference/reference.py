"""The reference of a preference run (dpo, cdpo, ipo; kto: each example's completion and mismatched one): every pair's chosen and rejected log-prob under the
initial weights, computed once before step 1 by streamed forward-only sweeps (engine.Engine.sequence_logps: each layer loaded once per train.batch_size
pairs, not once per pair), kept in the run dir and reused on resume.

    <run>/reference/train.npy   (pairs, 2) float32: chosen, rejected, in the training pairs' order
    <run>/reference/eval.npy    the same for the held-out pairs (when there are)
    <run>/reference/meta.json   per file its CRC32 and shape; what the numbers belong to: the pairs'
                                fingerprint (data.pairs.PairSet.fingerprint), the model's, the
                                compute dtype, the policy it is (below)

LoRA: fresh adapters start at B = 0, so the initial weights are the base: the pass runs with the
adapters off (the base alone, no adapter work). Adapters started from `lora.init` are the initial
policy with them on, as TRL's DPOTrainer copies a given adapter into its "ref" adapter.

Written with `fsutil.atomic_dir` (rank 0), so a crash leaves no half reference. A resumed run
reads it back; one whose reference is missing, damaged or made for other pairs is refused (the
initial weights are gone: a checkpoint's are not the reference), except with fresh LoRA adapters,
whose reference, the base, never changes: it is recomputed.
"""

from __future__ import annotations

import io
import json
import math
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ...config import Config
from ...config.schema import REFERENCED
from ...data import PreparedData
from ...data.batch import IGNORE, MicroBatch
from ...data.pairs import PairSet, collate_pairs
from ...data.prepare import unit_of
from ...engine.engine import Engine
from ...errors import InputError
from ...faults import phase
from ...fsutil import atomic_dir, read_json


def reference(
    engine: Engine,
    data: PreparedData,
    cfg: Config,
    run_dir: Path,
    console: Console,
    fresh: bool,
    model_fp: str,
    main: bool,
) -> dict[str, np.ndarray]:
    """The reference log-probs of the training pairs ("train") and the held-out ones ("eval"):
    read back, or computed (fresh: before step 1; main: this rank writes the run dir)."""
    sets = _pair_sets(data)
    where = Path(run_dir) / "reference"
    base = engine.tuning.reference_on_base  # fresh adapters: the initial policy is the base
    meta = {
        "model": model_fp,
        "dtype": cfg.engine.dtype,
        "policy": "base (adapters off)" if base else "initial weights",
        "pairs": {k: s.fingerprint() for k, s in sets.items()},
    }
    found, why = load(where, meta)
    if found is not None:
        unit = unit_of(next(iter(sets.values())))  # KTO: examples
        console.print(f"reference: {where} ({_count(found)} {unit}, reused)", highlight=False)
        return found
    if not fresh and not base:
        raise InputError(
            f"output.dir: {where} {why}; a resumed run cannot rebuild it (the reference is the initial "
            "weights, not a checkpoint's): restore it, or start again in another output.dir"
        )
    if not fresh:
        console.print(f"[yellow]note:[/] {where} {why}; recomputing it from the base (adapters off)")
    phase("reference")
    out = {k: compute(engine, s, cfg, data.pad_id, console, k, not base) for k, s in sets.items()}
    if main:
        save(where, out, meta)
        phase("reference-saved")
    return out


def _pair_sets(data: PreparedData) -> dict[str, PairSet]:
    """The training pairs ("train") and the held-out ones ("eval", when there are any)."""
    sets = {"train": data.train, **({"eval": data.eval} if data.eval is not None else {})}
    pairs = {k: s for k, s in sets.items() if isinstance(s, PairSet)}
    assert len(pairs) == len(sets), "a preference run trains on pairs"
    return pairs


def compute(
    engine: Engine,
    pairs: PairSet,
    cfg: Config,
    pad_id: int,
    console: Console,
    name: str,
    adapters: bool = True,
) -> np.ndarray:
    """(pairs, 2) float32: forward-only sweeps over train.batch_size pairs at a time, each rank its
    share of every sweep's micro-batches, the results summed over the ranks."""
    t, world, rank = cfg.train, *_ranks(engine)
    out = np.zeros((len(pairs), 2), dtype=np.float32)
    cols = (
        TextColumn("[bold]reference"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit_of(pairs)),  # KTO: examples
        TimeRemainingColumn(),
    )
    with Progress(*cols, console=console, transient=False) as prog:
        task = prog.add_task(name, total=len(pairs))
        for a in range(0, len(pairs), t.batch_size):
            idx = np.arange(a, min(len(pairs), a + t.batch_size))
            mbs = collate_pairs(pairs.rows(idx), t.micro_batch_size, pad_id)
            per = math.ceil(len(mbs) / world)
            mine = list(range(rank, len(mbs), world))
            todo = [mbs[i] for i in mine] + [_unlabelled(mbs[0])] * (per - len(mine))
            vec = torch.zeros(2 * len(idx), dtype=torch.float32)
            rows = 2 * t.micro_batch_size
            for i, lp in zip(mine, engine.sequence_logps(todo, adapters), strict=False):
                vec[i * rows : i * rows + lp.numel()] = lp
            out[idx] = engine.sum_over_ranks(vec).numpy().reshape(-1, 2)
            prog.advance(task, len(idx))
    return out


def load(where: Path, meta: dict) -> tuple[dict[str, np.ndarray] | None, str]:
    """(the arrays, "") when `where` holds a reference for exactly `meta`, else (None, why not)."""
    if not (where / "meta.json").is_file():
        return None, "does not exist"
    try:
        got = read_json(where / "meta.json")
    except InputError:
        return None, "has an unreadable meta.json"
    for k in ("model", "dtype", "policy", "pairs"):
        if got.get(k) != meta[k]:
            return None, f"was computed for other {'data' if k == 'pairs' else k} ({k} differs)"
    out = {}
    for name, info in got.get("files", {}).items():
        path = where / f"{name}.npy"
        try:
            raw = path.read_bytes()
        except OSError:
            return None, f"lacks {path.name}"
        if zlib.crc32(raw) != info.get("crc32"):
            return None, f"is damaged ({path.name} fails its checksum)"
        out[name] = np.load(io.BytesIO(raw))
    if set(out) != set(meta["pairs"]):
        return None, "lacks a set"
    return out, ""


def save(where: Path, arrays: dict[str, np.ndarray], meta: dict) -> None:
    files = {}
    with atomic_dir(where, force=True) as tmp:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            np.save(buf, arr.astype(np.float32))
            raw = buf.getvalue()
            (tmp / f"{name}.npy").write_bytes(raw)
            files[name] = {"crc32": zlib.crc32(raw), "shape": list(arr.shape)}
        (tmp / "meta.json").write_text(json.dumps({**meta, "files": files}, indent=1) + "\n")


def reference_plan(cfg: Config, data: PreparedData | None, layers: int) -> dict | None:
    """What the reference pass will cost (the dry run's plan): None without one (SFT, simpo, orpo).
    A sweep loads each layer once and runs the forward only: a training step loads it twice and
    computes about four forwards' worth (forward, recompute, backward), so a sweep costs about a
    half to a quarter of a step, whichever of the link and the compute bounds the run."""
    if cfg.preference is None or cfg.preference.loss not in (*REFERENCED, "kto"):
        return None
    out: dict = {"pairs": None, "sweeps": None, "layer_loads": None, "step_equivalents": None}
    unit = "examples" if cfg.preference.loss == "kto" else "pairs"  # kto: two sequences each, as a pair
    if data is not None:
        pairs = len(data.train) + (len(data.eval) if data.eval is not None else 0)
        n = math.ceil(len(data.train) / cfg.train.batch_size)
        n += math.ceil(len(data.eval) / cfg.train.batch_size) if data.eval is not None else 0
        out.update(pairs=pairs, sweeps=n, layer_loads=n * layers, step_equivalents=[n / 4, n / 2])
        text = (
            f"reference pass: {pairs:,} {unit} in {n:,} forward-only sweeps of the layers (each layer loaded "
            f"{n:,} times), about {n / 4:,.1f} to {n / 2:,.1f} training steps' time; kept in "
            f"{cfg.output.dir}/reference"
        )
    else:
        text = f"reference pass: one forward-only sweep per train.batch_size {unit} (the data is not tokenized here)"
    return out | {"text": text}


def _count(arrays: dict[str, np.ndarray]) -> int:
    return sum(len(a) for a in arrays.values())


def _ranks(engine: Engine) -> tuple[int, int]:
    return engine.ranks.world, engine.ranks.rank


def _unlabelled(mb: MicroBatch) -> MicroBatch:
    """A rank short of a micro-batch runs a copy without labels (every rank must sweep alike)."""
    return replace(mb, labels=torch.full_like(mb.labels, IGNORE), payload=None)
