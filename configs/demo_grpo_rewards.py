"""The reward functions of configs/demo-grpo.yaml (TRL's calling convention, docs/rl.md)."""

import re


def correct(completions, answer, **kwargs):
    """1.0 when the first number of the reply is the record's answer, else 0.0."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        m = re.search(r"-?\d+", c[0]["content"])
        out.append(1.0 if m and m.group(0) == a else 0.0)
    return out
