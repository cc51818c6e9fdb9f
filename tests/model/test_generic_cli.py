"""The generic path as a tool: `horizon train` on a MoE store end to end (metrics carry the aux loss
and expert load), `horizon inspect` says the path and the parameter split, and `horizon convert`
refuses what the path cannot do with one line naming the missing piece (exit 2, nothing written)."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from horizon_cli.convert import convert
from tests.cli.test_cli_store_errors import assert_bad, horizon
from tests.conftest import chat_rows, write_config, write_jsonl
from tests.support.oracle import one_thread  # noqa: F401 (autouse fixture: tiny models on one thread)
from tests.support.tiny import make_model, save
from tests.support.tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE with its aux loss on, the tiny tokenizer's vocabulary, as the Hub stores it."""
    root = tmp_path_factory.mktemp("moe")
    save(make_model("qwen3_moe", vocab_size=400, output_router_logits=True), root / "hf")
    make_tokenizer(root / "hf")
    return root / "hf"


def test_train_a_moe_store_end_to_end(moe_src, tmp_path):
    convert(moe_src, tmp_path / "store", dtype="float32")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(16))
    cfg = write_config(tmp_path / "cfg.yaml", tmp_path / "store", data, tmp_path / "run", train={"steps": 3})
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(m["weight_loads"] == 4 - m["kept_layers"] for m in rows)
    assert all(m["aux_loss"] > 0 and len(m["expert_imbalance"]) == 2 for m in rows)
    assert all(v >= 1.0 for m in rows for v in m["expert_imbalance"])


def test_inspect_says_path_and_split(moe_src, tmp_path):
    convert(moe_src, tmp_path / "store", dtype="bfloat16")
    r = horizon("inspect", tmp_path / "store")
    assert r.exit_code == 0, r.output
    assert "generic: transformers' Qwen3MoeDecoderLayer" in r.output
    assert "dense / experts" in r.output and "active per token" in r.output and "aux loss" in r.output


@pytest.fixture
def src(moe_src, tmp_path) -> Path:
    return Path(shutil.copytree(moe_src, tmp_path / "src"))


def edit_config(src: Path, **kv) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(kv)
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "change,needles",
    [
        (dict(quantization_config={"quant_method": "mxfp4"}), ["quantized checkpoint", "'mxfp4'"]),
        (dict(layerdrop=0.1), ["layerdrop = 0.1", "layer drop"]),
        (dict(auto_map={"AutoModelForCausalLM": "x.Y"}), ["custom code", "auto_map"]),
        (
            dict(model_type="xlnet", architectures=["XLNetLMHeadModel"]),
            ["XLNetLMHeadModel", "permutation language modelling (not causal)"],
        ),
        (dict(use_bidirectional_attention=True), ["use_bidirectional_attention", "bidirectional attention"]),
        (dict(use_bidirectional_attention="all"), ["use_bidirectional_attention", "bidirectional attention"]),
    ],
    ids=[
        "quantized",
        "layerdrop",
        "custom-code",
        "not-causal",
        "bidirectional",
        "bidirectional-all",
    ],
)
def test_refused_at_convert(src, tmp_path, change, needles):
    edit_config(src, **change)
    assert_bad(horizon("convert", src, tmp_path / "dst"), "config.json", *needles, dst=tmp_path / "dst")


def test_router_aux_loss_the_family_does_not_have(tmp_path):
    src = save(make_model("deepseek_v3", output_router_logits=True), tmp_path / "src")
    assert_bad(
        horizon("convert", src, tmp_path / "dst"), "output_router_logits", "unset it", dst=tmp_path / "dst"
    )


def test_missing_expert_tensor_is_named(src, tmp_path):
    sd = load_file(src / "model.safetensors")
    del sd["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    assert_bad(
        horizon("convert", src, tmp_path / "dst"),
        "model.layers.1.mlp.experts.gate_up_proj",
        "incomplete",
        dst=tmp_path / "dst",
    )


def test_unexpected_tensor_is_named(src, tmp_path):
    sd = load_file(src / "model.safetensors")
    sd["model.layers.0.mlp.extra.weight"] = sd["model.norm.weight"].clone()
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    assert_bad(
        horizon("convert", src, tmp_path / "dst"),
        "unexpected tensor model.layers.0.mlp.extra.weight",
        dst=tmp_path / "dst",
    )


def test_misshapen_expert_tensor_is_named(src, tmp_path):
    sd = load_file(src / "model.safetensors")
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    sd[name] = sd[name][:, :-1].contiguous()
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    assert_bad(horizon("convert", src, tmp_path / "dst"), name, "shape", dst=tmp_path / "dst")


def test_packing_refused_for_recurrent_layers(tmp_path):
    """Bamba's Mamba layers keep a state across the row: packed documents would leak into each other."""
    from horizon_cli.convert import convert
    from tests.support.census_config import build, tiny_config

    build("bamba", tiny_config("bamba", 2)).save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    cfg = write_config(
        tmp_path / "c.yaml", tmp_path / "store", data, tmp_path / "run", data={"packing": True}
    )
    assert_bad(horizon("train", cfg), "data.packing", "BambaMixer", "packing: false")


def test_inspect_names_recurrent_layers(tmp_path):
    from horizon_cli.convert import convert
    from tests.support.census_config import build, tiny_config

    build("bamba", tiny_config("bamba", 2)).save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    import io

    from rich.console import Console

    from horizon_cli import api

    out = io.StringIO()
    api.inspect(tmp_path / "store", console=Console(file=out, width=400))
    assert "recurrent layers (BambaMixer" in out.getvalue() and "packing refused" in out.getvalue(), (
        out.getvalue()
    )


@pytest.mark.parametrize(
    "mt,needles",
    [
        ("bart", ["BartForCausalLM's layers attend to an encoder (encoder_attn)", "encoder-decoder"]),
        ("bert", ["BertLMHeadModel (model_type 'bert') is an encoder", "used as a decoder"]),
        (
            "inkling2_loop_text",
            [
                "Inkling2LoopTextModel runs model.message_input, which has trained weights, between the calls of its loop"
            ],
        ),
    ],
)
def test_what_stays_refused_is_named(tmp_path, mt, needles):
    """Refused at convert, before a byte is written, naming the feature (never "not described")."""
    from tests.support.census_config import build, tiny_config

    build(mt, tiny_config(mt, 6 if mt == "inkling2_loop_text" else 2)).save_pretrained(tmp_path / "src")
    line = assert_bad(horizon("convert", tmp_path / "src", tmp_path / "dst"), *needles, dst=tmp_path / "dst")
    assert "not described" not in line
