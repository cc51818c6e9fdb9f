"""NF4 stores: `convert --quantize nf4` against torchao's NF4Tensor (QLoRA's format) bitwise, the
packed layout on disk and over the link, inspect, export, and the refusal to fully fine-tune one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from oracle import make_store

from horizon_cli.quant import nf4
from horizon_cli.store import Store

# torchao's NF4Tensor needs whole groups of 256 blocks of 64: every linear weight a multiple of 16384
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)


def torchao_nf4():
    pytest.importorskip("torchao")
    from torchao.quantization import NF4Tensor

    return NF4Tensor


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dequantized_weights_equal_torchao_bitwise(tmp_path, dtype):
    NF4Tensor = torchao_nf4()
    model, store = make_store(tmp_path, "llama", False, dtype=dtype, quantize="nf4", **WIDE)
    tdt = getattr(torch, dtype)
    n = 0
    for u in store.units:
        for s in store.layout(u.name).slots:
            w = dict(model.named_parameters())[s.hf].detach().to(tdt)
            ours = store.tensor(u.name, s.name)
            if u.name.startswith("layer.") and w.dim() == 2:
                ref = NF4Tensor.from_tensor(w, 64, 256).get_original_weight()
                assert torch.equal(ours, ref), s.hf
                n += 1
            else:  # norms, embedding, head: the store dtype, untouched
                assert torch.equal(ours, w), s.hf
    assert n == 7 * store.arch.n_layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_matches_torchao_at_code_midpoints(dtype):
    """Values exactly half-way between two codes (after scaling) are where a quantizer that does not
    compare as torchao does (in the dtype, lower index on a tie) would pick the other code."""
    NF4Tensor = torchao_nf4()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * 256 * 64, generator=g).to(dtype)
    lut = nf4.code_table(torch.float32)
    mids = ((lut[1:] + lut[:-1]) / 2).to(dtype)
    x[0:64] = 0.0
    x[64] = 1.0
    x[65:80] = mids
    x[128] = -2.0
    x[129:144] = mids * 2
    q = nf4.quantize(x)
    ref = NF4Tensor.from_tensor(x, 64, 256)
    # an all-zero block: torchao compares NaNs (0/0) and stores code -1.0; horizon stores 0.0
    assert torch.equal(q["codes"][32:], ref.quantized_data[32:])
    assert torch.equal(q["scales"], ref.quantized_scalers)
    out = torch.empty_like(x)
    nf4.dequantize(q["codes"], q["scales"], q["factors"], q["mean"].reshape(()), out)
    assert torch.equal(out[64:], ref.get_original_weight()[64:])
    assert torch.equal(out[:64], torch.zeros(64, dtype=dtype))  # an all-zero block stays zero


def test_a_layer_crosses_the_link_in_a_quarter_of_the_bytes(tmp_path):
    _, dense = make_store(tmp_path / "d", "llama", False, dtype="bfloat16", **WIDE)
    _, packed = make_store(tmp_path / "q", "llama", False, dtype="bfloat16", quantize="nf4", **WIDE)
    for u in dense.units:
        if u.name.startswith("layer."):
            ratio = packed.unit_bytes(u.name) / dense.unit_bytes(u.name)
            assert 0.25 < ratio < 0.28, ratio  # 4 bits + scales (1/64 B per weight) + norms
    assert packed.unit_bytes("embed") == dense.unit_bytes("embed")
    packed.verify()
    Store.open(packed.root)  # the manifest's packed table agrees with the layout


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "horizon_cli.cli", *map(str, args)], capture_output=True, text=True
    )


def test_cli_inspect_export_and_the_refused_full_finetune(tmp_path):
    from conftest import chat_rows, write_config, write_jsonl
    from rich.console import Console
    from transformers import AutoModelForCausalLM

    from horizon_cli.export import export
    from horizon_cli.inspect import inspect_store

    model, store = make_store(tmp_path, "llama", False, quantize="nf4")
    console = Console(record=True, width=200)
    info = inspect_store(store.root, verify=True, console=console)
    said = console.export_text()
    assert info["quant"] == "nf4" and "14 linear weights of the decoder layers as NF4" in said
    export(store.root, tmp_path / "hf-out")  # dequantized, in the store dtype
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-out")
    w = back.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w, store.tensor("layer.0", "wq"))
    assert not torch.equal(w, model.model.layers[0].self_attn.q_proj.weight)
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(8))
    cfg = write_config(tmp_path / "c.yaml", store.root, data, tmp_path / "run")
    r = run("train", cfg, "data.format=tokens")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "4-bit (nf4) store, which cannot be fully fine-tuned" in " ".join(
        r.stderr.split()
    )
    assert not (tmp_path / "run").exists()


def test_moe_routers_gates_and_biases_stay_in_the_store_dtype(tmp_path):
    """Routing decisions and biases are not quantized: the router's (E, hidden) weight, a shared
    expert's (1, hidden) gate and gpt-oss's stacked expert biases read back exactly as the store
    dtype holds them; the experts and the other linear weights are NF4; the LoRA plan's base
    bytes are the store's."""
    from horizon_cli.planning.lora import base_bytes

    kept = {"qwen2_moe": {"mlp.gate.weight", "mlp.shared_expert_gate.weight"},
            "gpt_oss": {"mlp.router.weight", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"}}  # fmt: skip
    for fam, names in kept.items():
        model, store = make_store(tmp_path / fam, fam, dtype="bfloat16", quantize="nf4")
        params = dict(model.named_parameters())
        layer = store.manifest.unit("layer.0")
        dtypes = {t.name: t.dtype for t in layer.tensors}
        assert {n for n in names if dtypes[n] == "bfloat16"} == names, dtypes
        assert any(n.startswith("mlp.experts.gate_up_proj") and d == "nf4" for n, d in dtypes.items())
        for n in names:
            hf = store.layout("layer.0").slot(n).hf
            assert torch.equal(store.tensor("layer.0", n), params[hf].detach().bfloat16()), n
        plan = base_bytes(store.arch, "bfloat16", "nf4")
        assert plan == {u.name: store.unit_bytes(u.name) for u in store.units}


def test_a_version_3_store_with_nf4_routers_still_reads(tmp_path, monkeypatch):
    """Stores written before routers were kept (manifest version 3: every tensor of whole NF4
    blocks packed) open, check and dequantize as they were written."""
    import json

    from horizon_cli.store import packed

    with monkeypatch.context() as m:  # an older horizon's packing
        m.setattr(packed, "kept", lambda spec, lay: frozenset())
        model, store = make_store(tmp_path, "mixtral", dtype="bfloat16", quantize="nf4")
    man = store.root / "manifest.json"
    d = json.loads(man.read_text())
    assert d["version"] == 4
    with pytest.raises(Exception, match="does not match its architecture's layout"):
        Store.open(store.root)  # read as a current store, its NF4 router is out of place
    man.write_text(json.dumps({**d, "version": 3}))
    old = Store.open(old_root := store.root)
    assert old.packed["layer.0"].slot("mlp.gate.weight").quant == "nf4"
    old.verify()
    w = model.model.layers[0].mlp.gate.weight.detach().bfloat16()
    got = old.tensor("layer.0", "mlp.gate.weight")
    assert got.shape == w.shape and not torch.equal(got, w)  # dequantized NF4
    assert json.loads(Store.open(old_root).manifest.to_json())["version"] == 3
