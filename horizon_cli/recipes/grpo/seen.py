"""TRL's `num_tokens` (its TrainerState.num_input_tokens_seen) across a resume: the count of prompt +
completion tokens sampled in training up to the step a run resumes from.

It is the `num_tokens` of that step's metrics.jsonl row (rank 0 writes it before the step's
checkpoint); a run logged before the metric existed counts it from its rollouts/step-N.jsonl files
(N <= the step: every batch sampled, one file each) instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def tokens_seen(run_dir: Path, step: int) -> int:
    """Prompt + completion tokens sampled in training steps 1..step of the run in `run_dir`."""
    got = _from_metrics(Path(run_dir) / "metrics.jsonl", step)
    return got if got is not None else _from_rollouts(Path(run_dir) / "rollouts", step)


def _from_metrics(path: Path, step: int) -> int | None:
    if not path.is_file():
        return None
    found = None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line garbled by a crash (train.metrics drops it too)
            continue
        if isinstance(row, dict) and row.get("step") == step and isinstance(row.get("num_tokens"), int):
            found = row["num_tokens"]
    return found


def _from_rollouts(folder: Path, step: int) -> int:
    total = 0
    for f in folder.glob("step-*.jsonl"):
        m = re.fullmatch(r"step-(\d+)\.jsonl", f.name)
        if m is None or int(m.group(1)) > step:
            continue
        for line in f.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            mask = rec.get("tool_mask")  # with rl.tools: the sampled ids only, as TRL counts
            total += len(rec["prompt_ids"]) + (sum(mask) if mask else len(rec["completion_ids"]))
    return total
