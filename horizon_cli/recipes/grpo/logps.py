"""Per-token log-probs of completions from a forward-only sweep (each layer loaded once for all the
micro-batches), with the logits divided by rl.temperature as TRL scores them: the rollout policy's
(`old`, num_iterations > 1) and the reference's (beta > 0: the initial model; LoRA with fresh
adapters: the base, adapters off). Runs on the engine's public parts under its guard, as
engine.infer's passes do."""

from __future__ import annotations

import torch

from ...data.batch import MicroBatch
from ...engine import Engine
from ...engine.objective import Targets
from ...model.head import label_index
from .loss import scaled_head


def token_logps(
    engine: Engine, mbs: list[MicroBatch], temperature: float, adapters: bool = True
) -> list[torch.Tensor]:
    """Per micro-batch (n_m,) fp32 on the host: log p of each labelled token, in label order."""
    dev = engine.t.device
    where = [label_index(mb.labels) for mb in mbs]  # on the host, before any compute
    with engine.guard(), torch.no_grad():
        with engine.p.params.adapters(adapters):
            xs, head = engine.infer.hidden(mbs)
        head = scaled_head(head, temperature)
        out = [
            head.logps(x, Targets(i.to(dev), t.to(dev))).cpu() for x, (i, t) in zip(xs, where, strict=True)
        ]
        engine.sweep.release_head()
    return out
