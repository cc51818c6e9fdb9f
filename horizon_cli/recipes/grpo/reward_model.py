"""A reward model as a reward (`rl.rewards[i].model: STORE`), scored as TRL 1.16's GRPOTrainer scores
a sequence-classification model in its `reward_funcs`:

    text     conversational prompts: the reward model's own chat template over prompt + completion
             messages (data.chat_template_kwargs applied, as TRL passes its chat_template_kwargs);
             else prompt text + completion text (a prompt given as ids: decoded with the policy's
             tokenizer, without special tokens, as completions are)
    tokens   the reward model's tokenizer, no special tokens added
    value    the score (label 0) at the last token of each row that is not the pad id (the reward
             tokenizer's pad token, its EOS when it has none, as TRL sets the model's
             pad_token_id), taken after the final norm: score.weight @ h (+ its bias)

The store is `horizon convert` of an `XForSequenceClassification` checkpoint (arch.reward): the
decoder streams as the policy's and the reference's do, a forward-only engine on its own store,
each layer over the link once per step for all the batch's completions, in micro-batches of
train.micro_batch_size rows (the rows cut after their last scored token: the causal model's
state there does not see what follows). Under torchrun the model is sharded like the reference
and the ranks score an even share of the micro-batches, the results gathered (recipes.grpo.batches).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...config.schema import DataConfig, EngineConfig, OptimConfig
from ...data.batch import IGNORE, MicroBatch
from ...data.prompt_only import PromptSet
from ...data.templates import chat_template_of
from ...engine import Engine
from ...engine.ranks import Ranks
from ...errors import InputError
from ...parallel.comm import Dist
from ...planning.frozen_models import reward_store
from .rollouts import completions_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RewardModel:
    """One reward model: its store, tokenizer and score head; its engine from `open` to `close`."""

    def __init__(self, path: str, key: str, data_cfg: DataConfig):
        self.key = f"{key}.model"
        root = Path(path)
        self.store, marker = reward_store(path, self.key)
        self.name = (
            Path(self.store.manifest.source or str(root)).name or root.name
        )  # TRL: the model id's tail
        self.tokenizer = _tokenizer(self.store.root / "hf", self.key)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.kwargs = dict(data_cfg.chat_template_kwargs or {})
        try:
            self.weight, self.bias = _head(self.store.root / "hf", marker["head"])
        except InputError as e:
            raise InputError(f"{self.key}: {e}") from None
        self.engine: Engine | None = None

    def open(self, engine: EngineConfig, dist: Dist | None) -> None:
        """Its forward-only engine (sharded like the policy's under torchrun)."""
        if self.engine is None:
            self.engine = Engine(self.store, engine, OptimConfig(), forward_only=True, dist=dist)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def rows(
        self,
        prompts: list,
        completions: list,
        decode: Callable[[list[int]], str],
        names: list[str] | None = None,
    ) -> list[list[int]]:
        """Each completion's ids as the model reads it, cut after its last token that is not pad.
        decode: the policy's ids -> text (a prompt given as ids); names: each completion's, for errors."""
        texts = []
        for p, c in zip(prompts, completions, strict=True):
            if isinstance(p, list) and p and isinstance(p[0], dict):  # messages
                try:
                    texts.append(self.tokenizer.apply_chat_template(p + c, tokenize=False, **self.kwargs))
                except Exception as e:  # noqa: BLE001 (a template's own error, named)
                    raise InputError(
                        f"{self.key}: its chat template failed: {type(e).__name__}: {e}"
                    ) from None
            else:
                texts.append((decode(p) if isinstance(p, list) else str(p)) + str(c))
        out, most, vocab = [], self.store.arch.max_positions, self.store.arch.vocab
        for k, ids in enumerate(self.tokenizer(texts, add_special_tokens=False)["input_ids"]):
            last = max((j for j, t in enumerate(ids) if t != self.pad_id), default=0)
            out.append(list(ids[: last + 1]) or [self.pad_id])
            what = names[k] if names else f"completion {k + 1} of the batch"
            if len(out[-1]) > most:
                raise InputError(
                    f"{self.key}: {what} is {len(out[-1]):,} tokens as the reward model reads it, beyond its "
                    f"{most:,} positions (max_position_embeddings)"
                )
            if max(out[-1]) >= vocab:  # a tokenizer of another model: an IndexError in the embedding
                raise InputError(
                    f"{self.key}: {what} has token id {max(out[-1]):,} as the reward model's tokenizer "
                    f"reads it, beyond the model's vocabulary of {vocab:,} (is its tokenizer the model's?)"
                )
        return out

    def micro_batches(self, rows: list[list[int]], size: int) -> list[MicroBatch]:
        return [
            MicroBatch.from_rows([(r, [IGNORE] * len(r)) for r in rows[a : a + size]], self.pad_id)
            for a in range(0, len(rows), size)
        ]

    @torch.no_grad()
    def scores(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """Per micro-batch (b,) fp32 on the host: each row's score at its last token."""
        engine = self.engine
        assert engine is not None, "RewardModel.open first"
        dev = engine.t.device
        with engine.guard():
            xs, head = engine.infer.hidden(mbs)
            w = self.weight.to(dev)  # once a pass; each row set in its hidden states' dtype
            b = None if self.bias is None else self.bias.to(dev)
            out = []
            for x, mb in zip(xs, mbs, strict=True):
                assert mb.lengths is not None
                last = (mb.lengths - 1).to(dev)
                h = head.norm(x[torch.arange(x.shape[0], device=dev), last][None], head.norm_w)[0]
                bias = None if b is None else b.to(h.dtype)
                out.append(torch.nn.functional.linear(h, w.to(h.dtype), bias)[:, 0].float())
            engine.sweep.release_head()
        return [o.cpu() for o in out]  # to the host once every micro-batch's score is queued


def models(rewards: list) -> list[RewardModel]:
    """The reward models among a run's rewards (recipes.grpo.rewards.Reward)."""
    return [r.model for r in rewards if r.model is not None]


def model_scores(
    rewards: list, per_func: torch.Tensor, ranks: Ranks, rows: list, outs: list, data: PromptSet, size: int
) -> float | None:
    """Each reward model's column of per_func (n, F) filled for the batch's rollouts `outs` of the
    prompt rows `rows` (data: their set: conversational or not, the policy's tokenizer); the
    seconds it took, None without a reward model."""
    if not models(rewards):
        return None
    t0 = time.perf_counter()
    prompts = [rows[o.prompt].prompt for o in outs]
    completions = completions_of(outs, data.conversational)
    seen: dict[int, int] = {}
    names = []  # as reward functions' errors name them: from 1, with the record
    for o in outs:
        seen[o.prompt] = seen.get(o.prompt, 0) + 1
        names.append(f"completion {seen[o.prompt]} of {rows[o.prompt].where}")
    for i, r in enumerate(rewards):
        if r.model is not None:
            per_func[:, i] = batch_scores(r.model, ranks, prompts, completions, data.tokenizer, size, names)
    return time.perf_counter() - t0


def check_models(rewards: list, *sets: PromptSet | None) -> None:
    """At the start, what a reward model cannot score (recipes.grpo.rewards.Reward) in each prompt
    set (training, eval: each conversational or not on its own): prompts with images (it scores
    text), conversations when its tokenizer has no chat template (TRL renders them with it: the
    first step would fail)."""
    for r, prompts in ((r, p) for r in rewards for p in sets if p is not None):
        if r.model is None:
            continue
        if any(row.media for row in prompts.rows):
            raise InputError(
                f"{r.key}.model: prompts with images: a reward model scoring images is not built yet"
            )
        if prompts.conversational and chat_template_of(r.model.tokenizer) is None:
            raise InputError(
                f"{r.key}.model: the prompts are conversations and the reward model's tokenizer has no "
                "chat template to render them with (TRL renders prompt + completion with it); give the "
                "reward store one (its hf/tokenizer_config.json) or use text prompts"
            )


def batch_scores(
    rm: RewardModel,
    ranks: Ranks,
    prompts: list,
    completions: list,
    policy_tok: PreTrainedTokenizerBase | None,
    size: int,
    names: list[str] | None = None,
) -> torch.Tensor:
    """The model's value of every completion of the batch (n,): each rank scores an even share of
    the micro-batches of `size` rows (a short rank a copy, dropped), the ranks' results gathered.
    policy_tok: decodes a prompt given as ids."""

    def decode(ids: list[int]) -> str:
        if policy_tok is None:
            raise InputError(
                f"{rm.key}: prompts given as ids need the policy's tokenizer to read them as text"
            )
        return str(policy_tok.decode(ids, skip_special_tokens=True))  # as completions are read

    mbs = rm.micro_batches(rm.rows(prompts, completions, decode, names), size)
    W = ranks.world
    got = ranks.gather(rm.scores(ranks.eval_share(mbs, lambda mb: mb)))
    return torch.cat([got[j % W][j // W] for j in range(len(mbs))])


def _tokenizer(hf: Path, key: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(hf))
    except Exception as e:  # noqa: BLE001 (no tokenizer files, or damaged ones)
        raise InputError(
            f"{key}: the reward model's store has no usable tokenizer ({type(e).__name__})"
        ) from None
    if tok.pad_token_id is None:  # TRL: the pad token is the EOS then, and the model's pad_token_id
        if tok.eos_token is None:
            raise InputError(f"{key}: the reward model's tokenizer has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    return tok


def _head(hf: Path, names: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from safetensors import safe_open

    from ...store.carried import FILE, verify_carried

    if not (hf / FILE).is_file():
        raise InputError(
            f"{hf / FILE}: missing (the reward model's score head; convert the checkpoint again)"
        )
    verify_carried(hf)
    try:
        with safe_open(str(hf / FILE), framework="pt") as f:
            got = {n: f.get_tensor(n) for n in names}
    except Exception as e:  # noqa: BLE001 (a damaged file: named)
        raise InputError(f"{hf / FILE}: unreadable ({type(e).__name__}: {e})") from None
    return got["score.weight"], got.get("score.bias")
