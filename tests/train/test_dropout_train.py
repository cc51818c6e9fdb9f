"""`horizon train` of a model with dropout (GPT-2's defaults): a run killed and resumed ends bit
for bit as the uninterrupted one, and `model.dropout: 0` trains it as the same model converted
with every dropout at 0 (recorded in the run's config; the store is not changed)."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import transformers
import yaml
from rich.console import Console
from safetensors.torch import load_file

from horizon_cli import api
from horizon_cli.convert import convert
from tests.conftest import chat_rows, horizon, write_config, write_jsonl
from tests.support.tiny import save
from tests.support.tokenizer import make_tokenizer
from tests.train.test_train_resume import SECTIONS, outcome

OFF = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "summary_first_dropout": 0.0}


def gpt2_store(root, **over):
    """transformers' default GPT-2 config (attn / resid / embd_pdrop 0.1), tiny, with the tiny tokenizer."""
    cfg = transformers.GPT2Config(vocab_size=400, n_embd=32, n_layer=2, n_head=4, n_positions=128, **over)
    transformers.set_seed(0)
    save(transformers.GPT2LMHeadModel(cfg).float().eval(), root / "hf")
    make_tokenizer(root / "hf")
    convert(root / "hf", root / "store", dtype="float32")
    return root / "store"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt2")
    return (
        gpt2_store(tmp / "drop"),
        gpt2_store(tmp / "zero", **OFF),
        write_jsonl(tmp / "chat.jsonl", chat_rows()),
    )


def test_stopped_run_resumes_bitwise_identical(stores, tmp_path):
    """Three steps, then the run resumed from its step_2 checkpoint to six, against six at once: the
    same losses, checkpoint and export bit for bit (the masks of steps 3-6 are the uninterrupted
    run's: seeded by the optimizer step the checkpoint holds). tests/train/test_train_resume.py kills
    and resumes runs of a model without dropout in subprocesses."""
    drop, _, data = stores
    sections = {**SECTIONS, "schedule": {"kind": "constant", "warmup_steps": 0}}
    sections["output"] = {**SECTIONS["output"], "keep_last": 2}
    ref = write_config(tmp_path / "ref.yaml", drop, data, tmp_path / "ref", **sections)
    assert horizon("train", ref).exit_code == 0
    cfg = write_config(tmp_path / "cfg.yaml", drop, data, tmp_path / "run", **sections)
    assert horizon("train", cfg, "train.steps=3").exit_code == 0
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_3")  # as if stopped after step 3
    said = io.StringIO()
    api.train(cfg, console=Console(file=said, width=2000))
    assert "resuming from" in said.getvalue() and "step_2 (step 2)" in said.getvalue()
    assert outcome(tmp_path / "run") == outcome(tmp_path / "ref")


def run(tmp_path, name, store, data, **model):
    out = tmp_path / name
    cfg = write_config(
        tmp_path / f"{name}.yaml", store, data, out, output={"export": True}, train={"steps": 3}
    )
    if model:
        raw = yaml.safe_load(cfg.read_text())
        raw["model"].update(model)
        cfg.write_text(yaml.safe_dump(raw))
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    losses = [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return out, losses, load_file(next((out / "export").glob("model-*.safetensors")))


def test_dropout_zero_trains_the_store_converted_without_dropout(stores, tmp_path):
    drop, zero, data = stores
    manifest = (drop / "manifest.json").read_bytes()
    out, losses, weights = run(tmp_path, "off", drop, data, dropout=0)
    _, ref_losses, ref_weights = run(tmp_path, "zero", zero, data)
    _, on_losses, _ = run(tmp_path, "on", drop, data)
    assert losses == ref_losses and on_losses != losses
    assert weights.keys() == ref_weights.keys()
    assert all(weights[k].equal(ref_weights[k]) for k in weights)
    assert len(losses) == 3
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["dropout"] == 0  # the run's
    assert (drop / "manifest.json").read_bytes() == manifest  # not the store's
    assert json.loads((out / "export" / "config.json").read_text())["resid_pdrop"] == 0.1


def test_dry_run_says_what_it_does_with_dropout(stores, tmp_path):
    drop, zero, data = stores
    said = " ".join(horizon("inspect", drop).output.split())
    assert "attn_pdrop 0.1, embd_pdrop 0.1, resid_pdrop 0.1, summary_first_dropout 0.1 (trained;" in said
    assert "dropout" not in horizon("inspect", zero).output
    cfg = write_config(tmp_path / "cfg.yaml", drop, data, tmp_path / "run")
    said = " ".join(horizon("train", cfg, "--dry-run").output.split())
    assert (
        "dropout: on as the model's config sets it (attn_pdrop 0.1, embd_pdrop 0.1, resid_pdrop 0.1" in said
    )
    said = " ".join(horizon("train", cfg, "model.dropout=0", "--dry-run").output.split())
    assert "dropout: off (model.dropout: 0;" in said
    bad = horizon("train", cfg, "model.dropout=0.2")
    assert bad.exit_code == 2 and "model.dropout: 0.2 is above the maximum 0.0" in bad.output
    cfg = write_config(tmp_path / "zero.yaml", zero, data, tmp_path / "run")
    said = horizon("train", cfg, "--dry-run").output
    assert "dropout: on" not in said and "dropout: off" not in said


@pytest.mark.slow  # torchrun's two ranks: over a minute on a 2-core machine
def test_two_ranks_draw_the_masks_of_one(stores, tmp_path):
    """Under torchrun each rank draws the masks of its global micro-batches: 2 ranks train what
    one process trains, the losses to 1e-5 (rank-local masks: rank 1 would draw micro-batch 0's).
    The weights to 1e-3 only: GPT-2's q/k biases get gradients of rounding size, which 3 AdamW
    steps amplify in the sharded sum's order (7e-5 with model.dropout: 0 as well)."""
    from tests.parallel.test_dist import config, losses, one_rank, torchrun, weights

    drop, _, _ = stores
    sections = {"train": {"steps": 3, "batch_size": 4, "micro_batch_size": 2}, "output": {"export": True}}
    sections["engine"] = {"keep_activations": 0}  # every layer recomputed (SavePass)
    one = config(tmp_path, drop, "one", **sections)
    one_rank(one)
    two = config(tmp_path, drop, "two", **sections)
    r = torchrun(2, two)
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 3 and max(abs(x - y) / x for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    wa, wb = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in wa:
        assert float((wa[k] - wb[k]).norm() / wa[k].norm()) < 1e-3, k
