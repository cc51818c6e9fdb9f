"""The head's side of a training step, decided once by what is trained (engine.params):

TrainedHead  full fine-tuning: the final norm's and the LM head's gradients go to the host
             with the step's (engine.reduce), a tied head's share into the embedding's; the
             embedding's backward adds its rows' gradients
FrozenHead   adapters on a frozen base: the head computes only its input gradient, the
             embedding's backward is skipped
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..data.batch import MicroBatch
from ..runtime.events import Event
from .objective import Head

if TYPE_CHECKING:
    from .parts import Parts


class TrainedHead:
    def reserve(self, p: Parts, step_numel: int) -> None:
        p.embedding.reserve(step_numel, grad=True)

    def bind(self, p: Parts, head: Head) -> None:
        """Where the objective puts the head's gradients: its host grads' device sums, zeroed."""
        g = p.grads
        assert g.head is not None
        gh = p.params.host["head"].views(g.head)
        g.head.zero_()
        # the LM head is the embedding when tied
        g_embed = (
            p.params.host["embed"].views(g.embed)["embed"]
            if p.spec.tie_embeddings and g.embed is not None
            else None
        )
        head.g_norm, head.g_lm = p.tmpl.head_tensors(gh, g_embed)
        if g.embed is not None:
            g.embed.zero_()

    def send(self, p: Parts, ready: dict[str, Event], sq: list[torch.Tensor]) -> None:
        p.reduce.head(p.grads, ready, sq)

    def embed_backward(
        self, p: Parts, dx: list[torch.Tensor], mbs: list[MicroBatch], ready: dict[str, Event]
    ) -> float:
        """The input gradient into the embedding's rows; the host's squared grad norm share."""
        return p.embedding.backward(p.embedding.scale(dx), mbs, ready)


class FrozenHead:
    def reserve(self, p: Parts, step_numel: int) -> None:
        p.embedding.reserve(step_numel, grad=False)

    def bind(self, p: Parts, head: Head) -> None:
        pass

    def send(self, p: Parts, ready: dict[str, Event], sq: list[torch.Tensor]) -> None:
        pass

    def embed_backward(
        self, p: Parts, dx: list[torch.Tensor], mbs: list[MicroBatch], ready: dict[str, Event]
    ) -> float:
        return 0.0
