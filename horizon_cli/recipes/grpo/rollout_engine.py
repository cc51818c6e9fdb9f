"""Where an rl run's rollouts decode (rl.rollout_engine, rl.rollout_weights), chosen once:

    streamed   the engine's own sweep (generate.decoder): every layer crosses the link in each
               decode sweep, from the trained host weights themselves
    resident   a weight-only copy of the policy on the device (generate.resident), refreshed from
               the host weights at each step's rollouts (the link carries the model once), its KV
               cache on the device, the memory handed back before the training step. With a
               narrowed copy (fp8, int8, nf4) the sampler is not the trained policy: each
               completion records the sampler's log-prob of each id (log_softmax(logits / T), as
               the trained policy's are scored: recipes.grpo.logps), and TRL's importance-sampling
               correction applies (recipes.grpo.sampling). full: the same weights, the same
               rollouts as streamed, nothing recorded

`choose` decides from sizes alone, so the dry run (recipes.grpo.plan) and the run agree: auto
takes resident with the widest format (full, fp8, nf4) whose copy and KV cache fit the device's
budget (a tenth spare for the decode's working set; on the CPU the device is host memory:
always), else streamed. A LoRA run, a sharded engine and engine.kv_cache: host stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...config.schema import RLConfig
from ...engine import Engine
from ...errors import InputError
from ...fmt import fmt_bytes
from ...generate.decode import Generation
from ...generate.decoder import micro_batches
from ...generate.resident import ResidentCopy, copy_units
from ...model.sample import Sampler
from ...quant.weight_only import packed_nbytes
from . import rollouts as ro

AUTO_FORMATS = ("full", "fp8", "nf4")  # auto's order: the widest that fits


@dataclass(frozen=True)
class Choice:
    engine: str  # resident | streamed
    weights: str  # the copy's format (streamed: full, the trained weights)
    why: str


def choose(
    rl: RLConfig,
    blocker: str | None,
    copy_bytes: Callable[[str], int],
    kv_bytes: int,
    budget: int | None,
) -> Choice:
    """blocker: why this run cannot hold a copy (None: it can); copy_bytes(fmt): the copy's
    device bytes; budget: the device bytes free for the copy and the cache (None: the CPU)."""
    if rl.rollout_engine == "streamed":
        return Choice("streamed", "full", "rl.rollout_engine: streamed")
    if blocker is not None:
        if rl.rollout_engine == "resident":
            raise InputError(f"rl.rollout_engine: resident: {blocker}; set streamed (or auto)")
        return Choice("streamed", "full", f"auto: {blocker}")
    fmts = AUTO_FORMATS if rl.rollout_weights == "auto" else (rl.rollout_weights,)
    for f in fmts:
        need = copy_bytes(f) + kv_bytes
        if budget is None or need * 10 <= budget * 9:  # a tenth spare: the decode's working set
            where = "host memory is the device" if budget is None else f"of {fmt_bytes(budget)} free"
            return Choice(
                "resident",
                f,
                f"{rl.rollout_engine}: the {f} copy ({fmt_bytes(copy_bytes(f))}) and the KV cache "
                f"({fmt_bytes(kv_bytes)}) fit ({where})",
            )
    f = fmts[-1]
    said = (
        f"the {f} copy ({fmt_bytes(copy_bytes(f))}) and the KV cache ({fmt_bytes(kv_bytes)}) need "
        f"more than 9/10 of the device's {fmt_bytes(budget or 0)} free"
    )
    if rl.rollout_engine == "resident":
        raise InputError(f"rl.rollout_engine: resident: {said}; set rollout_weights narrower, or streamed")
    return Choice("streamed", "full", f"auto: {said}")


def blocker_of(lora: bool, world: int, kv_cache: str) -> str | None:
    if lora:
        return "a LoRA run's rollouts stream its frozen base and adapters"
    if world > 1:
        return "a sharded engine's ranks each hold a slice of every layer"
    if kv_cache == "host":
        return "engine.kv_cache: host (a resident copy decodes with its cache on the device)"
    return None


def engine_copy_bytes(engine: Engine, fmt: str) -> int:
    """A copy of this engine's weights in `fmt` on its device: the units' tensors, narrowed layers
    (the head as streamed), and a narrowed copy's one dequantized layer."""
    host, total, largest = engine.p.loader.host, 0, 0
    for u in copy_units(engine):
        st = host[u]
        flat = st.stream.numel() * st.stream.element_size()
        if fmt == "full" or not u.startswith("layer."):  # the stream as it is, padding included
            total += flat
        else:
            views = st.views(st.stream)
            total += sum(packed_nbytes(tuple(v.shape), fmt, v.element_size()) for v in views.values())
            largest = max(largest, flat)
    return total + largest


class RecordingSampler(Sampler):
    """A sampler that also keeps, per row, the log-prob of each id it picks under the scores it
    drew from (temperature, repetition penalty, top-k, top-p, min-p applied: the inner sampler's
    `scores`), fp32: vLLM's processed_logprobs, which TRL's importance-sampling correction asks
    for; a tool result's place holds 0.0, as TRL's."""

    def __init__(self, inner: Sampler):
        self.inner = inner
        self.logps: dict[int, list[float]] = {}

    def begin(self, row: int, prompt: list[int]) -> None:
        self.inner.begin(row, prompt)
        self.logps[row] = []

    def pick(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        scores = self.inner.scores(logits.float(), rows)  # before the pick joins the row's ids
        tok = self.inner.pick(logits, rows)
        lp = torch.log_softmax(scores, dim=-1).gather(1, tok.reshape(-1, 1))
        for r, v in zip(rows, lp.reshape(-1).tolist(), strict=True):
            self.logps[r].append(v)
        return tok

    def forget(self, row: int) -> None:
        self.inner.forget(row)

    def replace_last(self, row: int, token: int) -> None:
        """An id fed in (a tool result's, generate.decoder): the inner sampler's history takes it;
        its log-prob is 0.0, as TRL writes one (the loss never reads it: tool_mask 0)."""
        self.inner.replace_last(row, token)
        self.logps[row][-1] = 0.0


class Rollouts:
    """One run's rollout engine: `sample` as recipes.grpo.rollouts.sample, on the chosen engine."""

    def __init__(self, rl: RLConfig, engine: Engine, lora: bool, kv_cache: str, rows: int, longest: int):
        """rows: a step's completions; longest: the longest prompt (the cache they need)."""
        self.rl, self.engine, self.kv_cache = rl, engine, kv_cache
        self.rows, self.longest = rows, longest
        self.blocker = blocker_of(lora, engine.ranks.world, kv_cache)
        self.choice: Choice | None = None
        self.refresh_s = 0.0
        self.refresh_bytes = 0

    def decide(self) -> Choice:
        """Once: rows x (the longest prompt + max_completion_length) of KV cache beside the copy."""
        if self.choice is None:
            e, rl = self.engine, self.rl
            pos = self.longest + rl.max_completion_length
            groups = micro_batches([(i, [0] * self.longest) for i in range(self.rows)])
            kv = 0 if self.blocker else Generation(e).cache_bytes([(len(g), pos) for g in groups])
            self.choice = choose(rl, self.blocker, lambda f: engine_copy_bytes(e, f), kv, device_budget(e))
        return self.choice

    def sample(
        self, prompts: list[list[int]], G: int, seed: int, sampler: Sampler | None, **kw: Any
    ) -> list[ro.Rollout]:
        """kw: recipes.grpo.rollouts.sample's (eos, tokenizer, on_sweep, first, media)."""
        rl, e = self.rl, self.engine
        c = self.decide()
        if c.engine == "streamed":
            return ro.sample(e, prompts, G, rl, seed, kv=self.kv_cache, sampler=sampler, **kw)
        base = sampler or ro.rl_sampler(rl, seed)
        rec = RecordingSampler(base) if c.weights != "full" else None
        with ResidentCopy.refresh(e, c.weights) as copy:
            self.refresh_s, self.refresh_bytes = copy.refresh_s, copy.refresh_bytes
            outs = ro.sample(
                e, prompts, G, rl, seed, kv="device", sampler=rec or base, weights=copy.loader(), **kw
            )
        if rec is not None:  # out k is row (first + k // G) x G + k % G (rollouts.sample's order)
            first = kw.get("first", 0)
            for k, o in enumerate(outs):
                o.sampling = rec.logps[(first + k // G) * G + k % G][: len(o.ids)]
        return outs


def device_budget(engine: Engine) -> int | None:
    """Device bytes free for a copy and its cache (None: the CPU, whose device is host memory):
    free memory plus what the caching allocator holds unused (a step's freed graphs)."""
    dev = engine.t.device
    if dev.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(dev)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
