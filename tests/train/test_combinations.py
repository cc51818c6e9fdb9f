"""Combinations of features that landed separately (lean, LoRA/QLoRA, the generic path with MoE, the
ladder, run-dir trust), tried together as a user would: each test here is the smallest reproduction
of a problem found that way (docs/reliability.md, "Combinations tried")."""

from __future__ import annotations

import pytest

from tests.conftest import chat_rows, horizon, write_config, write_jsonl


def error_line(r) -> str:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.output
    return errors[0]


def snapshot(root):
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def cfg(tiny_store, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    return write_config(
        tmp_path / "cfg.yaml",
        tiny_store,
        data,
        tmp_path / "run",
        train={"steps": 1, "batch_size": 2, "micro_batch_size": 2},
        output={"save_every": 1, "export": False},
    )


@pytest.mark.parametrize("host,device", [("nan", "4"), ("4", "inf"), ("inf", "inf")])
def test_dry_run_for_a_machine_of_nan_or_inf_gib_is_one_line(cfg, host, device):
    """Was a traceback (ValueError / OverflowError from int(nan * 2**30)), exit 1."""
    r = horizon("train", cfg, "--dry-run", "--host-gib", host, "--device-gib", device)
    assert "--host-gib/--device-gib" in error_line(r)


def test_lora_rank_change_is_refused_even_when_accepted(cfg, tmp_path):
    """lora.r shapes the checkpoint's adapters: the refusal used to suggest
    train.accept_changes=[lora.r], which then failed on the adapter file's shapes."""
    assert horizon("train", cfg, "lora.r=4").exit_code == 0
    run = tmp_path / "run"
    before = snapshot(run)
    for accept in ([], ["train.accept_changes=[lora]"]):
        msg = error_line(horizon("train", cfg, "lora.r=8", "train.steps=2", *accept))
        assert "lora.r 4 -> 8" in msg and "cannot be resumed" in msg and "accept_changes=[" not in msg
    # another setting next to it: still the rank that is named, and nothing suggested for it
    msg = error_line(horizon("train", cfg, "lora.r=8", "optim.lr=1e-3", "train.steps=2"))
    assert "lora.r 4 -> 8" in msg and "accept_changes=[" not in msg
    assert snapshot(run) == before
    # what may change is still accepted
    r = horizon(
        "train", cfg, "lora.r=4", "lora.alpha=8", "train.steps=2", "train.accept_changes=[lora.alpha]"
    )
    assert r.exit_code == 0, r.output


def test_memory_mode_change_is_refused_at_the_resume_check(cfg, tmp_path):
    """exact -> lean: refused before the engine is built, without offering accept_changes."""
    over = ["engine.dtype=bfloat16"]
    assert horizon("train", cfg, *over).exit_code == 0
    run = tmp_path / "run"
    before = snapshot(run)
    for accept in ([], ["train.accept_changes=[optim.memory]"]):
        r = horizon("train", cfg, *over, "optim.memory=lean", "train.steps=2", *accept)
        msg = error_line(r)
        assert (
            "optim.memory exact -> lean" in msg
            and "cannot be resumed" in msg
            and "accept_changes=[" not in msg
        )
        assert "engine:" not in r.output  # refused before loading anything
    assert snapshot(run) == before


def test_peft_note_names_the_layers_peft_leaves_out():
    """peft (with transformers 5) reads gate_proj/up_proj/down_proj of a DeepSeek-V3 / Qwen3-MoE
    adapter as the fused experts and drops same-named dense layers (DeepSeek-V3's dense first
    layers and shared experts): PeftModel.from_pretrained then silently differs from the merged
    export. horizon's peft_dropped must be exactly what peft leaves out (checked against peft)."""
    peft = pytest.importorskip("peft")
    import torch

    from horizon_cli.arch import spec_from_hf
    from horizon_cli.lora.targets import peft_dropped, peft_note, resolve_targets
    from tests.support.tiny import make_model

    default = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    mla = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    cases = [
        ("deepseek_v3", default, 9),
        ("deepseek_v3", mla, 0),
        ("qwen3_moe", default, 0),
        ("llama", default, 0),
    ]
    for family, targets, n_lost in cases:
        model = make_model(family)
        spec = spec_from_hf(model.config.to_dict())
        chosen = resolve_targets(targets, spec)
        ours = {t.module for layer in chosen for t in layer}
        lost = {t.module for t in peft_dropped(spec, chosen)}
        assert len(lost) == n_lost and bool(peft_note(spec, chosen)) == bool(n_lost), family
        pm = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=list(targets)))
        theirs = {  # the linear layers peft adapts (not the fused experts' parameters)
            n.removeprefix("base_model.model.")
            for n, m in pm.named_modules()
            if isinstance(m, peft.tuners.lora.LoraLayer) and isinstance(m.get_base_layer(), torch.nn.Linear)
        }
        assert theirs == ours - lost, (family, sorted(theirs ^ (ours - lost)))


def test_a_lora_run_resumes_after_its_init_adapter_is_gone(cfg, tmp_path):
    """lora.init only seeds a fresh start: a resume starts from its checkpoint's adapters. It used
    to be read (strictly) on every start, so a moved or deleted init dir stopped the resume."""
    import shutil

    assert horizon("train", cfg, "lora.r=4", "lora.alpha=8", "train.steps=2").exit_code == 0
    init = tmp_path / "init"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step_2" / "adapter", init)
    over = ["lora.r=4", "lora.alpha=8", f"lora.init={init}"]
    whole = tmp_path / "whole"
    assert horizon("train", cfg, *over, "train.steps=2", f"output.dir={whole}").exit_code == 0
    part = tmp_path / "part"
    assert horizon("train", cfg, *over, "train.steps=1", f"output.dir={part}").exit_code == 0
    shutil.rmtree(init)
    r = horizon("train", cfg, *over, "train.steps=2", f"output.dir={part}")
    assert r.exit_code == 0, r.output
    adapter = "checkpoints/step_2/adapter/adapter_model.safetensors"
    assert (part / adapter).read_bytes() == (whole / adapter).read_bytes()
    # a fresh start still needs it, and says so before writing anything
    msg = error_line(horizon("train", cfg, *over, "train.steps=2", f"output.dir={tmp_path / 'new'}"))
    assert "lora.init" in msg and not (tmp_path / "new").exists()


def test_moe_with_an_expert_width_not_a_multiple_of_8_runs_in_bf16(tmp_path):
    """transformers' grouped_mm experts need 16-byte strides: an expert width of 36 failed at the
    first step in bf16 with a traceback ("strides should be multiple of 16 bytes"). Such a model
    now runs transformers' batched_mm experts, and gives transformers' logits."""
    import torch

    from horizon_cli.data.batch import IGNORE, MicroBatch
    from tests.support.oracle import make_engine, make_store, rel_err

    model, store = make_store(tmp_path, "mixtral", dtype="bfloat16", intermediate_size=36)
    eng = make_engine(store, dtype="bfloat16")
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    try:
        out = eng.logits(MicroBatch(ids, torch.full_like(ids, IGNORE), torch.arange(12)[None]))[0]
    finally:
        eng.close()
    model = model.to(torch.bfloat16)
    model.config._experts_implementation = "batched_mm"  # transformers' grouped_mm fails here too
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
    assert rel_err(out.float(), want.float()) < 5e-3  # bf16 rounding (measured 7.6e-4)
