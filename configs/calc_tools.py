"""A calculator for tool-using GRPO (configs/llama70b-grpo-tools.yaml, configs/demo-tools.yaml):
TRL 1.16's conventions (docs/rl.md, "Tools and environments"). The tools' type hints and
docstrings are what the chat template shows the model."""

from __future__ import annotations

import ast
import operator
import re

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg}  # fmt: skip


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "(12 + 7) * 3"
    """
    value = _eval(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def correct(completions, answer, **kw):
    """1.0 when the last number of the final turn is the record's answer."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        text = c[-1]["content"] if isinstance(c, list) else c
        nums = re.findall(r"-?\d+(?:\.\d+)?", text or "")
        out.append(1.0 if nums and float(nums[-1]) == float(a) else 0.0)
    return out
