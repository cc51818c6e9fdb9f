"""The generic path as a tool: `horizon train` on a MoE store end to end (metrics carry the aux loss
and expert load), `horizon inspect` says the path and the parameter split, and `horizon convert`
refuses what the path cannot do with one line naming the missing piece (exit 2, nothing written)."""

import json
import shutil
from pathlib import Path

import pytest
from conftest import chat_rows, write_config, write_jsonl
from oracle import one_thread  # noqa: F401 (autouse fixture: tiny models on one thread)
from safetensors.torch import load_file, save_file
from test_cli_store_errors import assert_bad, horizon
from tiny_models import make_model, save
from tiny_tokenizer import make_tokenizer

from horizon_cli.convert import convert


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
        (dict(attention_dropout=0.1), ["attention_dropout = 0.1", "dropout"]),
        (
            dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]),
            ["multimodal", "gemma3_text"],
        ),
        (
            dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]),
            ["GPTNeoXForCausalLM", "not described"],
        ),
    ],
    ids=["quantized", "dropout", "multimodal", "undescribed"],
)
def test_refused_at_convert(src, tmp_path, change, needles):
    edit_config(src, **change)
    assert_bad(horizon("convert", src, tmp_path / "dst"), "config.json", *needles, dst=tmp_path / "dst")


@pytest.mark.parametrize(
    "config_cls,arch,mt,text",
    [
        ("LlavaConfig", "LlavaForConditionalGeneration", "llava", "llama"),
        ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "qwen2_vl", "qwen2_vl_text"),
    ],
)
def test_a_vision_language_checkpoint_is_named_as_one(src, tmp_path, config_cls, arch, mt, text):
    """Not 'not a causal LM': what it is, and that image inputs and the wrapper are not supported yet."""
    import transformers

    cfg = getattr(transformers, config_cls)().to_dict()
    (src / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
    want = [f"{arch} (model_type {mt!r}) is a multimodal (vision-language) checkpoint"]
    want += [f"(its language model: {text!r})", "image inputs", "not supported yet"]
    line = assert_bad(horizon("convert", src, tmp_path / "dst"), *want, dst=tmp_path / "dst")
    assert "not a causal LM" not in line


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
