"""The image stage of the embedding: the rows of a micro-batch with images get the tower's
features in the placeholders' places before layer 0, and give the gradient back through the same
merge.

`VisionEmbedding` is a stage before layer 0 (engine.seams.Embedding) around the run's embedding
table (engine.embed.HostEmbedding), one more strategy of the engine's parts (engine.parts: `stage`),
so the sweep, the step and the passes never ask whether a batch holds images:

    forward   the text rows (scaled as the family scales them: transformers scales the token
              embeddings before it merges the images; on the generic path the embedding module's
              own forward does, vision.tower.embed) -> per micro-batch with media, the tower's
              features (vision.tower) merged by transformers' masked_scatter; the merge's graph
              is kept until the backward
    positions a micro-batch with images whose owner computes multimodal rotary position ids
              (Qwen2-VL, Qwen2.5-VL) gets them before its layer context is built (`positioned`,
              the engine's hook): they reach every layer as transformers' forward gives them;
              one whose masks read token types (Gemma 3) gets those there too, from which the
              layer context builds the model's own masks (model.token_masks)
    backward  the rows' gradient through that graph: masked_scatter's own backward zeroes the
              image positions for the embedding table (the placeholder token's row gets nothing
              from them, as in transformers); then the wrapped embedding's backward as ever
    ranks     under torchrun every rank holds the tower whole and runs it for its own
              micro-batches; a trained part's gradient sums are all-reduced once a step (the
              loss is divided by the global label count, so they add up to one rank's), counted
              once in the norm, and every rank's CPU AdamW makes the same update; a frozen tower
              sends nothing
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..data.batch import DecodeBatch, MicroBatch
from ..engine.grads import sumsq64
from ..engine.seams import B, EmbeddingTable, Inputs
from ..engine.sharded import ShardedGrads
from ..optim.adamw import AdamWHyper
from ..runtime.events import Event
from ..runtime.loader import Load
from .tower import VisionTower
from .trained import TowerState


class VisionEmbedding:
    """The stage before layer 0 (engine.seams.Embedding) that merges the images into the rows."""

    def __init__(self, inner: EmbeddingTable, tower: VisionTower, trained: TowerState | None = None) -> None:
        """inner: the run's embedding table; trained: the tower's trained part (train.vision
        projector | all), or None (frozen)."""
        self.inner, self.tower, self.trained = inner, tower, trained
        self.stage_trained = trained is not None
        self.ahead = inner.ahead
        self.saved: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.sharded: ShardedGrads | None = None  # a sharded run's: the trained part summed over ranks

    def across_ranks(self, sharded: ShardedGrads) -> None:
        self.sharded = sharded

    def loads(self) -> list[Load]:
        return self.inner.loads()

    def reserve(self, numel: int, grad: bool) -> None:
        self.inner.reserve(numel, grad)

    def positioned(self, mb: B) -> B:
        """A micro-batch with images, its position ids the owner's own (vision.tower.positions:
        Qwen2-VL's (3, b, T) multimodal rotary ids); the others as they are. A generation's
        prefill keeps them and the rope deltas, which its later sweeps add to their positions
        (data.batch.DecodeBatch.mrope), as transformers' generate does."""
        media = mb.media
        if not media or not any(v.numel() for v in media.values()):
            return mb
        types = self.tower.token_types(mb.input_ids)  # Gemma 3's image blocks (model.token_masks)
        if types is not None:
            if isinstance(mb, DecodeBatch):
                mb.token_types = types  # its prefill only: the next sweep's batch carries none
            else:
                mb = dataclasses.replace(mb, token_types=types)
        if isinstance(mb, DecodeBatch):
            got = self.tower.positions(mb.input_ids, media, mb.attention_mask())
            if got is not None:
                mb.mrope = got  # the Decoder's own batch: its next sweep's carries the deltas
            return mb
        mask = None
        if mb.lengths is not None:
            mask = torch.arange(mb.input_ids.shape[1])[None, :] < mb.lengths[:, None]
        got = self.tower.positions(mb.input_ids, media, mask)
        return mb if got is None else dataclasses.replace(mb, position_ids=got[0])

    def forward(self, mbs: Inputs) -> list[torch.Tensor]:
        x = self.inner.scale(self.inner.forward(mbs))
        out: list[torch.Tensor] = []
        self.saved = []
        for xm, mb in zip(x, mbs, strict=True):
            media = getattr(mb, "media", None)  # a generation's DecodeBatch carries them at its prefill
            if not media or not any(v.numel() for v in media.values()):
                out.append(xm)
                self.saved.append(None)
                continue
            with torch.enable_grad():
                feats = self.tower.features(media)  # (n, H)
                rows = xm.detach().requires_grad_(True)
                ids = mb.input_ids.to(xm.device)
                merged = self.tower.merge(ids, self.tower.embed(ids, rows), feats)
            out.append(merged.detach())
            self.saved.append((rows, merged))
        return out

    def scale(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        """Identity: the text rows were scaled before the merge (their gradient is, in backward)."""
        return x

    def backward(self, dx: list[torch.Tensor], mbs: list[MicroBatch], ready: dict[str, Event]) -> float:
        """The rows' gradient through the merge (and the trained tower's, summed in fp32);
        returns what the embedding's and the tower's gradients add to the squared norm."""
        back, sq = self._through_merge(dx)
        return self.inner.backward(self.inner.scale(back), mbs, ready) + sq

    def stage_backward(self, dx: list[torch.Tensor]) -> float:
        """A frozen base (LoRA): the trained tower part's gradient (the projector's adapters) alone."""
        return self._through_merge(dx)[1]

    def _through_merge(self, dx: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        """The rows' gradient through each micro-batch's merge, the trained part's into its
        fp32 sums; (the rows' gradients, the trained part's squared norm)."""
        back: list[torch.Tensor] = []
        tr = self.trained
        params = list(tr.params.values()) if tr is not None else []
        if tr is not None:
            tr.begin()
        for d, saved in zip(dx, self.saved, strict=True):
            if saved is None:
                back.append(d)
                continue
            rows, merged = saved
            g, *pg = torch.autograd.grad(merged, [rows, *params], d, allow_unused=True)
            if tr is not None:
                tr.add(pg)
            back.append(g)
        self.saved = []
        if tr is not None and self.sharded is not None:
            self._sum_over_ranks(tr, self.sharded)
        sq = tr.finish() if tr is not None else 0.0  # sharded: counted in the step's norm already
        return back, sq

    @staticmethod
    def _sum_over_ranks(tr: TowerState, sharded: ShardedGrads) -> None:
        """Every rank's gradient sums of the trained part added up (one all-reduce, with one flag
        per parameter: reached by any rank's backward), so every rank's AdamW step, and tower,
        stays the same; a rank whose micro-batches hold no image sends zeros."""
        names = list(tr.acc)
        if not names:
            return
        sizes = [tr.acc[n].numel() for n in names]
        dev = tr.acc[names[0]].device
        used = torch.tensor([float(n in tr.used) for n in names], device=dev)
        flat = torch.cat([*(tr.acc[n].reshape(-1) for n in names), used])  # (sum(sizes) + P,) fp32
        n = sum(sizes)
        sharded.sum_replicated(flat, lambda f: sumsq64(f[:n]))
        for name, part in zip(names, flat[:n].split(sizes), strict=True):
            tr.acc[name].copy_(part.view(tr.acc[name].shape))
        tr.used = {name for name, f in zip(names, flat[n:].tolist(), strict=True) if f > 0}

    def update(self, h: AdamWHyper) -> None:
        """The trained tower's AdamW step, with the units' hyper-parameters (clip scale included)."""
        if self.trained is not None:
            self.trained.update(h)

    def save_state(self, ck: Path) -> dict[str, int]:
        return self.trained.save(ck) if self.trained is not None else {}

    def load_state(self, ck: Path, sums: dict[str, int]) -> None:
        if self.trained is not None:
            self.trained.load(ck, sums)
