"""One step's rollouts: batch_size prompts x num_generations completions sampled by the streamed
engine on the current host weights (generate.decoder: every completion shares each sweep of the
weights), as micro-batches for the loss (recipes.grpo.loss), and written to the run dir.

Sampling is seeded by (train.seed, the step) and each completion's place in the batch (prompt p's
generation j is row p x G + j; model.sample draws each row from a generator of its own), so a
run resumed from a checkpoint samples the rollouts an uninterrupted run samples.

    <output.dir>/rollouts/step-N.jsonl   N the step (from 1), one line per completion, a group's G
                                         lines together: prompt_ids, completion_ids (the sampled
                                         tokens, the EOS included when one was sampled: what the
                                         loss sees), completion (text, with a tokenizer), rewards
                                         (name -> value, null for None), reward, advantage,
                                         truncated (no EOS within max_completion_length),
                                         sampling_logps (a quantized resident sampler's log-prob of
                                         each completion id: recipes.grpo.rollout_engine);
                                         with rl.tools, messages (the completion's assistant and
                                         tool turns) and tool_mask (per id: 0 a tool result's)
    <output.dir>/rollouts/eval-step-N.jsonl  the evaluation after step N: its rollouts, lines alike
                                         (every eval batch's, in order), with the prompt as read
    <output.dir>/rollouts/step-N.pt      num_iterations > 1: the rows and the rollout policy's
                                         (and reference's) log-probs, read back by a run resumed
                                         inside the group of steps that reuse them
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...config.schema import RLConfig
from ...data.batch import IGNORE, MicroBatch
from ...engine import Engine
from ...fsutil import write_text_atomic
from ...generate.decode import Generation
from ...generate.decoder import Completion, Decoder, SweepStats, micro_batches
from ...generate.resident import ResidentLoader
from ...model.sample import Sampler
from .loss import GRPOPayload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SEED_MIX = 0x5851F42D4C957F2D  # the step's sampling seed: (train.seed, step) mixed


@dataclass
class Rollout:
    prompt: int  # the prompt's index in the step's batch
    prompt_ids: list[int]
    ids: list[int]  # completion ids, the EOS included when one was sampled
    text: str | None
    truncated: bool
    media: dict | None = (
        None  # the prompt's image tensors (vision.prompts): in its prefill and every log-prob pass
    )
    sampling: list[float] | None = None  # the sampler's log-prob of each id (a sampler apart: issue 40)
    # rl.tools (recipes.grpo.turns): the completion's messages (assistant and tool turns), per id
    # 1 sampled / 0 a tool result's (no label: no loss, no KL), its tool calls and failed calls
    messages: list[dict] | None = None
    mask: list[int] | None = None
    calls: int = 0
    failures: int = 0


def step_seed(seed: int, step: int) -> int:
    return (seed * SEED_MIX + step + 1) % (1 << 62)


def device_kv(engine: Engine, rows: list[tuple[int, list[int]]], max_new: int, kv: str) -> bool:
    """Whether the batch's KV cache lives on the device: engine.kv_cache, or (auto) when it fits in
    the device's free memory with a quarter to spare; on the CPU the device is host memory."""
    if kv != "auto":
        return kv == "device"
    if engine.t.device.type != "cuda":
        return True
    need = Generation(engine).cache_bytes(
        [(len(g), max(len(p) for _, p in g) + max_new) for g in micro_batches(rows)]
    )
    free, _ = torch.cuda.mem_get_info(engine.t.device)
    # blocks the caching allocator holds but nothing uses (a step's kept-layer graphs, freed after
    # its backward) are free to the cache too, as the dry run plans it (train/report.py)
    free += torch.cuda.memory_reserved(engine.t.device) - torch.cuda.memory_allocated(engine.t.device)
    return need * 4 <= free * 3


def sample(
    engine: Engine,
    prompts: list[list[int]],
    G: int,
    rl: RLConfig,
    seed: int,
    eos: list[int],
    tokenizer: PreTrainedTokenizerBase | None,
    kv: str,
    on_sweep: Callable[[SweepStats], None] = lambda s: None,
    first: int = 0,
    media: list[dict | None] | None = None,
    sampler: Sampler | None = None,
    weights: ResidentLoader | None = None,
    more: Callable[[Completion], list[int]] | None = None,
) -> list[Rollout]:
    """G completions of each prompt, in order (prompt p's generation j at p x G + j). `first`: the
    first prompt's place in the step's whole batch; rows are seeded by their place in it, so a
    slice of the prompts sampled alone gets the completions the whole batch gives it. media: each
    prompt's image tensors (or None), merged at the prefill of each of its G rows; sampler: in
    place of rl's (rl.images: one that never samples the image token); weights: a resident copy's
    (recipes.grpo.rollout_engine), its KV cache on the device; more: the decoder's hook at a
    row's finish (recipes.grpo.turns: tool results appended, the row goes on)."""
    engine.wait()  # the optimizer's queued updates land in the host store first
    rows = [((first + p) * G + j, ids) for p, ids in enumerate(prompts) for j in range(G)]
    media = media or [None] * len(prompts)
    pixels: dict[int, dict] = {}  # the Decoder's: row -> its prompt's tensors
    for r, _ in rows:
        if (m := media[r // G - first]) is not None:
            pixels[r] = m
    dec = Decoder(
        engine,
        sampler or rl_sampler(rl, seed),
        max_new_tokens=rl.max_completion_length,
        eos_ids=eos,
        tokenizer=tokenizer,
        host_kv=weights is None and not device_kv(engine, rows, rl.max_completion_length, kv),
        on_sweep=on_sweep,
        media=pixels,
        weights=weights,
        more=more,
    )
    out = []
    for c in dec.run(rows):
        p = c.index // G - first
        out.append(Rollout(p, prompts[p], list(c.ids), c.text, c.finish != "eos", media[p]))
    return out


def rl_sampler(rl: RLConfig, seed: int) -> Sampler:
    """The rollouts' sampler from rl's settings (every engine's: one place to build it)."""
    return Sampler(rl.temperature, rl.top_p, rl.top_k, seed, rl.min_p, rl.repetition_penalty)


def micro_batches_of(
    rollouts: list[Rollout], adv: torch.Tensor, size: int, pad_id: int, mask_truncated: bool
) -> list[MicroBatch]:
    """Rows prompt + completion, labels on the completion (none for a masked truncated one), the
    advantage of each row and its real row count in its GRPOPayload."""
    out = []
    for a in range(0, len(rollouts), size):
        part = rollouts[a : a + size]
        rows = []
        for r in part:
            lab = [IGNORE] * len(r.ids) if mask_truncated and r.truncated else r.ids
            if r.mask is not None:  # a tool result's ids: no label
                lab = [t if m else IGNORE for t, m in zip(lab, r.mask, strict=True)]
            rows.append((r.prompt_ids + r.ids, [IGNORE] * len(r.prompt_ids) + lab))
        mb = MicroBatch.from_rows(rows, pad_id)
        mb.media = media_of(part)
        mb.payload = GRPOPayload(adv[a : a + size].clone().float(), len(part))
        if part and all(r.sampling is not None for r in part):  # in label order: the labelled rows'
            kept = [_sampled(r) for r in part if not (mask_truncated and r.truncated)]
            mb.payload.sampling = torch.tensor([v for s in kept for v in s], dtype=torch.float32)
        out.append(mb)
    return out


def _sampled(r: Rollout) -> list[float]:
    """The sampler's log-probs of the labelled ids (a tool result's left out)."""
    s = r.sampling or []
    return s if r.mask is None else [v for v, m in zip(s, r.mask, strict=True) if m]


def completions_of(outs: list[Rollout], conversational: bool) -> list:
    """What a reward gets as each completion: text, or for conversational prompts a message list
    (rl.tools: the completion's messages, tool turns included, TRL's)."""
    return [
        o.messages
        if o.messages is not None
        else [{"role": "assistant", "content": o.text or ""}]
        if conversational
        else (o.text or "")
        for o in outs
    ]


def length_metrics(outs: list[Rollout]) -> dict[str, float]:
    """TRL's completions/* metrics; with rl.tools the sampled ids only (tool_mask 1), as TRL counts."""
    lengths = torch.tensor([sum(o.mask) if o.mask else len(o.ids) for o in outs], dtype=torch.float32)
    trunc = torch.tensor([o.truncated for o in outs])
    term = lengths[~trunc]
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": trunc.float().mean().item(),
        "completions/mean_terminated_length": term.mean().item() if term.numel() else 0.0,
        "completions/min_terminated_length": term.min().item() if term.numel() else 0.0,
        "completions/max_terminated_length": term.max().item() if term.numel() else 0.0,
    }


def media_of(rollouts: list[Rollout]) -> dict | None:
    """The rows' image tensors back to back, as the processor batches them (data.collate); None: none."""
    got = [r.media for r in rollouts if r.media]
    return {n: torch.cat([m[n] for m in got]) for n in got[0]} if got else None


def lines(
    rollouts: list[Rollout],
    names: list[str],
    per_func: torch.Tensor,
    reward: torch.Tensor,
    adv: torch.Tensor,
    extra: dict | None = None,
) -> list[str]:
    """A JSONL line per completion; extra: columns the reward functions gave log_extra (and the
    prompt as read), one value per completion."""
    out = []
    for k, r in enumerate(rollouts):
        rec = {
            "prompt_ids": r.prompt_ids,
            "completion_ids": r.ids,
            **({"completion": r.text} if r.text is not None else {}),
            "rewards": {n: _num(per_func[k, i]) for i, n in enumerate(names)},
            "reward": _num(reward[k]),
            "advantage": float(adv[k]),
            "truncated": r.truncated,
            **({"sampling_logps": r.sampling} if r.sampling is not None else {}),
            **({"messages": r.messages, "tool_mask": r.mask} if r.messages is not None else {}),
            **{c: v[k] for c, v in (extra or {}).items() if k < len(v)},
        }
        out.append(json.dumps(rec, ensure_ascii=False) + "\n")
    return out


def write(run_dir: Path, name: str, lines: list[str]) -> Path:
    """rollouts/<name>.jsonl (step-N, eval-step-N), written whole or not at all."""
    path = Path(run_dir) / "rollouts" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(lines))
    return path


def save_group(run_dir: Path, step: int, state: dict) -> None:
    """rollouts/step-N.pt: what the later steps of a num_iterations group reuse."""
    path = Path(run_dir) / "rollouts" / f"step-{step + 1}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_group(run_dir: Path, step: int) -> dict | None:
    path = Path(run_dir) / "rollouts" / f"step-{step + 1}.pt"
    if not path.is_file():
        return None
    got = torch.load(path, weights_only=False)
    for mb in got["mbs"]:
        _typed(mb)
    return got


def _typed(mb: MicroBatch) -> None:
    """A micro-batch saved before the typed payloads (an `extras` dict keyed "adv", "rows", "old",
    "ref") gets its GRPOPayload, so a run resumed inside a group across the upgrade goes on."""
    extras = vars(mb).pop("extras", None)
    if mb.payload is None and extras:
        rows = extras["rows"]
        mb.payload = GRPOPayload(extras["adv"].float(), int(rows), extras.get("old"), extras.get("ref"))


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if v != v else v


def speed(stats: list[SweepStats]) -> float:
    """Rollout tokens per second over a step's decode sweeps (prefill left out)."""
    dec = [s for s in stats if not s.prefill]
    secs = sum(s.seconds for s in dec)
    return sum(s.tokens for s in dec) / secs if secs else 0.0
