"""HF checkpoint -> store -> HF checkpoint, for every family, tying, checkpoint kind and dtype.

The oracle is transformers: the exported checkpoint must hold bitwise the tensors that were
converted (nothing trained), and `AutoModelForCausalLM.from_pretrained(DST)` must give the
source model's logits (fp32 store: the source's; bf16 store: the source cast to bf16).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from horizon_cli.convert import convert
from horizon_cli.convert import hf_files as ckpt_mod
from horizon_cli.export import export
from horizon_cli.store import DTYPES, Store
from tests.support.tiny import make_model, save

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ["llama", "llama31", "mistral", "qwen2", "qwen3"]
KINDS = ["safetensors", "sharded", "bin", "sharded_bin"]
COMBOS = [(tie, dtype) for tie in (False, True) for dtype in ("float32", "bfloat16")]
# Every family meets every kind; every kind meets both tyings and both dtypes.
CASES = [
    (fam, tie, KINDS[(i + j) % len(KINDS)], dtype)
    for i, fam in enumerate(FAMILIES)
    for j, (tie, dtype) in enumerate(COMBOS)
]
IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))  # (B, T)


def save_sharded_bin(model, path: Path) -> Path:
    """Two pytorch_model-0000k-of-00002.bin shards and a pytorch_model.bin.index.json, the layout
    transformers 4 wrote for large .bin checkpoints."""
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    names = list(sd)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for k, part in enumerate(halves):
        fname = f"pytorch_model-{k + 1:05d}-of-00002.bin"
        torch.save({n: sd[n] for n in part}, path / fname)
        weight_map.update({n: fname for n in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def write_source(model, path: Path, kind: str) -> Path:
    return save_sharded_bin(model, path) if kind == "sharded_bin" else save(model, path, kind)


def exported_tensors(dst: Path) -> dict[str, torch.Tensor]:
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(load_file(dst / f))
    assert set(out) == set(index["weight_map"])
    return out


def expected_tensors(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


def cast_params(model, dtype: torch.dtype):
    """The model with its parameters in dtype, as from_pretrained(dtype=...) builds it: unlike
    `model.to(dtype)` this leaves the fp32 RoPE buffers (inv_freq) alone."""
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize(("family", "tie", "kind", "dtype"), CASES, ids=lambda v: str(v))
def test_round_trip(tmp_path, family, tie, kind, dtype):
    model = make_model(family, tie=tie)
    src = write_source(model, tmp_path / "src", kind)
    info = convert(src, tmp_path / "store", dtype=dtype)
    assert info["params"] == sum(p.numel() for p in model.parameters())
    export(tmp_path / "store", tmp_path / "dst")

    want = expected_tensors(model, DTYPES[dtype])
    got = exported_tensors(tmp_path / "dst")
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k  # bitwise

    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert back.dtype == DTYPES[dtype] and back.config.tie_word_embeddings == tie
    if dtype == "float32":
        torch.testing.assert_close(logits(back), logits(model), rtol=0, atol=1e-6)
    else:
        assert torch.equal(logits(back), logits(cast_params(model, torch.bfloat16)))


def test_rope_scaling_survives(tmp_path):
    """Llama 3.1's rope scaling reaches the store's architecture and the exported config."""
    src = save(make_model("llama31"), tmp_path / "src")
    convert(src, tmp_path / "store", dtype="float32")
    rope = Store.open(tmp_path / "store").arch.rope
    assert (
        rope["rope_type"] == "llama3"
        and rope["factor"] == 8.0
        and rope["original_max_position_embeddings"] == 64
    )
    export(tmp_path / "store", tmp_path / "dst")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "dst")
    params = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert params["rope_type"] == "llama3" and params["factor"] == 8.0


def test_float16_store(tmp_path):
    model = make_model("qwen2")
    convert(save(model, tmp_path / "src"), tmp_path / "store", dtype="float16")
    export(tmp_path / "store", tmp_path / "dst")
    got = exported_tensors(tmp_path / "dst")
    for k, v in expected_tensors(model, torch.float16).items():
        assert torch.equal(got[k], v), k
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["dtype"] == "float16"


def test_pieces_of_large_tensors(tmp_path, monkeypatch):
    """Tensors larger than a read piece stream in many pieces (from safetensors and from .bin)
    and land bitwise where one whole read would put them."""
    model = make_model("llama", tie=False)
    monkeypatch.setattr(ckpt_mod, "CHUNK_BYTES", 1000)  # not a multiple of 4: pieces end mid-row
    for kind in ("safetensors", "bin"):
        src = write_source(model, tmp_path / kind, kind)
        seen = []
        real = ckpt_mod.Checkpoint.tensors

        def spy(self, names, real=real, seen=seen):
            for name, pieces in real(self, names):
                yield name, (seen.append(p.numel() * p.element_size()) or p for p in pieces)

        monkeypatch.setattr(ckpt_mod.Checkpoint, "tensors", spy)
        convert(src, tmp_path / f"store_{kind}", dtype="bfloat16")
        monkeypatch.setattr(ckpt_mod.Checkpoint, "tensors", real)
        assert max(seen) <= 1000 and len(seen) > 2 * len(model.state_dict())
        export(tmp_path / f"store_{kind}", tmp_path / f"dst_{kind}")
        got = exported_tensors(tmp_path / f"dst_{kind}")
        for k, v in expected_tensors(model, torch.bfloat16).items():
            assert torch.equal(got[k], v), k


def test_bin_pages_are_released(tmp_path, monkeypatch):
    """A mapped .bin drops each tensor's pages once its write is done, so RSS does not grow to the
    file; the last tensor's pages go with the mapping."""
    model = make_model("llama")
    src = save(model, tmp_path / "src", "bin")
    released = []
    monkeypatch.setattr(ckpt_mod, "release_pages", lambda t: released.append(tuple(t.shape)))
    convert(src, tmp_path / "store", dtype="float32")
    assert len(released) == len(model.state_dict()) - 1


def test_legacy_bin_format(tmp_path):
    """Pre-1.6 (non-zip) .bin files cannot be mapped; they still convert, weights-only."""
    model = make_model("mistral", tie=True)
    src = tmp_path / "src"
    src.mkdir()
    model.config.save_pretrained(src)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    torch.save(sd, src / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    convert(src, tmp_path / "store", dtype="float32")
    export(tmp_path / "store", tmp_path / "dst")
    got = exported_tensors(tmp_path / "dst")
    for k, v in expected_tensors(model, torch.float32).items():
        assert torch.equal(got[k], v), k


def test_checkpoint_extras_are_skipped(tmp_path):
    """A tied checkpoint that still carries lm_head.weight, and RoPE caches, convert cleanly."""
    model = make_model("llama", tie=True)
    src = tmp_path / "src"
    src.mkdir()
    model.config.save_pretrained(src)
    sd = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    from safetensors.torch import save_file

    save_file(sd, src / "model.safetensors")
    convert(src, tmp_path / "store", dtype="float32")
    assert Store.open(tmp_path / "store").manifest.params == sum(p.numel() for p in model.parameters())


def test_tokenizer_and_configs_travel(tmp_path):
    """Config, generation config, tokenizer and chat template files reach the store and the export."""
    model = make_model("qwen3")
    src = save(model, tmp_path / "src")
    extras = {
        "tokenizer.json": "{}",
        "tokenizer_config.json": '{"model_max_length": 64}',
        "special_tokens_map.json": "{}",
        "chat_template.jinja": "{{ messages }}",
    }
    for name, text in extras.items():
        (src / name).write_text(text)
    convert(src, tmp_path / "store")
    export(tmp_path / "store", tmp_path / "dst")
    for name, text in extras.items():
        assert (tmp_path / "store" / "hf" / name).read_text() == text
        assert (tmp_path / "dst" / name).read_text() == text
    assert (tmp_path / "dst" / "generation_config.json").is_file()
    cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["model_type"] == "qwen3"
