"""A LoRA run end to end: `horizon train` with a lora section, a run killed with SIGKILL resumes
bitwise, and its outputs work with PEFT: `PeftModel.from_pretrained(base, run/adapter)` gives the
logits of the merged `run/export` (1e-5, fp32); `horizon export RUN DST --adapter` writes the
adapter alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from horizon_cli.train.metrics import read_metrics
from tests.conftest import chat_rows, write_config, write_jsonl

peft = pytest.importorskip("peft")

HORIZON = [sys.executable, "-m", "horizon_cli.cli"]
SECTIONS = dict(
    lora={
        "r": 4,
        "alpha": 8,
        "targets": ["q_proj", "v_proj", "down_proj"],
        "use_rslora": True,
        "dropout": 0.1,
    },
    output={"export": True, "keep_last": 1, "save_every": 2},
)


def train(cfg: Path, fault: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "HORIZON_FAULT": fault, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*HORIZON, "train", str(cfg)], env=env, capture_output=True, text=True, timeout=300)


def outcome(run: Path) -> dict:
    """What must be bitwise equal to an uninterrupted run: the last checkpoint's adapter and
    moments, the merged export and the adapter dir, the losses."""
    ck = run / "checkpoints" / "step_6"
    files = {f"ck/{p.relative_to(ck)}": p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    files = {
        k: v for k, v in files.items() if not k.endswith(("config.yaml", "checksums.json", "trainer.json"))
    }
    for d in ("export", "adapter"):
        files |= {f"{d}/{p.name}": p.read_bytes() for p in (run / d).iterdir()}
    assert "ck/state/lora.1.m.bin" in files and "adapter/adapter_model.safetensors" in files, sorted(files)
    return {"files": files, "losses": [m["loss"] for m in read_metrics(run / "metrics.jsonl")]}


@pytest.fixture(scope="module")
def reference(tiny_store, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-ref")
    data = write_jsonl(tmp / "chat.jsonl", chat_rows())
    cfg = write_config(tmp / "cfg.yaml", tiny_store, data, tmp / "run", **SECTIONS)
    r = train(cfg)
    assert r.returncode == 0, r.stderr
    return data, tmp / "run"


@pytest.mark.slow  # a kill and a resume (tests/train/test_train_resume.py keeps the fast ones)
def test_killed_lora_run_resumes_bitwise(tiny_store, reference, tmp_path):
    data, ref_run = reference
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", **SECTIONS)
    killed = train(cfg, "after-step:3")
    assert killed.returncode == -9, killed.stderr
    resumed = train(cfg)
    assert resumed.returncode == 0, resumed.stderr
    assert "(step2)" in "".join(resumed.stdout.split())
    ours, ref = outcome(tmp_path / "run"), outcome(ref_run)
    assert ours["losses"] == ref["losses"]
    assert ours["files"].keys() == ref["files"].keys()
    for k in ref["files"]:
        assert ours["files"][k] == ref["files"][k], k
    losses = ref["losses"]
    assert losses[-1] != losses[0]


def test_peft_loads_the_adapter_and_matches_the_merged_export(tiny_store, reference, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from horizon_cli.export import export

    _, run = reference
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert (
        cfg["peft_type"] == "LORA"
        and cfg["r"] == 4
        and cfg["use_rslora"] is True
        and cfg["lora_dropout"] == 0.1
    )
    assert cfg["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    keys = set(load_file(str(run / "adapter" / "adapter_model.safetensors")))
    want = {
        f"base_model.model.model.layers.{i}.{m}.lora_{ab}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
        for ab in "AB"
    }
    assert keys == want  # PEFT would load a partial file silently (strict=False)
    base = AutoModelForCausalLM.from_pretrained(tiny_store.parent / "hf", dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, run / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32).eval()
    ids = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_store.parent / "hf", dtype=torch.float32)(
            input_ids=ids
        )
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    assert not torch.allclose(plain.logits, b, atol=1e-4)  # the adapters did change the model
    export(run, tmp_path / "again")  # the run dir (its latest checkpoint), as `horizon export RUN DST`
    for f in (run / "export").glob("*.safetensors"):
        assert (tmp_path / "again" / f.name).read_bytes() == f.read_bytes()
    export(run, tmp_path / "adapter-only", adapter=True)
    assert sorted(p.name for p in (tmp_path / "adapter-only").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (tmp_path / "adapter-only" / "adapter_model.safetensors").read_bytes() == (
        run / "adapter" / "adapter_model.safetensors"
    ).read_bytes()


def test_resuming_with_lora_switched_is_refused(tiny_store, reference, tmp_path):
    """A LoRA run dir cannot go on as full fine-tuning (its checkpoints hold adapters), and the
    lora settings are trajectory keys."""
    from rich.console import Console

    from horizon_cli.errors import InputError
    from horizon_cli.train import run_training

    data, run = reference
    quiet = Console(quiet=True)
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, run, output=SECTIONS["output"])
    with pytest.raises(InputError, match="holds a LoRA checkpoint"):
        run_training(cfg, [], dry_run=True, console=quiet)
    sections = {**SECTIONS, "lora": {**SECTIONS["lora"], "r": 8}, "train": {"steps": 8}}
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, run, **sections)
    with pytest.raises(InputError, match="lora.r 4 -> 8"):
        run_training(cfg, [], dry_run=True, console=quiet)
