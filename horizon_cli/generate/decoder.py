"""The generation loop over one batch of prompts: prefill, then one sweep of the layers per new
token for every row still generating (generate.decode), until each row stops at an EOS id, a stop
string, its token limit or the model's last position.

Rows are sorted by length and cut into micro-batches of at most `MICRO_TOKENS` prompt tokens
(left-padded, generate.decode); a micro-batch whose rows have all stopped leaves the sweep. The
same loop serves `horizon generate`, eval-time samples (train.samples), the evaluation harness and
an rl run's rollouts.

On a sharded engine (torchrun) every layer load is an all-gather, so the ranks decode in lock step:
each decodes its own prompts, the KV caches are sized for the longest limit of any rank, and after
each sweep the ranks add up their live micro-batches (Generation.across); a rank whose rows have
all stopped keeps sweeping its last micro-batch (its new tokens ignored) until no rank has one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..data.batch import DecodeBatch
from ..engine import Engine
from ..model.sample import Sampler, StopText
from .decode import Generation
from .resident import ResidentLoader

MICRO_TOKENS = 8192  # prompt tokens per micro-batch at most (its prefill working set)


def micro_batches(prompts: list[tuple[int, list[int]]]) -> list[list[tuple[int, list[int]]]]:
    """(index, ids) rows sorted by length (less padding), cut into micro-batches of at most
    MICRO_TOKENS padded prompt tokens."""
    groups: list[list[tuple[int, list[int]]]] = [[]]
    for r in sorted(prompts, key=lambda p: len(p[1])):
        if groups[-1] and len(r[1]) * (len(groups[-1]) + 1) > MICRO_TOKENS:  # r is the longest yet
            groups.append([])
        groups[-1].append(r)
    return groups


@dataclass
class Completion:
    index: int  # the prompt's place in the input
    ids: list[int] = field(default_factory=list)  # generated ids (an EOS id included; a stop: cut as text)
    text: str | None = None  # decoded (special tokens skipped), cut before a stop string
    finish: str = ""  # eos | stop | length


@dataclass
class SweepStats:
    """One sweep's figures, for progress: rows advanced, seconds, bytes over the link."""

    tokens: int
    seconds: float
    h2d_bytes: int
    prefill: bool


class Decoder:
    def __init__(
        self,
        engine: Engine,
        sampler: Sampler,
        *,
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        tokenizer=None,
        stops: Sequence[str] = (),
        host_kv: bool = False,
        pad_id: int = 0,
        on_done: Callable[[Completion], None] = lambda c: None,
        on_sweep: Callable[[SweepStats], None] = lambda s: None,
        media: dict[int, dict[str, torch.Tensor]] | None = None,
        weights: ResidentLoader | None = None,
        more: Callable[[Completion], list[int]] | None = None,
    ):
        """media: prompt index -> its image tensors (vision.prompts), merged at the prefill;
        weights: the layers from a resident copy (generate.resident), not streamed. more: at
        a row's finish, ids to append to it (a tool result, recipes.grpo.tools) before it goes on:
        they are fed one per sweep in place of the sampled token, so the row keeps its KV cache and
        only the appended ids are computed; none: the row stays finished."""
        self.engine, self.sampler = engine, sampler
        self.gen = Generation(engine, weights)  # the engine's sweep and parts, driven for generation
        self.max_new, self.eos = max_new_tokens, set(eos_ids)
        self.tokenizer, self.stop = tokenizer, StopText(tokenizer, list(stops)) if tokenizer else None
        self.host_kv, self.pad_id = host_kv, pad_id
        self.on_done, self.on_sweep = on_done, on_sweep
        self.media = media or {}
        self.positions = engine.spec.max_positions
        self.more = more
        self.forced: dict[int, list[int]] = {}  # row -> ids still to feed (from `more`)

    def run(self, prompts: list[tuple[int, list[int]]]) -> list[Completion]:
        """(index, prompt ids) of one batch -> their completions, in the order given."""
        groups = micro_batches(prompts)
        for i, ids in prompts:
            self.sampler.begin(i, ids)
        dbs = [DecodeBatch.left_padded([ids for _, ids in g], self.pad_id) for g in groups]
        for db, g in zip(dbs, groups, strict=True):  # images: each row's tensors, in the rows' order
            got = [self.media[i] for i, _ in g if i in self.media]
            if got:
                db.media = {n: torch.cat([m[n] for m in got]) for n in got[0]}
        limits = [[min(self.max_new, self.positions - len(ids)) for _, ids in g] for g in groups]
        most = max(self.gen.across(max(max(lim) for lim in limits)))  # every rank's caches hold its sweeps
        kv = self.gen.open(dbs, most, self.host_kv)
        out = {i: Completion(i) for i, _ in prompts}
        active = list(range(len(groups)))
        try:
            logits = self._sweep(dbs, kv, prefill=True)
            while True:
                still, nxt = [], []
                for m, lg in zip(active, logits, strict=True):
                    rows = [i for i, _ in groups[m]]
                    tok = self.sampler.pick(lg, rows).cpu()  # the embedding gathers rows on the host
                    toks = tok.tolist()  # an id fed in (`more`) takes its row's place
                    if self._advance([out[i] for i in rows], toks, limits[m]):
                        still.append(m)
                        nxt.append(dbs[m].next(torch.tensor(toks, dtype=tok.dtype).reshape(-1, 1)))
                if not sum(self.gen.across(len(still))):  # no rank has a live row
                    break
                if not still:  # another rank's rows go on: this rank's last micro-batch sweeps along
                    still, nxt = [m], [dbs[m].next(tok.reshape(-1, 1))]
                for m, db in zip(still, nxt, strict=True):
                    dbs[m] = db
                active = still
                kv.keep_only(active)
                logits = self._sweep([dbs[m] for m in active], kv, prefill=False)
        finally:
            kv.close()
        for i, _ in prompts:
            self.sampler.forget(i)
        return [out[i] for i, _ in prompts]

    def _sweep(self, dbs: list[DecodeBatch], kv, prefill: bool) -> list[torch.Tensor]:
        t = self.engine.t
        t.stats.reset()
        t0 = time.perf_counter()
        logits = self.gen.step(dbs, kv)
        tokens = sum(db.input_ids.numel() for db in dbs)
        self.on_sweep(SweepStats(tokens, time.perf_counter() - t0, t.stats.h2d_bytes, prefill))
        return logits

    def _advance(self, rows: list[Completion], tokens: list[int], limits: list[int]) -> bool:
        """Append each row's new token (rows already stopped ignore theirs; a row fed ids takes the
        next one, written into `tokens`); True while any row of the micro-batch still generates."""
        going = False
        for k, (c, tok, lim) in enumerate(zip(rows, tokens, limits, strict=True)):
            if c.finish:
                continue
            if c.index in self.forced:
                going |= self._feed(c, lim)
                tokens[k] = c.ids[-1]
                continue
            c.ids.append(tok)
            cut = self.stop.cut(c.ids) if self.stop is not None else None
            if tok in self.eos:
                c.finish = "eos"
            elif cut is not None:  # the ids too end where the text does (model.sample.StopText)
                c.finish, (c.text, keep) = "stop", cut
                del c.ids[keep:]
            elif len(c.ids) >= lim:
                c.finish = "length"
            if c.finish and self._resume(c):
                going = True
            elif c.finish:
                if c.text is None and self.tokenizer is not None:
                    c.text = self.tokenizer.decode(c.ids, skip_special_tokens=True)
                self.on_done(c)
            else:
                going = True
        return going

    def _resume(self, c: Completion) -> bool:
        """A finished row given more ids by `more` goes on: they are fed before it samples again."""
        got = self.more(c) if self.more is not None else []
        if got:
            c.finish, c.text = "", None
            self.forced[c.index] = list(got)
        return bool(got)

    def _feed(self, c: Completion, lim: int) -> bool:
        """A row with ids to feed takes the next one in place of its sampled token (an EOS id among
        them does not end it; its limit does); True while it goes on."""
        queue = self.forced[c.index]
        c.ids.append(queue.pop(0))
        self.sampler.replace_last(c.index, c.ids[-1])
        if not queue:
            del self.forced[c.index]
        if len(c.ids) < lim:
            return True
        self.forced.pop(c.index, None)
        c.finish = "length"
        if self._resume(c):
            return True
        if self.tokenizer is not None:
            c.text = self.tokenizer.decode(c.ids, skip_special_tokens=True)
        self.on_done(c)
        return False
