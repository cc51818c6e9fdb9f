"""Bad input to `horizon convert` / `export` / `inspect`: exit 2, one `error:` line naming the
file, tensor or key at fault, no traceback unless --debug, and nothing half-written."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from horizon_cli.cli import app
from horizon_cli.convert import convert
from horizon_cli.errors import InputError
from horizon_cli.store import Store
from tests.conftest import horizon
from tests.support.tiny import make_model, save

RUNNER = CliRunner()


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """An untied 2-layer Llama as one model.safetensors."""
    return save(make_model("llama", tie=False), tmp_path_factory.mktemp("good") / "src")


@pytest.fixture
def src(good, tmp_path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "src"))


@pytest.fixture
def store(good, tmp_path) -> Path:
    convert(good, tmp_path / "store", dtype="bfloat16")
    return tmp_path / "store"


def leftovers(dst: Path) -> list[str]:
    """Temp or moved-aside dirs that a command left beside dst."""
    return [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]


def assert_bad(res, *needles: str, dst: Path | None = None, only_line: bool = True) -> str:
    """Exit 2 with one `error:` line (the last one; the only one unless progress ran) holding every
    needle, no traceback, and no trace of dst."""
    out = res.stdout + res.stderr
    assert res.exit_code == 2, out
    assert "Traceback" not in out
    lines = res.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0] == lines[-1], out
    if only_line:
        assert lines == errors, out
    for n in needles:
        assert n in errors[0], (n, errors[0])
    if dst is not None:
        assert not os.path.lexists(dst) and not leftovers(dst), (dst, leftovers(dst))
    return errors[0]


def st_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def st_write(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


# --- convert: the source ------------------------------------------------------------------------


def test_missing_src(tmp_path):
    assert_bad(
        horizon("convert", tmp_path / "nope", tmp_path / "dst"), "nope: not found", dst=tmp_path / "dst"
    )


def test_src_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    assert_bad(
        horizon("convert", tmp_path / "f", tmp_path / "dst"), "f: not a directory", dst=tmp_path / "dst"
    )


def test_missing_config(src, tmp_path):
    (src / "config.json").unlink()
    assert_bad(horizon("convert", src, tmp_path / "dst"), "config.json: missing", dst=tmp_path / "dst")


def test_config_not_json(src, tmp_path):
    (src / "config.json").write_text("{not json")
    assert_bad(horizon("convert", src, tmp_path / "dst"), "config.json: not valid JSON", dst=tmp_path / "dst")


def test_no_weights(src, tmp_path):
    (src / "model.safetensors").unlink()
    assert_bad(horizon("convert", src, tmp_path / "dst"), f"{src}: no weights found", dst=tmp_path / "dst")


def test_unsupported_architecture(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type="no_such_model", architectures=["NoSuchForCausalLM"])  # not in transformers
    (src / "config.json").write_text(json.dumps(cfg))
    assert_bad(
        horizon("convert", src, tmp_path / "dst"),
        "config.json",
        "NoSuchForCausalLM (model_type 'no_such_model') is not a causal LM in transformers",
        dst=tmp_path / "dst",
    )


def test_config_missing_key(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    del cfg["hidden_size"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert_bad(
        horizon("convert", src, tmp_path / "dst"), "config.json", "'hidden_size'", dst=tmp_path / "dst"
    )


def test_truncated_header(src, tmp_path):
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00")
    assert_bad(
        horizon("convert", src, tmp_path / "dst"), "model.safetensors: truncated", dst=tmp_path / "dst"
    )


@pytest.mark.parametrize("how", ["length", "json", "entry", "dtype", "size"])
def test_corrupted_header(src, tmp_path, how):
    f = src / "model.safetensors"
    header, data = st_parts(f)
    name = "model.layers.0.mlp.up_proj.weight"
    if how == "length":  # a header length far past the end of the file
        f.write_bytes(struct.pack("<Q", 1 << 40) + f.read_bytes()[8:])
    elif how == "json":
        raw = bytearray(f.read_bytes())
        raw[8] = ord("#")
        f.write_bytes(bytes(raw))
    else:
        header[name] = {
            "entry": {"dtype": "F32"},
            "dtype": {**header[name], "dtype": "Q4"},
            "size": {**header[name], "shape": [3, 3]},
        }[how]
        st_write(f, header, data)
    msg = assert_bad(horizon("convert", src, tmp_path / "dst"), "model.safetensors", dst=tmp_path / "dst")
    assert "corrupted" in msg or "unsupported dtype" in msg
    if how in ("entry", "dtype", "size"):
        assert name in msg


def test_truncated_data(src, tmp_path):
    f = src / "model.safetensors"
    header, data = st_parts(f)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    f.write_bytes(f.read_bytes()[:-100])
    assert_bad(
        horizon("convert", src, tmp_path / "dst"), "model.safetensors: truncated", last, dst=tmp_path / "dst"
    )


def test_missing_tensor(src, tmp_path):
    sd = load_file(src / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, src / "model.safetensors")
    assert_bad(
        horizon("convert", src, tmp_path / "dst"),
        "model.layers.1.mlp.up_proj.weight",
        "missing",
        dst=tmp_path / "dst",
    )


def test_extra_tensor(src, tmp_path):
    sd = load_file(src / "model.safetensors")
    sd["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(sd, src / "model.safetensors")
    assert_bad(
        horizon("convert", src, tmp_path / "dst"),
        "model.layers.1.mlp.extra_proj.weight",
        "unexpected",
        dst=tmp_path / "dst",
    )


def test_tensor_from_another_depth(src, tmp_path):
    """A layer the config does not have is an extra tensor."""
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (src / "config.json").write_text(json.dumps(cfg))
    assert_bad(
        horizon("convert", src, tmp_path / "dst"), "model.layers.1.", "unexpected", dst=tmp_path / "dst"
    )


def test_shape_disagrees_with_config(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (src / "config.json").write_text(json.dumps(cfg))
    msg = assert_bad(horizon("convert", src, tmp_path / "dst"), "model.layers.0.mlp.", dst=tmp_path / "dst")
    assert "64" in msg and "config.json implies" in msg and "48" in msg


def test_integer_tensor(src, tmp_path):
    sd = load_file(src / "model.safetensors")
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)
    save_file(sd, src / "model.safetensors")
    assert_bad(
        horizon("convert", src, tmp_path / "dst"), "model.norm.weight", "floating", dst=tmp_path / "dst"
    )


def test_index_lists_a_missing_shard(tmp_path):
    src = save(make_model("qwen2"), tmp_path / "src", "sharded")
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert_bad(horizon("convert", src, tmp_path / "dst"), shard.name, "missing", dst=tmp_path / "dst")


def test_index_not_json(tmp_path):
    src = save(make_model("qwen2"), tmp_path / "src", "sharded")
    (src / "model.safetensors.index.json").write_text("[]")
    assert_bad(
        horizon("convert", src, tmp_path / "dst"), "model.safetensors.index.json", dst=tmp_path / "dst"
    )


def test_truncated_bin(tmp_path):
    src = save(make_model("llama"), tmp_path / "src", "bin")
    f = src / "pytorch_model.bin"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_bad(
        horizon("convert", src, tmp_path / "dst"), "pytorch_model.bin: truncated", dst=tmp_path / "dst"
    )


class Payload:
    """Unpickling this would run code (make a directory); weights_only must refuse it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_bin_with_code_is_refused(tmp_path):
    src = save(make_model("llama"), tmp_path / "src", "bin")
    sd = torch.load(src / "pytorch_model.bin", weights_only=True)
    sd["extra"] = Payload(tmp_path / "pwned")
    torch.save(sd, src / "pytorch_model.bin")
    msg = assert_bad(
        horizon("convert", src, tmp_path / "dst"), "pytorch_model.bin", "weights-only", dst=tmp_path / "dst"
    )
    assert "mkdir" in msg and not (tmp_path / "pwned").exists()


def test_float16_overflow(src, tmp_path):
    """Found while streaming (after progress began): still one error line, nothing left behind."""
    sd = load_file(src / "model.safetensors")
    sd["model.layers.1.mlp.down_proj.weight"][0, 0] = 1e6
    save_file(sd, src / "model.safetensors")
    res = horizon("convert", src, tmp_path / "dst", "--dtype", "float16")
    assert_bad(res, "model.layers.1.mlp.down_proj.weight", "float16", dst=tmp_path / "dst", only_line=False)


def test_disk_full_is_a_runtime_failure(src, tmp_path, monkeypatch):
    """A write error is exit 1 (failure at run time), still one line and nothing left behind."""
    from horizon_cli.store import writer

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer, "_pwrite_all", full)
    res = horizon("convert", src, tmp_path / "dst")
    assert res.exit_code == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error:") and "No space left" in res.stderr
    assert not (tmp_path / "dst").exists() and not leftovers(tmp_path / "dst")


def test_bad_dtype_option(src, tmp_path):
    assert_bad(horizon("convert", src, tmp_path / "dst", "--dtype", "int8"), "--dtype", dst=tmp_path / "dst")


# --- convert: the destination -------------------------------------------------------------------


def test_existing_dst_without_force(src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep").write_text("mine")
    assert_bad(horizon("convert", src, dst), f"{dst}: already exists", "--force")
    assert (dst / "keep").read_text() == "mine" and not leftovers(dst)


def test_force_replaces(src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep").write_text("old")
    res = horizon("convert", src, dst, "--force")
    assert res.exit_code == 0, res.stderr
    assert not (dst / "keep").exists() and Store.open(dst).manifest.params > 0
    assert not leftovers(dst)
    assert oct(dst.stat().st_mode & 0o777) != oct(0o700)  # a normal directory, not mkdtemp's 0700


def test_force_over_a_file(src, tmp_path):
    dst = tmp_path / "dst"
    dst.write_text("a file")
    assert horizon("convert", src, dst, "--force").exit_code == 0
    assert dst.is_dir() and not leftovers(dst)


def test_failed_force_keeps_old_dst(src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep").write_text("old")
    (src / "model.safetensors").write_bytes(b"")
    assert_bad(horizon("convert", src, dst, "--force"), "model.safetensors")
    assert (dst / "keep").read_text() == "old" and not leftovers(dst)


def test_dst_is_src(src):
    assert_bad(horizon("convert", src, src, "--force"), "would replace the source")
    assert (src / "model.safetensors").is_file()


def test_missing_parents_are_not_left_behind(src, tmp_path):
    (src / "model.safetensors").unlink()
    assert_bad(horizon("convert", src, tmp_path / "a" / "b" / "dst"), "no weights")
    assert not (tmp_path / "a").exists()


# --- the store: checksums, structure ------------------------------------------------------------


def flip_byte(store: Path, unit: str = "layer.1") -> tuple[Path, str]:
    """Flip one byte inside the first tensor of `unit`; returns (unit file, tensor HF name)."""
    m = json.loads((store / "manifest.json").read_text())
    u = next(u for u in m["units"] if u["name"] == unit)
    t = u["tensors"][1]
    path = store / u["file"]
    raw = bytearray(path.read_bytes())
    raw[t["offset"] + 3] ^= 0x40
    path.write_bytes(bytes(raw))
    return path, t["hf"]


def test_verify_passes(store):
    res = RUNNER.invoke(app, ["inspect", str(store), "--verify"])
    assert res.exit_code == 0, res.stderr
    assert "verified" in res.stdout


def test_checksum_fails_verify(store):
    path, hf = flip_byte(store)
    assert horizon("inspect", store).exit_code == 0  # opening reads no data
    assert_bad(horizon("inspect", store, "--verify"), str(path), hf, "checksum", only_line=False)


def test_checksum_fails_export(store, tmp_path):
    path, hf = flip_byte(store)
    assert_bad(
        horizon("export", store, tmp_path / "dst"), str(path), hf, dst=tmp_path / "dst", only_line=False
    )


def test_checksum_fails_read_unit(store):
    flip_byte(store)
    s = Store.open(store)
    out = torch.empty(s.layout("layer.1").numel, dtype=s.dtype)
    s.read_unit("layer.0", torch.empty(s.layout("layer.0").numel, dtype=s.dtype))  # intact units load
    with pytest.raises(InputError, match="checksum mismatch in tensor model.layers.1"):
        s.read_unit("layer.1", out)


def test_export_missing_src(tmp_path):
    assert_bad(
        horizon("export", tmp_path / "nope", tmp_path / "dst"), "nope: not found", dst=tmp_path / "dst"
    )


def test_export_not_a_store(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_bad(
        horizon("export", tmp_path / "empty", tmp_path / "dst"),
        "empty: neither a store",
        dst=tmp_path / "dst",
    )


def test_export_existing_dst(store, tmp_path):
    (tmp_path / "dst").mkdir()
    assert_bad(horizon("export", store, tmp_path / "dst"), "already exists")


def test_inspect_not_a_store(tmp_path):
    assert_bad(horizon("inspect", tmp_path), "not a horizon store")
    assert_bad(horizon("inspect", tmp_path / "nope"), "nope: not found")


def test_corrupt_manifest(store):
    (store / "manifest.json").write_text('{"format": "horizon-store"')
    assert_bad(horizon("inspect", store), "manifest.json: corrupt manifest")


def test_manifest_disagrees_with_layout(store):
    m = json.loads((store / "manifest.json").read_text())
    m["units"][1]["tensors"][1]["offset"] += 2
    (store / "manifest.json").write_text(json.dumps(m))
    assert_bad(horizon("inspect", store), "manifest.json", "layer.0")


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_unit_file_damaged(store, how):
    f = store / "units" / "layer_0001.bin"
    if how == "missing":
        f.unlink()
    else:
        os.truncate(f, 100)
    assert_bad(horizon("inspect", store), str(f), how)


# --- the real entry point -----------------------------------------------------------------------


def test_debug_shows_the_exception(tmp_path):
    res = RUNNER.invoke(app, ["--debug", "convert", str(tmp_path / "nope"), str(tmp_path / "dst")])
    assert isinstance(res.exception, InputError) and "not found" in str(res.exception)


def test_console_script_exit_status(tmp_path):
    """Through the installed entry point (a new process): status 2 and one line on stderr."""
    cmd = [
        sys.executable,
        "-c",
        "from horizon_cli.cli import main; main()",
        "convert",
        str(tmp_path / "nope"),
        "x",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'}: not found"]
    assert not (tmp_path / "x").exists()
