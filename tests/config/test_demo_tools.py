"""`make demo-tools` without training: its configs load with the calculator as the GRPO tool, its
data are what the demo says (the warm-up's calls parse back with a Qwen2.5-template tokenizer's
response template and their results are the calculator's; the held-out products are not among
the training prompts; the reward scores the warm-up's answers right)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from horizon_cli.config import load_config

pytest.importorskip("trl")  # the tokenizer's template and response template are TRL's
ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "horizon_cli" / "demo"


def asked(content: str) -> str:
    """The expression of "What is 838 * 26?"."""
    return content.removeprefix("What is ").removesuffix("?")


def rows(name: str) -> list[dict]:
    return [json.loads(x) for x in (DEMO / name).read_text().splitlines()]


def test_the_configs_load_and_the_tool_is_the_calculator():
    from horizon_cli.recipes.grpo.tools import load_toolbox

    warm = load_config(ROOT / "configs" / "demo-tools-warmup.yaml")
    cfg = load_config(ROOT / "configs" / "demo-tools.yaml")
    assert cfg.model.path == f"{warm.output.dir}/checkpoints/step_{warm.train.steps}"
    assert cfg.rl is not None
    cfg.rl.tools = [str(ROOT / t) for t in cfg.rl.tools]
    box = load_toolbox(cfg.rl)
    assert box is not None and [f.__name__ for f in box.tools()] == ["calculator"]
    assert box.functions[0](expression="838 * 26") == "21788"


def test_the_warmup_calls_parse_back_and_the_products_are_held_out(tmp_path):
    import runpy

    from horizon_cli.recipes.grpo.turns import parse
    from tests.support.tool_tokenizer import make_tool_tokenizer

    calc = runpy.run_path(str(ROOT / "configs" / "calc_tools.py"))  # the worker's sys.path untouched
    calculator, correct = calc["calculator"], calc["correct"]

    tok = make_tool_tokenizer(tmp_path / "tok")
    calls = 0
    for r in rows("calc_warmup.jsonl"):
        msgs, last = r["messages"], r["messages"][-1]
        assert correct([[last]], [calculator(asked(msgs[1]["content"]))]) == [1.0]
        if len(msgs) == 3:  # a small product answered directly
            continue
        calls += 1
        prompt = tok.apply_chat_template(
            msgs[:2], tools=r["tools"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        full = tok.apply_chat_template(msgs[:3], tools=r["tools"], tokenize=True, return_dict=False)
        assert full[: len(prompt)] == prompt
        turn = parse(tok, full[len(prompt) :], prompt, [calculator])
        assert turn["tool_calls"] == msgs[2]["tool_calls"]
        assert msgs[3]["content"] == calculator(**turn["tool_calls"][0]["function"]["arguments"])
    assert calls == 8
    train = {r["prompt"][-1]["content"] for r in rows("calc_prompts.jsonl")}
    held = rows("calc_heldout.jsonl")
    assert len(train) == 64 and len(held) == 8 and not train & {r["prompt"][-1]["content"] for r in held}
    for r in held:
        assert r["answer"] == int(calculator(asked(r["prompt"][-1]["content"])))
