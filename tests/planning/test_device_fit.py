"""The device fit check, on the CUDA branch with a faked torch.cuda: a plan larger than the free
device memory is refused before anything loads (exit 2, with the numbers); one that fits passes."""

import pytest
import torch
from typer.testing import CliRunner

from horizon_cli.arch import spec_from_hf
from horizon_cli.config.schema import EngineConfig
from horizon_cli.errors import InputError
from horizon_cli.planning import fit
from horizon_cli.planning.memory import memory_plan
from tests.conftest import chat_rows, write_config, write_jsonl

LLAMA_8B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
)
GiB = 1 << 30


@pytest.fixture
def gpu(monkeypatch):
    """One 80 GiB CUDA device (compute capability 9.0) with `free` bytes free."""
    state = {"free": 80 * GiB, "asked": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))

    def mem_get_info(index=None):
        state["asked"].append(index)
        return state["free"], 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return state


def plan(micro: int, seq: int = 8192):
    return memory_plan(spec_from_hf(LLAMA_8B), batch=64, micro_batch=micro, seq=seq)


def test_a_plan_larger_than_the_free_device_memory_is_refused_with_numbers(gpu):
    gpu["free"] = 40 * GiB
    big = plan(micro=16)
    assert big.device_total > 40 * GiB
    with pytest.raises(InputError) as e:
        fit.check_device_fit(big, EngineConfig(device="cuda"))
    msg = str(e.value)
    assert "cuda:0 needs" in msg and "40.00 GiB of 80.00 GiB are free" in msg
    assert f"{big.device_total / GiB:.2f} GiB" in msg and "micro_batch_size" in msg
    assert gpu["asked"] == [0]


def test_a_plan_that_fits_passes_and_the_cpu_is_not_asked(gpu):
    small = plan(micro=1, seq=2048)
    assert small.device_total + fit.RESERVE < 40 * GiB
    gpu["free"] = 40 * GiB
    fit.check_device_fit(small, EngineConfig(device="cuda:0"))
    assert fit.device_fit(small, EngineConfig(device="cpu")) is None
    with pytest.raises(InputError, match="1 CUDA device"):
        fit.check_device_fit(small, EngineConfig(device="cuda:3"))


def test_train_refuses_before_loading(gpu, tiny_store, tmp_path):
    gpu["free"] = 0  # nothing fits
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", engine={"device": "cuda"})
    from horizon_cli.cli import app

    r = CliRunner().invoke(app, ["train", str(cfg)])
    assert r.exit_code == 2, r.output
    assert "device memory plan does not fit" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
