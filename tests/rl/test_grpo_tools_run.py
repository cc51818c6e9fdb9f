"""rl.tools through `horizon train`: a run whose rollouts call tools (a scripted first turn on
half the rows: tests.support.scripted, in place of rl's sampler; the rest sampled), with a
tool from a file and an environment class; what the rollouts, the metrics and the reward
functions see. And the bad input: each one line, exit 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from horizon_cli.errors import InputError
from horizon_cli.model.sample import Sampler
from horizon_cli.recipes.grpo import rollouts as ro
from horizon_cli.train.metrics import read_metrics
from tests.conftest import write_config, write_jsonl
from tests.support.scripted import Scripted

pytest.importorskip("trl")  # the tokenizer's template and response template are TRL's

TOOLS_PY = '''
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first
        b: the second
    """
    return a * b


class Calculator:
    def __init__(self):
        self.used = 0

    def reset(self, **record):
        self.answer = record["answer"]

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        self.used += 1
        return a + b


def right(completions, environments, answer, **kw):
    """1 when the last turn holds the answer; +0.5 when the environment's tool was used."""
    out = []
    for c, env, a in zip(completions, environments, answer):
        assert isinstance(c, list) and c[-1]["role"] == "assistant"
        out.append(float(str(a) in c[-1]["content"]) + 0.5 * (env.used > 0))
    return out
'''
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    from horizon_cli.convert import convert
    from tests.support.tiny import make_model, save
    from tests.support.tool_tokenizer import make_tool_tokenizer

    root = tmp_path_factory.mktemp("toolstore")
    save(make_model("llama", vocab_size=512, max_position_embeddings=1024), root / "hf")
    make_tool_tokenizer(root / "hf")
    convert(root / "hf", root / "store", dtype="float32")
    return root / "store"


def config(tmp: Path, store: Path, **rl) -> Path:
    (tmp / "tools.py").write_text(TOOLS_PY)
    rows = [{"prompt": [{"role": "user", "content": f"What is 3 + {k}?"}], "answer": 3 + k} for k in range(4)]
    data = write_jsonl(tmp / "p.jsonl", rows)
    rl = {"num_generations": 2, "max_completion_length": 48, "temperature": 1.0,
          "rewards": [{"function": f"{tmp / 'tools.py'}:right"}],
          "tools": [f"{tmp / 'tools.py'}:multiply"], "environment": f"{tmp / 'tools.py'}:Calculator", **rl}  # fmt: skip
    return write_config(tmp / "c.yaml", store, data, tmp / "run", rl=rl,
                        data={"max_seq_len": 1024, "shuffle": False},
                        train={"steps": 2, "batch_size": 2, "micro_batch_size": 2, "seed": 0},
                        output={"save_every": 0, "keep_last": 1, "export": False})  # fmt: skip


def scripted(monkeypatch, tok_dir: Path) -> None:
    """rl's sampler: rows 0 and 2 of each step call `add` first, then sample."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    call = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def make(*args, **kw):
        return Scripted({0: call, 2: call}, then=Sampler(*args, **kw))

    monkeypatch.setattr(ro, "Sampler", make)


def test_a_run_calls_tools_and_rewards_see_the_turns(store, tmp_path, monkeypatch):
    from horizon_cli.train import run_training

    scripted(monkeypatch, store.parent / "hf")
    cfg = config(tmp_path, store)
    run_training(cfg, [], console=Console(quiet=True))
    run = tmp_path / "run"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["tools/call_frequency"] for r in rows] == [0.5, 0.5]  # 2 calls over 4 completions
    assert all(r["tools/failure_frequency"] == 0.0 for r in rows)
    recs = [json.loads(x) for x in (run / "rollouts" / "step-1.jsonl").read_text().splitlines()]
    for k, r in enumerate(recs):
        roles = [m["role"] for m in r["messages"]]
        assert len(r["tool_mask"]) == len(r["completion_ids"])
        if k in (0, 2):  # the call, its result (masked), the answer
            assert roles[:2] == ["assistant", "tool"] and r["messages"][1]["content"] == "7"
            assert 0 in r["tool_mask"] and r["rewards"]["right"] >= 0.5
        else:
            assert "tool" not in roles and all(r["tool_mask"])
            assert r["rewards"]["right"] < 0.5 or "3" in r["messages"][-1]["content"]
    # TRL's num_tokens: prompt + the sampled ids, not a tool result's (the sum of tool_mask)
    assert rows[0]["num_tokens"] == sum(len(r["prompt_ids"]) + sum(r["tool_mask"]) for r in recs)
    assert any(not all(r["tool_mask"]) for r in recs)


@pytest.mark.parametrize(
    "rl, says",
    [
        ({"tools": ["{d}/tools.py:VALUE"]}, "rl.tools[0]: {d}/tools.py has no function 'VALUE'"),
        ({"tools": ["{d}/tools.py:bare"]}, "rl.tools[0] (bare): no tool schema"),
        ({"environment": "{d}/tools.py:multiply"}, "is not a class"),
        (
            {"environment": "{d}/tools.py:Broken"},
            "rl.environment (Broken): its constructor raised RuntimeError: no",
        ),
        ({"environment": "{d}/tools.py:NoReset"}, "rl.environment (NoReset): it has no reset method"),
    ],
)
def test_bad_tools_stop_before_the_run_in_one_line(store, tmp_path, rl, says):
    from horizon_cli.train import run_training

    cfg = config(tmp_path, store, **{k: [x.format(d=tmp_path) for x in v] if isinstance(v, list)
                                     else v.format(d=tmp_path) for k, v in rl.items()})  # fmt: skip
    (tmp_path / "tools.py").write_text(TOOLS_PY + BAD)
    with pytest.raises(InputError) as e:
        run_training(cfg, [], console=Console(quiet=True))
    assert says.format(d=tmp_path) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


BAD = '''
VALUE = 3


def bare(a, b):
    return a


class Broken:
    def __init__(self):
        raise RuntimeError("no")

    def reset(self, **kw):
        pass


class NoReset:
    def look(self) -> str:
        """Look."""
        return "x"
'''


WRAPPER = """
import os, signal, sys
sys.path.insert(0, os.environ["HORIZON_REPO"])  # tests.support: a script's path starts at its own folder
from horizon_cli.model.sample import Sampler
from horizon_cli.recipes.grpo import rollouts as ro, turns
from tests.support.scripted import Scripted

call = [int(x) for x in os.environ["TOOL_CALL_IDS"].split(",")]
ro.Sampler = lambda *a, **k: Scripted({0: call, 2: call}, then=Sampler(*a, **k))
kill_at, made = int(os.environ.get("KILL_AT_RESULT", "0")), [0]
more = turns.ToolRollouts.more


def counted(self, c):
    got = more(self, c)
    made[0] += bool(got)
    if made[0] == kill_at:  # a tool has run, its result not yet fed: mid multi-turn
        os.kill(os.getpid(), signal.SIGKILL)
    return got


turns.ToolRollouts.more = counted
from horizon_cli.cli import main
sys.argv = ["horizon", "train", *sys.argv[1:]]
main()
"""


def test_killed_mid_multi_turn_rollout_resumes_bitwise_identical(store, tmp_path):
    """SIGKILLed in step 3 right after a tool ran (2 results a step: the 5th), the run resumed
    from step 2's checkpoint ends bitwise equal to an uninterrupted one (tests/rl/test_grpo_resume)."""
    import os
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from tests.rl.test_grpo_resume import outcome

    tok = AutoTokenizer.from_pretrained(store.parent / "hf")
    ids = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    (tmp_path / "wrap.py").write_text(WRAPPER)
    root = Path(__file__).resolve().parents[2]
    base = {
        **os.environ,
        "TOOL_CALL_IDS": ",".join(map(str, ids)),
        "OMP_NUM_THREADS": "1",
        "HORIZON_REPO": str(root),
    }
    runs = {}
    for name, kill in (("whole", "0"), ("cut", "5")):
        (tmp_path / name).mkdir()
        cfg = config(tmp_path / name, store)
        text = cfg.read_text().replace("steps: 2", "steps: 4").replace("save_every: 0", "save_every: 2")
        cfg.write_text(text)

        def go(kill: str, cfg: Path = cfg) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, str(tmp_path / "wrap.py"), str(cfg)], env={**base, "KILL_AT_RESULT": kill},
                                  capture_output=True, text=True, timeout=600, cwd=root)  # fmt: skip

        first = go(kill)
        if kill != "0":
            assert first.returncode == -9, first.stderr
            run = tmp_path / name / "run"
            assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_2"]
            first = go("0")
        assert first.returncode == 0, first.stderr
        runs[name] = outcome(tmp_path / name / "run")
    assert runs["cut"] == runs["whole"]
    assert any(r["tools/call_frequency"] > 0 for r in runs["whole"]["metrics"])


@pytest.mark.slow
def test_two_ranks_call_the_tools_one_process_calls(store, tmp_path, monkeypatch):
    """torchrun 2 ranks (prompt 0's rows on rank 0, prompt 1's on rank 1, each running its own
    tools and environments) = 1 process: the rollouts with their turns, the metrics, the losses."""
    import os
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from tests.parallel.test_dist import torchrun

    tok = AutoTokenizer.from_pretrained(store.parent / "hf")
    ids = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    (tmp_path / "wrap.py").write_text(WRAPPER)
    root = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("TOOL_CALL_IDS", ",".join(map(str, ids)))
    monkeypatch.setenv("HORIZON_REPO", str(root))
    cfgs = {}
    for n in ("one", "two"):
        (tmp_path / n).mkdir()
        cfgs[n] = config(tmp_path / n, store)
    one = subprocess.run([sys.executable, str(tmp_path / "wrap.py"), str(cfgs["one"])], capture_output=True,
                         text=True, timeout=600, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert one.returncode == 0, one.stderr
    two = torchrun(2, cfgs["two"], cli=False, script=str(tmp_path / "wrap.py"), timeout=600)
    assert two.returncode == 0, two.stderr
    a, b = (read_metrics(tmp_path / n / "run" / "metrics.jsonl") for n in ("one", "two"))
    for x, y in zip(a, b, strict=True):
        for k in ("loss", "grad_norm", "reward", "completions/mean_length", "tools/call_frequency"):
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), k
    assert a[0]["tools/call_frequency"] == 0.5
    for s in (1, 2):
        la, lb = (
            (tmp_path / n / "run" / "rollouts" / f"step-{s}.jsonl").read_text().splitlines()
            for n in ("one", "two")
        )
        strip = [[{k: v for k, v in json.loads(u).items() if k != "advantage"} for u in x] for x in (la, lb)]
        assert strip[0] == strip[1]
