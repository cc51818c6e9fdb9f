"""`horizon train` as a tool: outputs, dry run, overrides, and every kind of bad input (exit 2,
one line naming what is wrong, nothing half-written)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import chat_rows, horizon, write_config, write_jsonl

METRIC_FIELDS = {
    "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_s", "h2d_bytes", "d2h_bytes",
    "weight_loads", "device_peak_bytes", "host_rss_bytes", "kept_layers",
}  # fmt: skip


def one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("error:")]
    assert len(starts) == 1, r.output  # progress lines may come first; the error comes last, once
    assert "Traceback" not in r.output
    return " ".join(lines[starts[0] :])  # rich may wrap one long line


@pytest.fixture
def run_cfg(tiny_store, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))

    def make(**sections):
        return write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", **sections)

    return make


def test_train_writes_the_run_dir(run_cfg, tmp_path):
    cfg = run_cfg(
        output={"export": True, "save_every": 0},
        log={"plot": True},
        data={"eval_fraction": 0.2},
        train={"eval_every": 3},
    )
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 6
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6]
    assert all(set(m) >= METRIC_FIELDS for m in rows)
    # 2 layers: twice each, but the kept ones once (auto: as many as this machine's RAM holds)
    assert all(m["weight_loads"] == 4 - m["kept_layers"] and 0 <= m["kept_layers"] <= 2 for m in rows)
    assert f"keep_activations: {rows[0]['kept_layers']} of 2 layers kept" in r.output
    assert rows[2]["eval_loss"] is not None and rows[5]["eval_loss"] is not None
    assert rows[-1]["loss"] < rows[0]["loss"]
    final = re.search(r"done: 6 steps, final loss (\d+\.\d{4}), checkpoint", " ".join(r.output.split()))
    assert final and abs(float(final[1]) - rows[-1]["loss"]) <= 5e-5, r.output  # not 17 digits
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_6"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "export")
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 400)


@pytest.mark.parametrize(
    "loss,shown",
    [
        (5.655882679332386, "5.6559"),
        (0.0002021684875370751, "0.0002022"),
        (3.14159e-6, "3.142e-06"),
        (0.0, "0.0000"),
    ],
)
def test_a_loss_prints_as_a_number_for_people(loss, shown):
    from horizon_cli.fmt import fmt_loss

    assert fmt_loss(loss) == shown


def test_tokens_format_and_overrides(run_cfg, tmp_path):
    rows = [
        {"input_ids": list(range(5, 5 + n)), "labels": [-100] * 2 + list(range(7, 5 + n))}
        for n in range(8, 20)
    ]
    data = write_jsonl(tmp_path / "tok.jsonl", rows)
    cfg = run_cfg()
    r = horizon("train", cfg, f"data.path={data}", "data.format=tokens", "train.steps=2", "optim.lr=1e-3")
    assert r.exit_code == 0, r.output
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (
        saved["data"]["format"] == "tokens" and saved["optim"]["lr"] == 1e-3 and saved["train"]["steps"] == 2
    )


def test_dry_run_prints_config_and_plan_and_writes_nothing(run_cfg, tmp_path):
    r = horizon("train", run_cfg(), "--dry-run")
    assert r.exit_code == 0, r.output
    assert "memory plan" in r.output and "bytes per parameter" in r.output and "fits" in r.output
    assert "micro_batch_size" in r.output
    assert not (tmp_path / "run").exists()


def test_dry_run_prints_the_whole_resolved_config(run_cfg):
    """The printed config reads back as the resolved config: no line cropped at the terminal's
    width (CliRunner's console is 80 columns wide; the tmp paths make the data line longer)."""
    from horizon_cli.config import load_config, to_dict

    cfg = run_cfg()
    r = horizon("train", cfg, "--dry-run")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("model:"))
    end = next(i for i, ln in enumerate(lines) if "memory plan" in ln)
    want = to_dict(load_config(cfg))
    assert want["optim"]["grad_release"] == "auto"
    want["optim"]["grad_release"] = "false"  # resolved: the run fits without release
    got = yaml.safe_load("\n".join(lines[start:end]))
    assert got["optim"] == want["optim"]
    assert got == want


def test_config_errors_are_reported_all_at_once(run_cfg):
    r = horizon(
        "train", run_cfg(), "train.stepz=3", "optim.lr=fast", "engine.dtype=int8", "train.batch_size=0"
    )
    msg = one_error_line(r)
    for key in ("train.stepz", "optim.lr", "engine.dtype", "train.batch_size"):
        assert key in msg


def test_missing_config_file_and_bad_yaml(tmp_path):
    assert "not found" in one_error_line(horizon("train", tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert "not valid YAML" in one_error_line(horizon("train", bad))


def test_plan_that_does_not_fit_is_refused(run_cfg, tmp_path):
    msg = one_error_line(
        horizon("train", run_cfg(), "train.batch_size=400000000", "train.micro_batch_size=1")
    )
    assert "does not fit" in msg
    assert not (tmp_path / "run").exists()


BAD_DATA = [
    ([{"text_": "x"}], "chat", "messages"),  # missing fields
    ([], "auto", "empty"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "chat", "train_on_prompt"),  # every label masked
]


@pytest.mark.parametrize("rows,fmt,needle", BAD_DATA)
def test_bad_datasets(run_cfg, tmp_path, rows, fmt, needle):
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    msg = one_error_line(horizon("train", run_cfg(), f"data.path={data}", f"data.format={fmt}"))
    assert needle in msg and "bad.jsonl" in msg
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_chat_without_template(tiny_store, run_cfg, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    tc = store / "hf" / "tokenizer_config.json"
    d = json.loads(tc.read_text())
    d.pop("chat_template", None)
    tc.write_text(json.dumps(d))
    for f in ("chat_template.jinja", "chat_template.json"):
        (store / "hf" / f).unlink(missing_ok=True)
    msg = one_error_line(horizon("train", run_cfg(), f"model.path={store}"))
    assert "chat template" in msg


def test_max_seq_len_beyond_the_model(run_cfg):
    msg = one_error_line(horizon("train", run_cfg(), "data.max_seq_len=4096"))
    assert "max_seq_len" in msg and "128" in msg


def test_model_path_that_is_not_a_store(run_cfg, tmp_path):
    (tmp_path / "empty").mkdir()
    msg = one_error_line(horizon("train", run_cfg(), f"model.path={tmp_path / 'empty'}"))
    assert "not a horizon store" in msg


def test_run_dir_of_a_different_model(tiny_store, run_cfg, tmp_path):
    assert horizon("train", run_cfg(), "train.steps=1").exit_code == 0
    other = tmp_path / "other"
    shutil.copytree(tiny_store, other)
    # a different model: same architecture, one weight changed (so a new fingerprint)
    from horizon_cli.store import Store
    from horizon_cli.store.manifest import MANIFEST

    m = json.loads((other / MANIFEST).read_text())
    m["units"][1]["tensors"][0]["crc32"] ^= 1
    (other / MANIFEST).write_text(json.dumps(m))
    assert Store.open(other)
    msg = one_error_line(horizon("train", run_cfg(), f"model.path={other}"))
    assert "different model" in msg


def test_unwritable_output_dir(run_cfg, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    msg = one_error_line(horizon("train", run_cfg(), f"output.dir={blocker / 'run'}"))
    assert "output.dir" in msg and "not writable" in msg


def test_non_finite_steps_stop_the_run(run_cfg, tmp_path):
    r = horizon(
        "train", run_cfg(), "optim.lr=1e30", "optim.grad_clip=0", "train.max_bad_steps=2", "train.steps=8"
    )
    assert r.exit_code == 1, r.output
    assert "non-finite" in r.output
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(m["skipped"] for m in rows)
    assert Path(tmp_path / "run").is_dir()


def test_tensorboard_without_the_package(run_cfg):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        msg = one_error_line(horizon("train", run_cfg(), "log.tensorboard=true"))
        assert "log.tensorboard" in msg and "pip install tensorboard" in msg
    else:
        r = horizon("train", run_cfg(), "log.tensorboard=true", "train.steps=1")
        assert r.exit_code == 0, r.output
