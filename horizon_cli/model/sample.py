"""Choosing the next token, and when a row stops.

Sampler     greedy (temperature 0: the argmax, as transformers' greedy search), or sampling
            from softmax(logits / T) restricted to the top-k tokens and then to the smallest
            set whose probability reaches top-p (the order and rules of transformers'
            Temperature, TopK and TopP logits warpers). Each prompt draws from a generator of
            its own, seeded by (--seed, its index in the input), so a prompt's sample does not
            depend on the batch it ran in.
StopText    a row's text stop strings (--stop): the completion ends before the first of them,
            and its ids end with the token that ends that text (so decode(ids) is the completion,
            or, when that token also begins the stop string, starts with it).
"""

from __future__ import annotations

import torch


class Sampler:
    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
    ):
        self.temperature, self.top_p, self.top_k, self.seed = temperature, top_p, top_k, seed
        self.min_p, self.penalty = min_p, repetition_penalty
        self._gens: dict[int, torch.Generator] = {}
        self._seen: dict[int, list[int]] = {}  # row -> its ids so far (repetition_penalty)

    def begin(self, row: int, prompt: list[int]) -> None:
        """A row's prompt, the ids repetition_penalty starts from (the picked ones are added)."""
        if self.penalty != 1.0:
            self._seen[row] = list(prompt)

    def _penalized(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """transformers' RepetitionPenaltyLogitsProcessor on the raw logits: a token already in the
        row's ids has its logit divided by the penalty (multiplied when negative)."""
        x = logits.clone()
        for r, i in enumerate(rows):
            seen = torch.tensor(sorted(set(self._seen.get(i, []))), dtype=torch.long, device=x.device)
            if seen.numel():
                v = x[r, seen]
                x[r, seen] = torch.where(v < 0, v * self.penalty, v / self.penalty)
        return x

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def warp(self, logits: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """(b, V) fp32 logits (of prompts `rows`) -> the scores sampling draws from: filtered tokens
        at -inf, in the order of transformers' generate (repetition penalty, temperature, top-k,
        top-p, min-p)."""
        if self.penalty != 1.0 and rows is not None:
            logits = self._penalized(logits, rows)
        x = logits / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            # ascending: drop the least likely tokens while what they add up to stays <= 1 - top_p;
            # the most likely token always stays
            vals, order = torch.sort(x, dim=-1)
            cum = torch.softmax(vals, dim=-1).cumsum(dim=-1)
            drop = cum <= 1.0 - self.top_p
            drop[..., -1] = False
            x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        if self.min_p > 0.0:  # MinPLogitsWarper: below min_p x the top token's probability; the top stays
            probs = torch.softmax(x, dim=-1)
            low = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
            low.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
            x = x.masked_fill(low, float("-inf"))
        return x

    def scores(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """What `pick` draws from for these rows now (before it records its pick): the warped
        scores; their log_softmax is the processed log-prob of a pick (vLLM's processed_logprobs)."""
        return logits if self.greedy else self.warp(logits, rows)

    def pick(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """(b, V) fp32 logits of prompts `rows` (their indices in the input) -> (b,) int64 tokens."""
        if self.greedy:
            out = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(self.warp(logits, rows), dim=-1)
            gens = [self._gen(i, logits.device) for i in rows]
            out = torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(gens)])
        for r, i in enumerate(rows):
            if i in self._seen:
                self._seen[i].append(int(out[r]))
        return out

    def replace_last(self, row: int, token: int) -> None:
        """The row's last id was `token`, not the one picked (an id fed in, generate.decoder)."""
        if row in self._seen:
            self._seen[row][-1] = token

    def _gen(self, row: int, device) -> torch.Generator:
        g = self._gens.get(row)
        if g is None:
            g = self._gens[row] = torch.Generator(device=device)
            g.manual_seed((self.seed * 0x9E3779B97F4A7C15 + row) % (1 << 63))
        return g

    def forget(self, row: int) -> None:
        self._gens.pop(row, None)
        self._seen.pop(row, None)


class StopText:
    """Text stop strings: checked on the decoded completion after each new token."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]

    def cut(self, ids: list[int]) -> tuple[str, int] | None:
        """(the completion before the first stop string, how many of `ids` it keeps: the fewest
        whose text holds it), or None when no stop string has appeared."""
        if not self.stops:
            return None
        text = self._text(ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if not hits:
            return None
        head = text[: min(hits)]
        keep = len(ids)
        while keep > 0 and self._text(ids[: keep - 1]).startswith(head):
            keep -= 1
        return head, keep

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
