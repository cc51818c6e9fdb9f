"""NF4 stores: `convert --quantize nf4` against bitsandbytes (quantize_4bit / dequantize_4bit with
double quantization, and transformers' BitsAndBytesConfig loading) bitwise, the packed layout on
disk and over the link, inspect, export, and the refusal to fully fine-tune one. Older stores:
tests/quant/test_nf4_legacy.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from horizon_cli.quant import nf4, nf4_bnb
from horizon_cli.store import Store
from tests.support.oracle import make_store

# torch.randn weights of a few shapes: several double-quantization groups, and a short last one
WIDE = dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)


def bnb_functional():
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as F

    return F


def bnb_quantize(F, w: torch.Tensor):
    """bitsandbytes' QLoRA quantization of one weight: NF4, blocks of 64, double-quantized absmax."""
    return F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)


def assert_parts_equal(ours: dict[str, torch.Tensor], q: torch.Tensor, st, what: str) -> None:
    """Every byte of a horizon NF4 region's parts against bitsandbytes' packed data and QuantState."""
    theirs = {
        "codes": q.reshape(-1),
        "absmax": st.absmax,
        "absmax2": st.state2.absmax,
        "offset": st.offset.reshape(1),
        "dynamic": st.state2.code,
    }
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k].reshape(-1), t.reshape(-1)), (what, k)


@pytest.mark.parametrize(
    "dtype,over",
    [("float32", {}), ("bfloat16", {}), ("bfloat16", WIDE)],  # float16: the edge cases below
    ids=["float32", "bfloat16", "bfloat16-wide"],
)
def test_stored_nf4_equals_bitsandbytes_bitwise(tmp_path, dtype, over):
    """Each quantized tensor's bytes are bitsandbytes' (codes, 8-bit absmax, group absmax, offset,
    dynamic map), and it dequantizes to exactly bitsandbytes' dequantize_4bit: in Store.tensor
    (export) and in the engine's call, which names no scheme (told from the region's length)."""
    F = bnb_functional()
    model, store = make_store(tmp_path, "llama", False, dtype=dtype, quantize="nf4", **over)
    tdt = getattr(torch, dtype)
    params, n = dict(model.named_parameters()), 0
    for u in store.units:
        for s in store.layout(u.name).slots:
            w = params[s.hf].detach().to(tdt)
            ours = store.tensor(u.name, s.name)
            if not (u.name.startswith("layer.") and w.dim() == 2):
                assert torch.equal(ours, w), s.hf  # norms, embedding, head: the store dtype, untouched
                continue
            p = store.packed[u.name].slot(s.name)
            raw = store.unit_view(u.name)[p.offset : p.offset + p.nbytes]
            # flattened: bitsandbytes' CPU dequantize_4bit (its AVX-512 path) indexes the absmax by
            # row and goes wrong on rows shorter than a block (the tiny model's 32); the bytes are
            # the same either way (quantize_4bit flattens)
            q, st = bnb_quantize(F, w.reshape(-1))
            assert_parts_equal(nf4_bnb.unpack(raw, p.numel), q, st, s.hf)
            ref = F.dequantize_4bit(q, st).view(w.shape)
            assert ours.dtype == ref.dtype == tdt and torch.equal(ours, ref), s.hf
            engine = nf4.dequantize_packed(raw, p.numel, tdt, torch.empty(p.numel, dtype=tdt))
            assert torch.equal(engine.view(ref.shape), ref), s.hf
            n += 1
    assert n == 7 * store.arch.n_layers


def edge_cases(dtype) -> list[torch.Tensor]:
    """Tensors where a quantizer that differs from bitsandbytes' would show it."""
    g = torch.Generator().manual_seed(0)
    mids = ((torch.tensor(nf4_bnb.NF4)[1:] + torch.tensor(nf4_bnb.NF4)[:-1]) / 2).to(dtype)
    x = torch.randn(3 * 256 * 64 + 64, generator=g)  # 3 whole double-quantization groups and 1 block
    x[:64] = 0.0  # an all-zero block
    x[64], x[65:80] = 1.0, mids  # values exactly half-way between two codes once scaled
    x[128], x[129:144] = -2.0, mids * 2
    x[192:256] = 1e-30  # tiny block
    x[1000] = 500.0  # an outlier: its group's absmax dominates
    spread = torch.randn(300 * 64, generator=g) * torch.logspace(-6, 2, 300 * 64)  # absmaxes of every size
    return [
        x.to(dtype),
        spread.to(dtype),
        torch.full((512 * 64,), 0.02, dtype=dtype),  # every absmax equal to their mean: group absmax 0
        torch.zeros(64, dtype=dtype),  # one block of zeros
        torch.randn(64, generator=g).to(dtype),  # one block: one group of one
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantizer_matches_bitsandbytes_at_the_edges(dtype):
    F = bnb_functional()
    for i, x in enumerate(edge_cases(dtype)):
        q, st = bnb_quantize(F, x)
        ours = nf4.quantize(x)
        assert_parts_equal(ours, q, st, f"case {i}")
        buf = torch.zeros(nf4.nbytes(x.numel(), x.element_size()), dtype=torch.uint8)
        nf4.pack(ours, buf)
        out = nf4.dequantize_packed(buf, x.numel(), dtype, torch.empty_like(x))
        assert torch.equal(out, F.dequantize_4bit(q, st).view(-1)), f"case {i}"


def test_the_code_tables_are_bitsandbytes(tmp_path):
    F = bnb_functional()
    assert torch.equal(torch.tensor(nf4_bnb.NF4), F.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(nf4_bnb.dynamic_map(), F.create_dynamic_map())


def test_transformers_bitsandbytes_loading_meets_the_same_base(tmp_path):
    """The standard QLoRA base (transformers + BitsAndBytesConfig nf4, double quantization) holds
    the very bytes of the store, and dequantizes to its tensors: an adapter trained on the store
    (test_lora_engine: the engine against peft on the store's dequantized base) meets that base."""
    F = bnb_functional()
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from horizon_cli.convert import convert
    from tests.support.tiny import make_model, save

    save(make_model("llama", **WIDE).to(torch.bfloat16), tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="bfloat16", quantize="nf4")
    store = Store.open(tmp_path / "store")
    cfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    qm = AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", quantization_config=cfg, dtype=torch.bfloat16, device_map="cpu"
    )
    where = {s.hf: (u.name, s.name) for u in store.units for s in store.layout(u.name).slots}
    n = 0
    for name, mod in qm.named_modules():
        if type(mod).__name__ != "Linear4bit":
            continue
        unit, slot = where[f"{name}.weight"]
        p = store.packed[unit].slot(slot)
        raw = store.unit_view(unit)[p.offset : p.offset + p.nbytes]
        st = mod.weight.quant_state
        assert_parts_equal(nf4_bnb.unpack(raw, p.numel), mod.weight.data, st, name)
        assert torch.equal(F.dequantize_4bit(mod.weight.data, st), store.tensor(unit, slot)), name
        n += 1
    assert n == 7 * store.arch.n_layers


def test_a_layer_crosses_the_link_in_a_quarter_of_the_bytes(tmp_path):
    _, dense = make_store(tmp_path / "d", "llama", False, dtype="bfloat16", **WIDE)
    _, packed = make_store(tmp_path / "q", "llama", False, dtype="bfloat16", quantize="nf4", **WIDE)
    for u in dense.units:
        if u.name.startswith("layer."):
            ratio = packed.unit_bytes(u.name) / dense.unit_bytes(u.name)
            assert 0.25 < ratio < 0.30, ratio  # 4 bits + absmax (1/64 B per weight) + 1 KiB map + norms
    assert packed.unit_bytes("embed") == dense.unit_bytes("embed")
    packed.verify()
    Store.open(packed.root)  # the manifest's packed table agrees with the layout


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "horizon_cli.cli", *map(str, args)], capture_output=True, text=True
    )


def test_cli_inspect_export_and_the_refused_full_finetune(tmp_path):
    from rich.console import Console
    from transformers import AutoModelForCausalLM

    from horizon_cli.export import export
    from horizon_cli.inspect import inspect_store
    from tests.conftest import chat_rows, write_config, write_jsonl

    model, store = make_store(tmp_path, "llama", False, quantize="nf4")
    console = Console(record=True, width=200)
    info = inspect_store(store.root, verify=True, console=console)
    said = console.export_text()
    assert info["quant"] == "nf4" and info["quant_scheme"] == "bnb"
    assert "14 linear weights of the decoder layers as NF4 (bitsandbytes' layout" in said
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
    from horizon_cli.lora.sizes import base_bytes

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


def test_a_weight_with_inf_or_nan_is_refused_and_nothing_is_written(tmp_path):
    """NF4 cannot hold a non-finite weight (its block's scale would be inf or NaN)."""
    from horizon_cli.convert import convert
    from horizon_cli.errors import InputError
    from tests.support.tiny import make_model, save

    model = make_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    save(model, tmp_path / "hf")
    with pytest.raises(InputError) as e:
        convert(tmp_path / "hf", tmp_path / "store", dtype="bfloat16", quantize="nf4")
    assert str(e.value) == (
        "model.layers.1.mlp.up_proj.weight: inf or NaN values in bfloat16, which NF4 cannot quantize"
    )
    assert not (tmp_path / "store").exists() and [p.name for p in tmp_path.iterdir()] == ["hf"]
