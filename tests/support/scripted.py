"""A stand-in sampler that emits given tokens: each row's ids in order, then the argmax (then_greedy),
a real sampler's pick (then), or id 0, so a decode loop can be driven through given tool calls
(tests/rl/test_grpo_tools.py)."""

from __future__ import annotations

import torch

from horizon_cli.model.sample import Sampler


class Scripted(Sampler):
    def __init__(self, script: dict[int, list[int]], then_greedy: bool = False, then: Sampler | None = None):
        super().__init__()
        self.then = then
        self.script = {r: list(ids) for r, ids in script.items()}
        self.then_greedy = then_greedy
        self.last: dict[int, int | None] = {}  # row -> the scripted id its last pick took

    def pick(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        out = []
        for r, i in enumerate(rows):
            queue = self.script.get(i, [])
            if queue:
                self.last[i] = queue.pop(0)
                out.append(self.last[i])
            else:
                self.last[i] = None
                if self.then is not None:
                    out.append(int(self.then.pick(logits[r : r + 1], [i])[0]))
                else:
                    out.append(int(logits[r].argmax()) if self.then_greedy else 0)
        return torch.tensor(out, dtype=torch.long)

    def replace_last(self, row: int, token: int) -> None:
        """An id fed in place of the pick: the scripted id it took is given back."""
        if self.last.get(row) is not None:
            self.script[row].insert(0, self.last[row])
            self.last[row] = None
