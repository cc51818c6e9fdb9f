"""The contract between the data pipeline and the engine: one micro-batch of token rows."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

IGNORE = -100  # label value that contributes no loss (transformers' convention)


class Payload(Protocol):
    """What a recipe's objective reads beside the tokens, one typed value per micro-batch: each
    training method its own dataclass (data.pairs.PairPayload, data.unpaired.KTOPayload,
    recipes.grpo.loss.GRPOPayload), read only by that method's objective."""

    def unlabelled(self) -> Payload:
        """The payload of a copy of its micro-batch without labels (an eval rank's filler)."""
        ...


@dataclass
class MicroBatch:
    """Rows are right-padded to a common length T.

    input_ids    (b, T) int64, padded with the tokenizer's pad id (any id; padding is never attended
                 to by real tokens because it sits to their right under a causal mask)
    labels       (b, T) int64, aligned with input_ids as in transformers: the engine predicts
                 labels[:, t + 1] from position t; IGNORE marks padding and masked prompt tokens
    position_ids (b, T) int64, restart at 0 at each packed document
    doc_ids      (b, T) int32 document index within its row when rows are packed, so attention
                 stays inside a document; None when every row holds one sequence
    lengths      (b,) int64 real (unpadded) tokens per row, for what must skip padding even on
                 the right (MoE router statistics); None when no row is padded
    media        the rows' image tensors by name (the processor's pixel_values, image sizes or grids),
                 the rows' concatenated along dim 0 as the processor batches them; None: no images
    payload      what the recipe's objective reads beside the tokens (a Payload: per row (b,)
                 tensors, the global batch's counts); None for SFT. Preference pairs (data.pairs):
                 rows 2j and 2j + 1 are pair j's chosen and rejected, PairPayload.ref (b,) fp32
                 their reference log-probs
    token_types  (b, T) int64, 1 on image tokens, for a model whose attention reads them (Gemma 3:
                 bidirectional within each image's block, model.token_masks); set by the image
                 stage (vision.embed), None otherwise
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    payload: Payload | None = None
    media: dict[str, torch.Tensor] | None = None
    token_types: torch.Tensor | None = None

    @property
    def label_tokens(self) -> int:
        """Tokens that carry loss after the shift by one."""
        return int((self.labels[:, 1:] != IGNORE).sum())

    def unlabelled(self) -> MicroBatch:
        """A copy with no labels: a rank short of an eval micro-batch runs it and adds nothing (its
        payload's own counts, an rl micro-batch's rows, zero too)."""
        payload = None if self.payload is None else self.payload.unlabelled()
        return replace(self, labels=torch.full_like(self.labels, IGNORE), payload=payload)

    @staticmethod
    def from_rows(rows: list[tuple[list[int], list[int]]], pad_id: int) -> MicroBatch:
        """Unpacked rows of (input_ids, labels) -> a right-padded micro-batch."""
        T = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), T), pad_id, dtype=torch.int64)
        lab = torch.full((len(rows), T), IGNORE, dtype=torch.int64)
        for i, (r_ids, r_lab) in enumerate(rows):
            ids[i, : len(r_ids)] = torch.as_tensor(r_ids, dtype=torch.int64)
            lab[i, : len(r_lab)] = torch.as_tensor(r_lab, dtype=torch.int64)
        pos = torch.arange(T, dtype=torch.int64).expand(len(rows), T).contiguous()
        lengths = torch.tensor([len(r_ids) for r_ids, _ in rows], dtype=torch.int64)
        return MicroBatch(ids, lab, pos, None, lengths)


@dataclass
class DecodeBatch:
    """One micro-batch of a generation's sweep: rows left-padded, so every row's newest token sits
    at the same index (one write position into the KV cache, one position for the head).

    input_ids  (b, T) int64: this sweep's tokens (the prompts at prefill, the newest token after)
    pad        (b,) int64: left padding of each row (its first `pad` cached positions are not
               attended to)
    past       positions already in the KV cache (0 at prefill)
    mrope      the model's own position ids of a prefill with images, (3, b, T) (vision.embed:
               Qwen2-VL's get_rope_index), and its rope deltas (b, 1), which later sweeps add
               to their positions as transformers' generate does; None: none
    token_types a prefill's (b, T) token types (MicroBatch.token_types); later sweeps have none, as
               transformers' generate passes them at the first iteration only
    """

    input_ids: torch.Tensor
    pad: torch.Tensor
    past: int = 0
    media: dict[str, torch.Tensor] | None = (
        None  # the prefill's image tensors (vision.prompts), rows in order
    )
    mrope: tuple[torch.Tensor | None, torch.Tensor] | None = None
    token_types: torch.Tensor | None = None

    @property
    def position_ids(self) -> torch.Tensor:
        """(b, T) each token's position in its own sequence (padding: 0), as transformers'
        generate derives them from the attention mask; with rope deltas (3, b, T) (`mrope`)."""
        if self.mrope is not None and self.mrope[0] is not None:
            return self.mrope[0]
        T = self.input_ids.shape[1]
        pos = (self.past + torch.arange(T, dtype=torch.int64)[None, :] - self.pad[:, None]).clamp_min(0)
        if self.mrope is not None:
            return (pos + self.mrope[1].to(pos.device))[None].expand(3, -1, -1)
        return pos

    def attention_mask(self) -> torch.Tensor:
        """(b, past + T) bool: True for real tokens (transformers' 2-D attention mask)."""
        S = self.past + self.input_ids.shape[1]
        return torch.arange(S, dtype=torch.int64)[None, :] >= self.pad[:, None]

    def next(self, tokens: torch.Tensor) -> DecodeBatch:
        """The following sweep's batch: one new token per row (b, 1)."""
        deltas = None if self.mrope is None else (None, self.mrope[1])
        return DecodeBatch(tokens.reshape(-1, 1), self.pad, self.past + self.input_ids.shape[1], mrope=deltas)

    @staticmethod
    def left_padded(prompts: list[list[int]], pad_id: int) -> DecodeBatch:
        T = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), T), pad_id, dtype=torch.int64)
        for r, p in enumerate(prompts):
            ids[r, T - len(p) :] = torch.as_tensor(p, dtype=torch.int64)
        return DecodeBatch(ids, torch.tensor([T - len(p) for p in prompts], dtype=torch.int64))
