"""Checkpoint conversions that split one disk tensor into several in-memory tensors (arch.disk,
arch.runs): Sarvam-MoE's fused `query_key_value` rows become `q_proj` / `k_proj` / `v_proj`,
LaraMini's `in_proj` four projections. The store holds the disk tensor once with the memory
tensors as views of it; export writes it back as transformers' save_pretrained does, and
transformers loads the export to the same tensors. What the store cannot hold is refused naming
the operation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from horizon_cli.arch import runs as R
from horizon_cli.convert import convert
from horizon_cli.errors import InputError
from horizon_cli.export import export
from horizon_cli.store import Store
from tests.support.census_config import build, tiny_config
from tests.support.oracle import one_thread  # noqa: F401 (autouse fixture: tiny models on one thread)

FUSED = {
    "sarvam_moe": ("attention.query_key_value.weight", ["q_proj", "k_proj", "v_proj"], "self_attn."),
    "lara_mini": (
        "linear_attn.in_proj.weight",
        ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"],
        "linear_attn.",
    ),
}


def _saved(mt: str, root: Path):
    torch.manual_seed(0)
    model = build(mt, tiny_config(mt, 2)).float()
    model.save_pretrained(root / "hf")
    return model


def _weights(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("mt", sorted(FUSED))
def test_split_round_trip(mt, tmp_path):
    from transformers import AutoModelForCausalLM

    model = _saved(mt, tmp_path)
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    store = Store.open(tmp_path / "store")
    disk_name, targets, where = FUSED[mt]
    lay = store.layout("layer.0")
    fused = next(s for s in lay.slots if s.hf == f"model.layers.0.{disk_name}")
    params = [next(p for p in lay.tensors if p.name == f"{where}{t}.weight") for t in targets]
    # the memory tensors back to back over the one disk tensor, in transformers' split order
    assert [p.offset for p in params] == [
        fused.offset + sum(q.numel for q in params[:k]) for k in range(len(params))
    ]
    assert sum(p.numel for p in params) == fused.numel == math.prod(fused.shape)
    flat = store.unit_view("layer.0")
    mem = model.state_dict()
    for p in params:  # the store's views are transformers' own in-memory tensors
        assert torch.equal(flat[p.offset : p.offset + p.numel].view(p.shape), mem[p.hf])

    export(tmp_path / "store", tmp_path / "export")
    src, out = _weights(tmp_path / "hf"), _weights(tmp_path / "export")
    assert set(out) == set(src) and f"model.layers.0.{disk_name}" in out
    assert all(torch.equal(out[k], src[k]) for k in src)  # bitwise: what save_pretrained wrote
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    assert set(back) == set(mem) and all(torch.equal(back[k], mem[k]) for k in mem)


def test_misshapen_fused_tensor_is_named(tmp_path):
    _saved("sarvam_moe", tmp_path)
    f = tmp_path / "hf" / "model.safetensors"
    sd = load_file(f)
    name = "model.layers.1.attention.query_key_value.weight"
    sd[name] = sd[name][:-8].contiguous()
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(InputError, match=rf"{name}.*shape.*Split\(dim=0\)"):
        convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    assert not (tmp_path / "store").exists()


def _place_with(mt: str, converter, disk_edit):
    """arch.disk.place on `mt`'s meta model with `converter` as its only conversion, and its
    checkpoint names edited by disk_edit(mem) -> disk."""
    from horizon_cli.arch import disk as D
    from horizon_cli.arch.generic import meta_model

    cfg = tiny_config(mt, 2).to_dict()
    model = meta_model(cfg, "eager")
    mem = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    orig = D.transforms
    D.transforms = lambda m: ([], [converter])
    try:
        return D.place(model, mem, disk_edit(mem), "config.json")
    finally:
        D.transforms = orig


def _fuse_gate_up(dim: int):
    def edit(mem):
        disk = dict(mem)
        for i in range(2):
            p = f"model.layers.{i}.mlp."
            g, u = disk.pop(p + "gate_proj.weight"), disk.pop(p + "up_proj.weight")
            disk[p + "gate_up_proj.weight"] = (g[0] + u[0], g[1]) if dim == 0 else (g[0], g[1] + u[1])
        return disk

    return edit


def _conv(ops):
    from transformers.core_model_loading import WeightConverter

    return WeightConverter("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"], operations=ops)


def test_chunk_on_dim0_is_held_dim1_refused():
    from transformers.core_model_loading import Chunk, Interleave

    parts, follows = _place_with("llama", _conv([Chunk(dim=0)]), _fuse_gate_up(0))
    up, gate = "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.gate_proj.weight"
    assert follows[up] == gate and parts[up] == []
    assert [(p.hf, p.at) for p in parts[gate]] == [("model.layers.1.mlp.gate_up_proj.weight", 0)]
    with pytest.raises(
        InputError,
        match=r"gate_up_proj.weight needs the checkpoint conversion Chunk\(dim=1\).*not be contiguous",
    ):
        _place_with("llama", _conv([Chunk(dim=1)]), _fuse_gate_up(1))
    with pytest.raises(
        InputError, match=r"Interleave\(dim=0\) \+ Chunk\(dim=0\).*Interleave is not a reordering"
    ):
        _place_with("llama", _conv([Interleave(dim=0), Chunk(dim=0)]), _fuse_gate_up(0))


def _index_of(sym: R.Sym, base: dict[str, int]) -> torch.Tensor:
    idx = [torch.arange(base[n] + a, base[n] + a + k) for n, a, k in sym.runs]
    return (torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)).view(sym.shape)


def test_runs_follow_torch():
    """Each operation on runs against torch's own on tensors of element indices."""
    shapes = {"a": (3, 4, 5), "b": (3, 4, 5), "c": (3, 2, 5)}
    base, at = {}, 0
    for n, s in shapes.items():
        base[n], at = at, at + math.prod(s)
    t = {n: torch.arange(base[n], base[n] + math.prod(s)).view(s) for n, s in shapes.items()}
    s = {n: R.Sym.leaf(n, sh) for n, sh in shapes.items()}
    for d in range(3):
        assert torch.equal(_index_of(R.cat([s["a"], s["b"]], d), base), torch.cat([t["a"], t["b"]], d))
    assert torch.equal(
        _index_of(R.cat([s["a"], s["c"], s["b"]], 1), base), torch.cat([t["a"], t["c"], t["b"]], 1)
    )
    for d in range(4):
        assert torch.equal(_index_of(R.stack([s["a"], s["b"]], d), base), torch.stack([t["a"], t["b"]], d))
    for d in range(3):
        for k in (1, 2, 3):
            got = R.chunk(s["a"], d, k)
            want = torch.chunk(t["a"], k, d)
            assert len(got) == len(want) and all(
                torch.equal(_index_of(g, base), w) for g, w in zip(got, want, strict=True)
            )
    got = R.split(R.cat([s["a"], s["c"]], 1), 1, [1, 3, 2])
    want = torch.split(torch.cat([t["a"], t["c"]], 1), [1, 3, 2], 1)
    assert all(torch.equal(_index_of(g, base), w) for g, w in zip(got, want, strict=True))
    with pytest.raises(R.ShapeError):
        R.stack([s["a"], s["c"]], 0)
    # a split on dim 0 keeps each piece one run; on dim 1 it cuts the rows
    assert [len(p.runs) for p in R.split(s["a"], 0, [1, 2])] == [1, 1]
    assert [len(p.runs) for p in R.split(s["a"], 1, [1, 3])] == [3, 3]


def test_manifest_names_the_group(tmp_path):
    _saved("sarvam_moe", tmp_path)
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    g = json.loads((tmp_path / "store" / "manifest.json").read_text())["arch"]["generic"]
    rows = {e["name"]: e for e in g["kinds"][g["layer_kinds"][1]]}
    assert rows["self_attn.k_proj.weight"]["after"] == "model.layers.{i}.self_attn.q_proj.weight"
    assert rows["self_attn.v_proj.weight"]["parts"] == []
    assert [p["hf"] for p in rows["self_attn.q_proj.weight"]["parts"]] == [
        "model.layers.{i}.attention.query_key_value.weight"
    ]


def test_lora_merged_export_of_a_split(tmp_path):
    """LoRA on q_proj / k_proj (split from query_key_value) and o_proj (renamed from dense): the
    merged export is PEFT's merge, written under the checkpoint's own names."""
    import yaml
    from transformers import AutoModelForCausalLM

    from tests.cli.test_cli_store_errors import horizon
    from tests.support.census_horizon import Data, train_config

    peft = pytest.importorskip("peft")
    _saved("sarvam_moe", tmp_path)
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    data = Data(128)
    cfg_path = train_config(tmp_path, data)
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["train"]["steps"] = 2
    cfg["lora"] = {"r": 4, "alpha": 8, "targets": ["q_proj", "k_proj", "o_proj"]}
    cfg["output"].update(export=True, keep_last=1, save_every=2)
    cfg_path.write_text(yaml.safe_dump(cfg))
    r = horizon("train", cfg_path)
    assert r.exit_code == 0, r.output
    run = tmp_path / "run"
    assert "model.layers.0.attention.query_key_value.weight" in _weights(run / "export")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, run / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids, _ = data.probe()
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits for m in (with_adapter, merged, plain))
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    assert not torch.allclose(b, c, atol=1e-4)  # the adapters did change the model
    sd, ref = merged.state_dict(), plain.state_dict()
    for k in ("q_proj", "k_proj", "o_proj"):  # each adapted tensor moved, v_proj beside them did not
        assert not torch.equal(
            sd[f"model.layers.1.self_attn.{k}.weight"], ref[f"model.layers.1.self_attn.{k}.weight"]
        )
    assert torch.equal(
        sd["model.layers.1.self_attn.v_proj.weight"], ref["model.layers.1.self_attn.v_proj.weight"]
    )


@pytest.mark.parametrize(
    "extra", ["model.layers.1.self_attn.query_key_value.weight", "model.layers.1.self_attn.k_proj.weight"]
)
def test_fused_tensor_given_twice_is_refused(tmp_path, extra):
    """A second tensor for what the fused one fills (under the renamed name, or one of its targets)."""
    model = _saved("sarvam_moe", tmp_path)
    f = tmp_path / "hf" / "model.safetensors"
    sd = load_file(f)
    sd[extra] = (
        model.state_dict()[extra].clone()
        if extra in model.state_dict()
        else sd[extra.replace("self_attn", "attention")].clone()
    )
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(InputError, match="doubled"):
        convert(tmp_path / "hf", tmp_path / "store", dtype="float32")


@pytest.mark.slow
def test_unaligned_split_trains_as_transformers(tmp_path):
    """The census oracle (3 AdamW steps: losses, gradients, exported weights, logits) on a
    Sarvam-MoE whose q / k / v pieces are no ALIGN multiples: k_proj and v_proj start mid-block."""
    from tests.support.census_horizon import Data, perturb, try_horizon

    cfg = tiny_config("sarvam_moe", 2)
    cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads = 40, 10, 3, 1
    torch.manual_seed(0)
    model = build("sarvam_moe", cfg).float()
    perturb(model)
    model.save_pretrained(tmp_path / "hf")
    res = try_horizon(tmp_path / "hf", model, Data(128), True, tmp_path)
    lay = Store.open(tmp_path / "store").layout("layer.0")
    k = next(p for p in lay.tensors if p.name == "self_attn.k_proj.weight")
    assert k.offset % 64 != 0
    assert res["result"] == "exact", res
