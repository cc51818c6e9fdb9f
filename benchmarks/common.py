"""Shared pieces of the peer benchmarks (benchmarks/bench_peers.py, benchmarks/bench_scale.py).

A peer runs in its own process: `python benchmarks/<peer>_peer.py JOB.json`. The job names the
model (an HF checkpoint dir, and a horizon store of it), the token rows, dtype, steps, threads and
AdamW settings; the peer writes RESULT.json with per-step losses, grad norms, step times and
non-padding tokens, plus RSS readings. The parent (runner.py) adds the whole-process peak RSS.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Llama shapes of the benchmark (issue E). Untied embeddings, multi-head attention, SwiGLU.
SHAPES: dict[str, dict] = {
    "30m": dict(hidden=512, layers=8, vocab=8192, intermediate=1376, heads=8),
    "120m": dict(hidden=768, layers=12, vocab=32000, intermediate=2048, heads=12),
}


def llama_config(shape: dict, seq: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape.get("kv_heads", shape["heads"]),
        max_position_embeddings=max(seq, 256),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def param_count(shape: dict) -> int:
    h, i, v, n = shape["hidden"], shape["intermediate"], shape["vocab"], shape["layers"]
    kv = h * shape.get("kv_heads", shape["heads"]) // shape["heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o, k, v, mlp, two norms
    return n * layer + 2 * v * h + h  # + embed, lm_head, final norm


def make_rows(n: int, seq: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n rows of `seq` tokens from a fixed random bigram "language": 4 successors per token, drawn
    Zipf-like so a few tokens are frequent. The loss falls within a few steps (the unigram is
    quick to learn), which makes the per-step loss curves of the peers worth comparing."""
    g = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, vocab + 1)
    succ = g.choice(vocab, size=(vocab, 4), p=zipf / zipf.sum())  # (V, 4)
    rows = []
    for _ in range(n):
        t = np.empty(seq, dtype=np.int64)
        t[0] = g.integers(0, vocab)
        pick = g.integers(0, 4, size=seq)
        for j in range(1, seq):
            t[j] = succ[t[j - 1], pick[j]]
        rows.append(t.tolist())
    return rows


def write_rows(rows: list[list[int]], path: Path) -> None:
    """Token rows as the `tokens` jsonl format horizon reads (input_ids only, labels = inputs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    tmp.replace(path)


def read_rows(path: Path) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for line in Path(path).read_text().splitlines() if line]


def step_batches(rows: list[list[int]], steps: int, batch: int, micro: int):
    """Step s takes rows [s*batch, (s+1)*batch) in file order (horizon's shuffle: false), wrapping;
    -> per step, a list of (micro, T) int64 tensors. Every row has the same length: no padding."""
    import torch

    out = []
    for s in range(steps):
        idx = [(s * batch + k) % len(rows) for k in range(batch)]
        ids = torch.tensor([rows[i] for i in idx], dtype=torch.int64)  # (batch, T)
        out.append(list(ids.split(micro)))
    return out


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class RssSampler:
    """Peak RSS of this process over a window, sampled every `period` s on a daemon thread."""

    def __init__(self, period: float = 0.01):
        import psutil

        self.proc, self.period = psutil.Process(), period
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.period)

    def __enter__(self) -> RssSampler:
        self.peak = rss()
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def peer_main(run: Callable[[dict], dict]) -> None:
    """Entry point of a peer process: JOB.json in argv[1]; writes job['out'] with run(job)'s result
    (or ok=false and the error), exit 0 either way so the parent can read why."""
    job = json.loads(Path(sys.argv[1]).read_text())
    import torch

    torch.set_num_threads(job["threads"])
    torch.manual_seed(job.get("seed", 0))
    res: dict = {"peer": job["peer"], "dtype": job["dtype"], "threads": torch.get_num_threads()}
    res["rss_baseline"] = rss()  # interpreter + torch (+ the peer's imports so far)
    t0 = time.perf_counter()
    try:
        res.update(run(job))
        res["ok"] = True
    except Exception as e:  # a combination that does not run: record why instead of faking it
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        res["traceback"] = traceback.format_exc()[-4000:]
    res["wall_s"] = time.perf_counter() - t0
    out = Path(job["out"])
    out.write_text(json.dumps(res, indent=1))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (DeepSpeed/gloo atexit hooks can hang)


def timed_steps(step: Callable[[list], tuple[float, float]], batches: list) -> dict:
    """Run step(micro_batches) -> (loss, grad_norm) per batch, timing each; the RSS sampler covers
    the training steps only."""
    losses, norms, times, tokens = [], [], [], []
    with RssSampler() as s:
        for mbs in batches:
            t0 = time.perf_counter()
            loss, norm = step(mbs)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            norms.append(norm)
            tokens.append(int(sum(m.numel() for m in mbs)))
    return {
        "losses": losses,
        "grad_norms": norms,
        "step_s": times,
        "tokens": tokens,
        "rss_train_peak": s.peak,
    }
