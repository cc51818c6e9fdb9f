"""The head's side of a training step, decided once by what is trained (engine.params.head_grads):

TrainedHead  full fine-tuning: the final norm's and the LM head's gradients go to the host
             with the step's (engine.reduce), a tied head's share into the embedding's; the
             embedding's backward adds its rows' gradients
FrozenHead   adapters on a frozen base: the head computes only its input gradient, the
             embedding's backward is skipped (what its stage trains, a projector's adapters,
             gets its gradient: Embedding.stage_backward)
"""

from __future__ import annotations

import torch

from ..data.batch import MicroBatch
from ..runtime.events import Event
from ..state.host import HostState
from .grads import Chunks, GradSums
from .objective import Head
from .seams import Embedding, LayerTemplate, Reduce


class TrainedHead:
    def __init__(
        self,
        host: HostState,
        grads: GradSums,
        tmpl: LayerTemplate,
        reduce: Reduce,
        embedding: Embedding,
        tied: bool,
    ):
        self.host, self.grads, self.tmpl, self.reduce = host, grads, tmpl, reduce
        self.embedding, self.tied = embedding, tied

    def reserve(self, step_numel: int) -> None:
        self.embedding.reserve(step_numel, grad=True)

    def bind(self, head: Head) -> None:
        """Where the objective puts the head's gradients: its host grads' device sums, zeroed."""
        g = self.grads
        assert g.head is not None
        gh = self.host["head"].views(g.head)
        g.head.zero_()
        # the LM head is the embedding when tied
        g_embed = self.host["embed"].views(g.embed)["embed"] if self.tied and g.embed is not None else None
        head.g_norm, head.g_lm = self.tmpl.head_tensors(gh, g_embed)
        if g.embed is not None:
            g.embed.zero_()

    def send(self, ready: dict[str, Event], sq: list[torch.Tensor], chunks: Chunks) -> None:
        self.reduce.head(self.grads, ready, sq, chunks)

    def embed_backward(self, dx: list[torch.Tensor], mbs: list[MicroBatch], ready: dict[str, Event]) -> float:
        """The input gradient into the embedding's rows; the host's share of the squared norm."""
        return self.embedding.backward(self.embedding.scale(dx), mbs, ready)


class FrozenHead:
    def __init__(self, embedding: Embedding):
        self.embedding = embedding

    def reserve(self, step_numel: int) -> None:
        self.embedding.reserve(step_numel, grad=False)

    def bind(self, head: Head) -> None:
        pass

    def send(self, ready: dict[str, Event], sq: list[torch.Tensor], chunks: Chunks) -> None:
        pass

    def embed_backward(self, dx: list[torch.Tensor], mbs: list[MicroBatch], ready: dict[str, Event]) -> float:
        """The table is frozen; what the stage trains (projector adapters) gets its gradient."""
        return self.embedding.stage_backward(dx)
