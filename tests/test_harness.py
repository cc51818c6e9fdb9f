"""horizon as an lm-evaluation-harness model, offline: local tasks (YAML over local JSONL files)
of every request type — multiple choice (loglikelihood), generation (generate_until) and
perplexity (loglikelihood_rolling) — score the same on `--model horizon` (the streamed engine on a
store) as on lm-eval's own `hf` model on the store's export, request by request."""

from __future__ import annotations

import json
import math

import pytest
from conftest import write_jsonl
from rich.console import Console
from test_train_cli import horizon

lm_eval = pytest.importorskip("lm_eval")

from horizon_cli import api  # noqa: E402

TASKS = {
    "horizon_mc": """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "horizon_gen": """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "horizon_ppl": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
}

DOCS = {
    "horizon_mc": [
        {"question": "Paris is the capital of", "choices": [" France", " Germany", " the sky"], "answer": 0},
        {"question": "one two three", "choices": [" four", " five six", " ten"], "answer": 0},
        {"question": "The quick brown fox", "choices": [" jumps", " sleeps"], "answer": 0},
        {"question": "", "choices": ["Hello world", "hello sea"], "answer": 1},
    ],
    "horizon_gen": [
        {"question": "Berlin is the capital of", "answer": " Germany"},
        {"question": "Write a short poem about the", "answer": " sea"},
        {"question": "How are you", "answer": " today"},
    ],
    # the second text is longer than the model's 128 positions: several rolling windows
    "horizon_ppl": [
        {"text": "The quick brown fox jumps over the lazy dog."},
        {"text": " ".join(["one two three"] * 60)},
    ],
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    for name, body in TASKS.items():
        data = write_jsonl(root / f"{name}.jsonl", DOCS[name])
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        (root / f"{name}.yaml").write_text(head + body)
    return root


def evaluate(model: str, model_args: str, tasks) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import horizon_cli.generate.harness  # noqa: F401 (registers the model)

    return simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), batch_size=4, log_samples=True, device="cpu",
                           task_manager=TaskManager(include_path=str(tasks), include_defaults=False))  # fmt: skip


def test_scores_equal_the_hf_model_on_the_export(tiny_store, tasks, tmp_path):
    api.export(tiny_store, tmp_path / "export", console=Console(quiet=True))
    ours = evaluate("horizon", f"path={tiny_store}", tasks)
    ref = evaluate("hf", f"pretrained={tmp_path / 'export'},dtype=float32", tasks)
    for task in TASKS:
        a, b = ours["samples"][task], ref["samples"][task]
        assert len(a) == len(b) == len(DOCS[task])
        for sa, sb in zip(a, b, strict=True):
            for ra, rb in zip(sa["resps"], sb["resps"], strict=True):
                ra, rb = ra[0], rb[0]
                if isinstance(ra, str):  # generate_until: the same text
                    assert ra == rb
                elif isinstance(ra, list | tuple):  # loglikelihood: (log-prob, is greedy)
                    assert math.isclose(ra[0], rb[0], rel_tol=1e-5, abs_tol=1e-5) and ra[1] == rb[1]
                else:  # loglikelihood_rolling: a log-prob
                    assert math.isclose(ra, rb, rel_tol=1e-5)
        for metric, value in ref["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert math.isclose(ours["results"][task][metric], value, rel_tol=1e-5), (task, metric)
    gen = [s["resps"][0][0] for s in ours["samples"]["horizon_gen"]]
    assert any(gen), gen  # something was generated


@pytest.mark.slow  # lm-eval's command line indexes its thousands of built-in task files (~1 min)
def test_horizon_eval_runs_lm_evals_command_line(tiny_store, tasks, tmp_path):
    out = tmp_path / "results"
    r = horizon("eval", tiny_store, "--tasks", "horizon_mc", "--include_path", tasks, "--output_path", out,
                "--batch_size", "2")  # fmt: skip
    assert r.exit_code == 0, r.output
    found = list(out.rglob("results_*.json"))
    assert found and "horizon_mc" in json.loads(found[0].read_text())["results"]
