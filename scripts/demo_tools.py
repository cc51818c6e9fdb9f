"""The before/after of `make demo-tools` (scripts/demo.py --tools): held-out products asked with
the calculator offered, greedy, through `horizon generate` on a store or a run dir, in two rounds:

1. the question, rendered with the tool (the tokenizer's chat template, `tools=[calculator]`, as
   GRPO renders its prompts), answered by `horizon generate`;
2. each answer parsed with the tokenizer's response template (transformers' parse_response, as
   GRPO's rollouts parse a turn); where it called the calculator, the call is run
   (configs/calc_tools.py) and the conversation with its result is answered again.

A reply is right when the last number of its final turn is the product (calc_tools.correct, the
reward GRPO trained on).
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CALC = runpy.run_path(str(REPO / "configs" / "calc_tools.py"))  # the tool file GRPO loads (no sys.path edit)
calculator, correct = CALC["calculator"], CALC["correct"]

HORIZON = [sys.executable, "-m", "horizon_cli.cli"]


def generate(src: Path, prompts: list[list[int]], out: Path, tokens: int) -> list[list[int]]:
    """Greedy completions of token-id prompts by `horizon generate` (its JSONL in, out)."""
    feed = out.with_suffix(".prompts.jsonl")
    feed.parent.mkdir(parents=True, exist_ok=True)
    feed.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    cmd = [*HORIZON, "generate", src, "--prompts", feed, "--max-new-tokens", str(tokens), "--output", out]
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=REPO)
    return [json.loads(line)["completion_ids"] for line in out.read_text().splitlines()]


def ask(src: Path, rows: list[dict], out: Path) -> list[dict]:
    """Each row ({prompt, answer}) asked of src with the calculator: its turns and whether it is right."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_hf(src))
    convs = [list(r["prompt"]) for r in rows]
    first = [tok.apply_chat_template(c, tools=[calculator], add_generation_prompt=True, tokenize=True,
                                     return_dict=False) for c in convs]  # fmt: skip
    replies = generate(src, first, out.with_suffix(".turn1.jsonl"), 64)
    again = []
    for k, (c, p, ids) in enumerate(zip(convs, first, replies, strict=True)):
        msg = _parse(tok, ids, p)
        c.append(msg)
        if msg.get("tool_calls"):
            for call in msg["tool_calls"]:
                fn = call.get("function", call)
                try:
                    value = calculator(**fn.get("arguments", {}))
                except Exception as e:
                    value = json.dumps({"error": f"{type(e).__name__}: {e}"})
                c.append({"role": "tool", "name": fn.get("name"), "content": value})
            again.append(k)
    if again:
        prompts = [tok.apply_chat_template(convs[k], tools=[calculator], add_generation_prompt=True, tokenize=True,
                                           return_dict=False) for k in again]  # fmt: skip
        for k, p, ids in zip(
            again, prompts, generate(src, prompts, out.with_suffix(".turn2.jsonl"), 32), strict=True
        ):
            convs[k].append(_parse(tok, ids, p))
    got = []
    for r, c in zip(rows, convs, strict=True):
        turns = c[len(r["prompt"]) :]
        right = correct([turns], [r["answer"]])[0] == 1.0
        got.append(
            {"question": r["prompt"][-1]["content"], "answer": r["answer"], "turns": turns, "right": right}
        )
    out.write_text("".join(json.dumps(g) + "\n" for g in got))
    return got


def _parse(tok, ids: list[int], prefix: list[int]) -> dict:
    """One turn as GRPO's rollouts read it (recipes/grpo/turns.py parse: plain text if malformed)."""
    from horizon_cli.recipes.grpo.turns import parse

    return parse(tok, ids, prefix, [calculator])


def _hf(src: Path) -> Path:
    """The tokenizer's folder of a store (<store>/hf) or of a run dir's newest checkpoint."""
    if (src / "hf").is_dir():
        return src / "hf"
    steps = sorted((src / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return steps[-1] / "hf"


def show(turns: list[dict]) -> str:
    """A transcript on one line per turn."""
    out = []
    for m in turns:
        if m.get("tool_calls"):
            calls = ", ".join(json.dumps(c.get("function", c)) for c in m["tool_calls"])
            out.append(f"[call] {calls}")
        elif m["role"] == "tool":
            out.append(f"[calculator] {m['content']}")
        else:
            out.append(m["content"].strip().replace("\n", " ")[:160])
    return " | ".join(out)


if __name__ == "__main__":  # python scripts/demo_tools.py SRC OUT: the held-out set asked of SRC
    held = [json.loads(x) for x in (REPO / "horizon_cli/demo/calc_heldout.jsonl").read_text().splitlines()]
    res = ask(Path(sys.argv[1]), held, Path(sys.argv[2]))
    for g in res:
        print(("RIGHT " if g["right"] else "wrong ") + f"{g['question']} ({g['answer']}): {show(g['turns'])}")
    print(f"right: {sum(g['right'] for g in res)}/{len(res)}")
