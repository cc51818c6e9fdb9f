"""The data of `make demo-tools` (scripts/demo.py --tools, configs/demo-tools*.yaml), written once
and kept in horizon_cli/demo/ (rerun to rebuild them: the same seed gives the same files).

    calc_warmup.jsonl    16 chats for the SFT warm-up: 8 call configs/calc_tools.py:calculator on
                         sums and differences of 3- and 4-digit numbers (the call format), 8 answer
                         one-digit products directly ("What is 7 * 8?" "7 * 8 = 56."): the warm-up
                         says nothing about calling for a product, and shows products answered alone
    calc_prompts.jsonl   64 products of a 3-digit and a 2-digit number ("What is 237 * 82?") and
                         their answers, for GRPO
    calc_heldout.jsonl   8 more, none of them in the 64, for the before/after
"""

from __future__ import annotations

import json
import random
import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
calculator = runpy.run_path(str(REPO / "configs" / "calc_tools.py"))["calculator"]  # no sys.path edit

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def question(expr: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {expr}?"}]


def warmup(rng: random.Random, n: int) -> list[dict]:
    from transformers.utils import get_json_schema

    schema = get_json_schema(calculator)
    out = []
    for k in range(n):
        if k % 2:
            expr = f"{rng.randint(2, 9)} * {rng.randint(2, 9)}"
            chat = [*question(expr), {"role": "assistant", "content": f"{expr} = {calculator(expr)}."}]
            out.append({"messages": chat, "tools": [schema]})
            continue
        a, b = rng.randint(100, 9999), rng.randint(10, 999)
        expr = f"{a} + {b}" if k % 4 == 0 else f"{a} - {b}"
        value = calculator(expr)
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}
        out.append({"messages": [*question(expr), {"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "name": "calculator", "content": value},
                                 {"role": "assistant", "content": f"{expr} = {value}."}],
                    "tools": [schema]})  # fmt: skip
    return out


def products(rng: random.Random, n: int, seen: set[str]) -> list[dict]:
    out = []
    while len(out) < n:
        expr = f"{rng.randint(100, 999)} * {rng.randint(11, 99)}"
        if expr not in seen:
            seen.add(expr)
            out.append({"prompt": question(expr), "answer": int(calculator(expr))})
    return out


def main() -> None:
    rng = random.Random(41)
    seen: set[str] = set()
    files = {"calc_warmup.jsonl": warmup(rng, 16), "calc_prompts.jsonl": products(rng, 64, seen),
             "calc_heldout.jsonl": products(rng, 8, seen)}  # fmt: skip
    for name, rows in files.items():
        (REPO / "horizon_cli" / "demo" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"horizon_cli/demo/{name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
