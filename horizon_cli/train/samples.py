"""Eval-time samples: at each evaluation (every `train.eval_every` steps; at the last step when that
is 0) the training engine answers `train.samples`' prompts greedily (at most `train.sample_tokens`
new tokens, generate.decoder), the answers go to `<output.dir>/samples.jsonl` (step, prompt,
completion) and are shown after the eval line, so a user sees the model change as it trains.

The prompts file is read and tokenized before anything is loaded (run.py), as any input: a bad one
stops the start with one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ..config import Config
from ..data.prompts import Prompt, encode, model_eos_ids, read_records
from ..engine import Engine
from ..errors import InputError
from ..generate.decoder import Decoder
from ..model.sample import Sampler
from .inputs import load_tokenizer
from .metrics import io_failure

FILE = "samples.jsonl"
BATCH = 32  # prompts per sweep of the weights


class Samples:
    def __init__(self, cfg: Config, store, world: int = 1):
        """store: the model the run starts from (its tokenizer and EOS ids)."""
        path = cfg.train.samples
        assert path is not None
        if world > 1:
            raise InputError("train.samples: eval-time samples are not supported in sharded runs yet")
        self.tokens, self.kv_host = cfg.train.sample_tokens, cfg.engine.kv_cache == "host"
        self.tokenizer = load_tokenizer(store, "auto")
        hf = getattr(store, "hf_dir", None) or store.root / "hf"
        self.eos = model_eos_ids(hf)
        records = read_records(path, "train.samples")
        self.prompts: list[Prompt] = encode(
            records, self.tokenizer, store.arch.vocab, store.arch.max_positions, str(store.root)
        )

    def answer(self, engine: Engine, step: int) -> list[dict]:
        """The engine's greedy answers at this step (its host state current: engine.wait() first)."""
        engine.wait()
        dec = Decoder(
            engine,
            Sampler(),
            max_new_tokens=self.tokens,
            eos_ids=self.eos,
            tokenizer=self.tokenizer,
            host_kv=self.kv_host,
        )
        rows = []
        for a in range(0, len(self.prompts), BATCH):
            batch = [(i, self.prompts[i].ids) for i in range(a, min(len(self.prompts), a + BATCH))]
            for c in dec.run(batch):
                rec = self.prompts[c.index].record
                prompt = next(rec[k] for k in ("prompt", "messages", "input_ids") if k in rec)
                row = {"step": step, "prompt": prompt, "completion": c.text, "completion_ids": c.ids}
                rows.append(row)
        return rows

    @staticmethod
    def write(run_dir: Path, rows: list[dict]) -> None:
        path = Path(run_dir) / FILE
        with io_failure(path), open(path, "a") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    @staticmethod
    def show(console: Console, rows: list[dict]) -> None:
        for r in rows:
            prompt = (
                r["prompt"] if isinstance(r["prompt"], str) else json.dumps(r["prompt"], ensure_ascii=False)
            )
            # one line each: the answer quoted, its newlines escaped
            out = r["completion"] if r["completion"] is not None else r["completion_ids"]
            answer = json.dumps(out, ensure_ascii=False)
            console.print(
                f"  [dim]sample[/] {escape(prompt[:80])} [dim]->[/] {escape(answer)}", highlight=False
            )


def keep_until(run_dir: Path, step: int) -> None:
    """On resume: drop the samples of steps after the checkpoint's (they will be answered again)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, AttributeError):
            continue
    from ..fsutil import write_text_atomic

    with io_failure(path):
        write_text_atomic(path, "".join(kept))
