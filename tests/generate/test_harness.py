"""horizon as an lm-evaluation-harness model, offline: local tasks (YAML over local JSONL files)
of every request type — multiple choice (loglikelihood), generation (generate_until) and
perplexity (loglikelihood_rolling) — score the same on `--model horizon` (the streamed engine on a
store) as on lm-eval's own `hf` model on the store's export, request by request, with and without
the tokenizer's chat template; `horizon eval`'s bad arguments are one line each (exit 2)."""

from __future__ import annotations

import json
import math

import pytest
from rich.console import Console

from tests.conftest import store_with_tokenizer, write_jsonl
from tests.train.test_train_cli import horizon, one_error_line

lm_eval = pytest.importorskip("lm_eval")

from horizon_cli import api  # noqa: E402
from horizon_cli.errors import InputError  # noqa: E402

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


@pytest.fixture(scope="module")
def export(tiny_store, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "export"
    api.export(tiny_store, out, console=Console(quiet=True))
    return out


def evaluate(model: str, model_args: str, tasks, names=tuple(TASKS), **kw) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import horizon_cli.generate.harness  # noqa: F401 (registers the model)

    return simple_evaluate(model=model, model_args=model_args, tasks=list(names), batch_size=4, log_samples=True, device="cpu",
                           task_manager=TaskManager(include_path=str(tasks), include_defaults=False), **kw)  # fmt: skip


def test_scores_equal_the_hf_model_on_the_export(tiny_store, tasks, export):
    ours = evaluate("horizon", f"path={tiny_store}", tasks)
    ref = evaluate("hf", f"pretrained={export},dtype=float32", tasks)
    same_scores(ours, ref, TASKS)
    gen = [s["resps"][0][0] for s in ours["samples"]["horizon_gen"]]
    assert any(gen), gen  # something was generated


def test_chat_template_prompts_and_scores_equal_the_hf_model(tiny_store, tasks, export):
    """--apply_chat_template (lm-eval's multi-turn few-shot, as its command line sets it): the
    same templated prompts as the hf model builds, scored the same."""
    names = ("horizon_mc", "horizon_gen")
    kw = {"apply_chat_template": True, "fewshot_as_multiturn": True, "num_fewshot": 1}
    ours = evaluate("horizon", f"path={tiny_store}", tasks, names, **kw)
    ref = evaluate("hf", f"pretrained={export},dtype=float32", tasks, names, **kw)
    for task in names:
        a = [s["arguments"] for s in ours["samples"][task]]
        assert a == [s["arguments"] for s in ref["samples"][task]]
        assert all("<|user|>" in str(x) for x in a), a[0]  # the template was applied
    same_scores(ours, ref, names)


def test_chat_template_without_one_is_refused(tmp_path, tasks):
    store = store_with_tokenizer(tmp_path, chat_template=False)
    with pytest.raises(InputError, match="apply_chat_template: the model's tokenizer has no chat template"):
        evaluate("horizon", f"path={store}", tasks, ("horizon_mc",), apply_chat_template=True)


def same_scores(ours: dict, ref: dict, names) -> None:
    for task in names:
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


@pytest.mark.parametrize(
    "args, says",
    [
        ([], "name the tasks to score"),
        (["--tasks", "horizon_nope"], "--tasks horizon_nope: no such task in lm-eval (nor in --include_path"),
        (["--tasks", "nope/x.yaml"], "--tasks nope/x.yaml: no such task file"),
        (["--tasks", "horizon_mc", "--model=hf"], "the model is horizon (drop --model hf)"),
        (["--tasks", "horizon_mc", "-M", "hf"], "the model is horizon (drop --model hf)"),
        (
            ["--tasks", "horizon_mc", "--batch_size", "0"],
            "--batch_size '0' is not a positive integer or auto",
        ),
        (["--tasks", "horizon_mc", "--batch_size", "two"], "--batch_size 'two' is not a positive integer"),
        (["--tasks", "horizon_mc", "--model_args", "batch_size=0"], "--batch_size '0' is not a positive"),
        (
            ["--tasks", "horizon_mc", "--model_args", "batch_size=2", "--batch_size", "3"],
            "--model_args batch_size=2 and --batch_size 3 disagree",
        ),  # fmt: skip
        (["--tasks", "horizon_mc", "--model_args", "kvcache=host"], "--model_args kvcache: not a setting of"),
        (["--tasks", "horizon_mc", "--model_args", "path=/elsewhere"], "--model_args path: the model is SRC"),
        (["--tasks", "horizon_mc", "--no_such_flag"], "unrecognized arguments: --no_such_flag"),
        (["--tasks", "horizon_mc", "--log_samples"], "Specify --output_path"),  # lm-eval's own check
    ],
)
def test_bad_eval_arguments_are_one_line(tiny_store, tasks, args, says):
    """Refused before the engine is built or a task is read: one `error:` line, exit 2."""
    msg = one_error_line(horizon("eval", tiny_store, "--include_path", tasks, *args))
    assert msg.startswith("error: horizon eval: ") and says in msg, msg


def test_batch_size_in_model_args_is_the_batch_size(tiny_store, tasks):
    """`--model_args batch_size=N` (lm-eval passes --batch_size itself: N becomes it, once);
    a bad batch_size is refused from Python too, before the engine is built."""
    from lm_eval._cli.harness import HarnessCLI

    from horizon_cli.generate.harness import HorizonLM, parse_args

    ns = parse_args(
        HarnessCLI(),
        ["--tasks", "horizon_mc", "--include_path", str(tasks), "--model_args", "batch_size=2,kv_cache=host"],
    )
    assert (ns.batch_size, ns.model_args) == ("2", {"kv_cache": "host"})
    for bad in (0, -1, "0", "x"):
        with pytest.raises(InputError, match="--batch_size"):
            HorizonLM(path=str(tiny_store), batch_size=bad)


@pytest.mark.slow  # lm-eval's command line indexes its thousands of built-in task files (~1 min)
def test_horizon_eval_runs_lm_evals_command_line(tiny_store, tasks, tmp_path):
    out = tmp_path / "results"
    r = horizon("eval", tiny_store, "--tasks", "horizon_mc", "--include_path", tasks, "--output_path", out,
                "--model_args", "batch_size=2", "--apply_chat_template")  # fmt: skip
    assert r.exit_code == 0, r.output
    found = list(out.rglob("results_*.json"))
    assert found and "horizon_mc" in json.loads(found[0].read_text())["results"]
