"""`horizon generate` as a user runs it: on a store (text, chat and token prompts against
transformers' generate on the same weights), on trained run dirs (full fine-tuning against its
export, LoRA against peft's merged model, QLoRA against its merged export), eval-time samples,
and bad input: one line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from horizon_cli import api
from tests.conftest import chat_rows, store_with_tokenizer, write_config, write_jsonl
from tests.support.tokenizer import make_tokenizer
from tests.train.test_train_cli import horizon, one_error_line

NEW = 8


def hf_completions(model_dir, tok, records: list[dict], new: int = NEW) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time, on the HF checkpoint `model_dir`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_generate(model, ids_of(tok, r), new) for r in records]


def hf_generate(model, ids: list[int], new: int = NEW) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def ids_of(tok, r: dict) -> list[int]:
    if "input_ids" in r:
        return r["input_ids"]
    if "messages" in r:
        text = tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(r["prompt"])["input_ids"]


RECORDS = [
    {"prompt": "Paris is the capital of", "id": "a"},
    {"messages": [{"role": "user", "content": "what is 2 plus 3?"}]},
    {"input_ids": [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]},
    {"prompt": "one two three"},
]


def test_store_completions_equal_transformers(tiny_store, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    out = tmp_path / "out.jsonl"
    r = horizon("generate", tiny_store, "--prompts", prompts, "--max-new-tokens", NEW, "--output", out,
                "--batch-size", 3)  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tok = make_tokenizer(tiny_store / "hf")
    ref = hf_completions(tiny_store.parent / "hf", tok, RECORDS)  # the checkpoint it was converted from
    for rec, row, ids in zip(RECORDS, rows, ref, strict=True):
        assert {k: row[k] for k in rec} == rec  # the input's fields come back
        assert row["completion_ids"] == ids
        assert row["completion"] == tok.decode(ids, skip_special_tokens=True)
        assert row["finish_reason"] in ("eos", "length")
    assert "link" in r.output and "KV cache" in r.output  # the plan is shown first


def test_stop_strings_and_printing_as_they_finish(tiny_store):
    lines: list[str] = []
    res = api.generate(tiny_store, prompts=["Hello world"], max_new_tokens=NEW, console=Console(quiet=True),
                       echo=lines.append)  # fmt: skip
    (row,) = res.rows
    assert len(lines) == 1 and row["completion"] in lines[0]
    text = row["completion"]
    assert len(text) >= 3, text
    stop = text[1:3]
    cut = api.generate(tiny_store, prompts=["Hello world"], max_new_tokens=NEW, stop=[stop],
                       console=Console(quiet=True), echo=lines.append).rows[0]  # fmt: skip
    assert cut["finish_reason"] == "stop" and cut["completion"] == text[: text.find(stop)]


def stop_rule(tok, ids: list[int], text: str, stop: str) -> tuple[str, list[int]]:
    """--stop's documented rule on an uncut greedy run: the completion is the text before the stop's
    first occurrence, its ids the fewest of the run's whose text holds that completion."""
    head = text[: text.find(stop)]
    k = next(k for k in range(len(ids) + 1) if tok.decode(ids[:k], skip_special_tokens=True).startswith(head))
    return head, ids[:k]


def test_stop_cuts_the_ids_where_it_cuts_the_text(tiny_store):
    """Issue 32: with a stop string, completion_ids ran past the stop while completion stopped."""
    tok = make_tokenizer(tiny_store / "hf")

    def run(stop: list[str]) -> dict:  # sampled (greedy repeats one token here): the same draws each run
        return api.generate(tiny_store, prompts=["Hello world"], max_new_tokens=NEW, stop=stop, temperature=1.0,
                            seed=1, console=Console(quiet=True)).rows[0]  # fmt: skip

    full = run([])
    ids, text = full["completion_ids"], full["completion"]
    pieces = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]

    def at_boundary(k: int) -> bool:  # a 2-character stop starting after token k, first seen there
        rest = text[len(pieces[k]) :]
        return text.startswith(pieces[k]) and len(rest) >= 2 and text.find(rest[:2]) == len(pieces[k])

    k = next(k for k in range(1, len(ids)) if pieces[k] and at_boundary(k))
    stop = text[len(pieces[k]) :][:2]
    row = run([stop])
    assert row["finish_reason"] == "stop"
    assert (row["completion"], row["completion_ids"]) == stop_rule(tok, ids, text, stop)
    assert tok.decode(row["completion_ids"], skip_special_tokens=True) == row["completion"] == pieces[k]
    assert row["completion_ids"] == ids[:k] and k < len(ids)
    for stop in (text[1:3], text[-2:]):  # wherever it falls: the ids hold the completion, no more tokens
        row = run([stop])
        assert (row["completion"], row["completion_ids"]) == stop_rule(tok, ids, text, stop)
        assert tok.decode(row["completion_ids"], skip_special_tokens=True).startswith(row["completion"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two-step runs on the tiny store: full fine-tuning, LoRA, and QLoRA on an NF4 store."""
    root = tmp_path_factory.mktemp("gen-runs")
    store = store_with_tokenizer(root / "m", "llama")
    nf4 = root / "nf4"
    api.convert(root / "m" / "hf", nf4, dtype="float32", quantize="nf4", console=Console(quiet=True))
    data = write_jsonl(root / "chat.jsonl", chat_rows(8))
    lora = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}
    prompts = write_jsonl(root / "samples.jsonl", [r for r in RECORDS if "prompt" in r])
    samples = {"eval_every": 1, "samples": str(prompts), "sample_tokens": NEW}  # the full run's eval samples
    out = {}
    for name, model, extra in [
        ("full", store, {"train": {"steps": 2, **samples}}),
        ("lora", store, {"lora": lora}),
        ("qlora", nf4, {"lora": lora}),
    ]:
        sections = {"train": {"steps": 2}, "optim": {"lr": 3e-2}, "output": {"export": True, "save_every": 0}}
        cfg = write_config(root / f"{name}.yaml", model, data, root / name, **{**sections, **extra})
        api.train(cfg, console=Console(quiet=True))
        out[name] = root / name
    return out


def generated(run, records=RECORDS) -> list[list[int]]:
    res = api.generate(run, prompts=[r["prompt"] for r in records if "prompt" in r], max_new_tokens=NEW,
                       console=Console(quiet=True), echo=lambda s: None)  # fmt: skip
    return [row["completion_ids"] for row in res.rows]


@pytest.mark.parametrize("kind", ["full", "qlora"])
def test_run_dir_completions_equal_its_export(runs, kind):
    """The newest checkpoint, full or QLoRA (the NF4 base dequantized on the device), against
    transformers on the run's export (QLoRA: the base dequantized, the adapters merged)."""
    run = runs[kind]
    tok = make_tokenizer(run / "export")
    prompts = [r for r in RECORDS if "prompt" in r]
    assert generated(run, prompts) == hf_completions(run / "export", tok, prompts)


def test_eval_samples_are_the_models_answers_at_each_eval(runs):
    """samples.jsonl: the prompts answered at steps 1 and 2; step 2's answers are those of the run's
    final checkpoint (horizon generate on the run dir), and training changed them."""
    run = runs["full"]
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    prompts = [r["prompt"] for r in RECORDS if "prompt" in r]
    assert [(r["step"], r["prompt"]) for r in rows] == [(s, p) for s in (1, 2) for p in prompts]
    last = [r["completion_ids"] for r in rows if r["step"] == 2]
    assert last == generated(run)
    assert last != [r["completion_ids"] for r in rows if r["step"] == 1]
    assert all(isinstance(r["completion"], str) for r in rows)


def test_lora_run_equals_peft_merged_model(runs):
    from peft import PeftModel

    run = runs["lora"]
    base = AutoModelForCausalLM.from_pretrained(run.parent / "m" / "hf", dtype=torch.float32).eval()
    merged = PeftModel.from_pretrained(base, run / "adapter").merge_and_unload().eval()
    tok = make_tokenizer(run.parent / "m" / "hf")
    prompts = [r for r in RECORDS if "prompt" in r]
    ours = generated(run, prompts)
    assert ours == [hf_generate(merged, ids_of(tok, r)) for r in prompts]
    plain = AutoModelForCausalLM.from_pretrained(run.parent / "m" / "hf", dtype=torch.float32).eval()
    assert ours != [hf_generate(plain, ids_of(tok, r)) for r in prompts]  # the adapters were applied


# ---- bad input: one line, exit 2


def test_bad_input_is_one_line(tiny_store, tmp_path):
    def err(*args) -> str:
        return one_error_line(horizon("generate", *args))

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "no prompts (the file is empty)" in err(tiny_store, "--prompts", empty)
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x"}, {"input_ids": [5] * 200}])
    assert "long.jsonl line 2: the prompt is 200 tokens, longer than the model's 128 positions" in err(
        tiny_store, "--prompts", long
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    assert "bad.jsonl line 2: not JSON" in err(tiny_store, "--prompts", bad)
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "a", "input_ids": [1]}])
    assert "exactly one of prompt, messages, input_ids" in err(tiny_store, "--prompts", both)
    vocab = write_jsonl(tmp_path / "vocab.jsonl", [{"input_ids": [1, 400]}])
    assert "outside the model's vocabulary [0, 400)" in err(tiny_store, "--prompts", vocab)
    assert "--top-p: 1.5" in err(tiny_store, "--prompt", "a", "--temperature", "1", "--top-p", "1.5")
    assert "--max-new-tokens: 0" in err(tiny_store, "--prompt", "a", "--max-new-tokens", "0")
    assert "give a --temperature above 0" in err(tiny_store, "--prompt", "a", "--top-k", "5")
    assert "one of the two" in err(tiny_store, "--prompt", "a", "--prompts", empty)
    assert "neither a store" in err(tmp_path, "--prompt", "a")
    out = tmp_path / "o.jsonl"
    err(tiny_store, "--prompts", long, "--output", out)
    assert not out.exists()


def test_text_prompts_need_a_tokenizer(tmp_path):
    store = store_with_tokenizer(tmp_path, "llama")
    for f in (store / "hf").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    msg = one_error_line(horizon("generate", store, "--prompt", "hello"))
    assert "--prompt 1: 'prompt' needs a tokenizer" in msg and "give input_ids" in msg
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 5, 6]}])
    # issue 32: a --stop here was silently ignored
    msg = one_error_line(horizon("generate", store, "--prompts", ids, "--stop", "x"))
    assert "--stop: stop strings are matched on the decoded text" in msg and "no tokenizer files" in msg
    r = horizon("generate", store, "--prompts", ids, "--max-new-tokens", 3, "--output", tmp_path / "o.jsonl")
    assert r.exit_code == 0, r.output
    row = json.loads((tmp_path / "o.jsonl").read_text())
    assert "completion" not in row and len(row["completion_ids"]) == 3


def test_max_new_tokens_beyond_the_positions_is_said(tiny_store, tmp_path):
    """Issue 32: capped at the model's positions without a word."""
    import io

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hello world"}, {"input_ids": [5] * 120}])
    said = io.StringIO()
    rows = api.generate(
        tiny_store, prompts_file=prompts, max_new_tokens=20, console=Console(file=said, width=400)
    ).rows
    note = next(line for line in said.getvalue().splitlines() if line.startswith("note:"))
    assert (
        "--max-new-tokens 20 is more than the model's 128 positions leave after 1 of the 2 prompt(s)" in note
    )
    assert f"the longest, {prompts} line 2, leaves 8" in note
    assert len(rows[1]["completion_ids"]) <= 8 and len(rows[0]["completion_ids"]) <= 20
    assert rows[1]["finish_reason"] in ("length", "eos")
    said = io.StringIO()
    api.generate(tiny_store, prompts_file=prompts, max_new_tokens=8, console=Console(file=said, width=400))
    assert "note:" not in said.getvalue()  # 8 fit after every prompt


def test_a_bom_is_dropped_from_a_prompts_file(tiny_store, tmp_path):
    """Issue 32: train read a file with a UTF-8 BOM, generate --prompts refused it (one rule now)."""
    plain = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())

    def run(f) -> list[dict]:
        return api.generate(tiny_store, prompts_file=f, max_new_tokens=3, console=Console(quiet=True)).rows

    assert run(bom) == run(plain)
