"""The reward of benchmarks/bench_grpo_peer.py, one function both peers call (TRL's calling
convention): the share of a completion's tokens with an even id. On a random model it varies
within each group, so advantages, the loss and the gradients are not zero (a length reward is
constant there: random models rarely sample EOS, every completion runs the whole length)."""

from __future__ import annotations


def even_share(completion_ids, **kw):
    return [sum(1 for t in c if t % 2 == 0) / max(1, len(c)) for c in completion_ids]
