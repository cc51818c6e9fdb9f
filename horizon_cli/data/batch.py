"""The contract between the data pipeline and the engine: one micro-batch of token rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE = -100  # label value that contributes no loss (transformers' convention)


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
    extras       what an objective reads beside the tokens, by name (engine.objective): per row
                 (b,) or per global batch (0-d). Preference pairs (data.pairs): rows 2j and
                 2j + 1 are pair j's chosen and rejected; `ref` (b,) fp32 their reference log-probs
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def label_tokens(self) -> int:
        """Tokens that carry loss after the shift by one."""
        return int((self.labels[:, 1:] != IGNORE).sum())

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
