"""GRPO in the other modes, each against TRL 1.16's own GRPO loss on a resident transformers model:
LoRA (peft, the reference with the adapters off as TRL takes it: `disable_adapter()`), QLoRA
(peft on the store's dequantized NF4 base, as tests/test_lora_engine), a MoE model with its router
auxiliary loss on (TRL adds coef x transformers' load_balancing_loss_func over the whole batch, as
horizon's SFT does) and a generic (transformers-derived) architecture.

A few `horizon train` steps sample and train; the oracle replays the same completions (read back
from rollouts/step-N.jsonl: what horizon sampled) through `GRPOTrainer._compute_loss` on a stub
trainer (tests/test_grpo_loss) + torch.optim.AdamW with the run's settings, and each step's loss,
gradient norm and kl, and the final adapters (LoRA) or weights, are compared."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from horizon_cli.config.schema import RLConfig
from horizon_cli.recipes.grpo.advantages import advantages
from tests.rl.test_grpo_train import _rollouts, _run
from tests.support.oracle import one_thread, rel_err  # noqa: F401

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head, use_adapter  # noqa: E402

from tests.rl.test_grpo_loss import trl_stub  # noqa: E402

G, N = 4, 8  # completions per prompt, per step (train.batch_size 2 in test_grpo_train._run)
LORA = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}
AUX = 0.5  # MoE router_aux_loss_coef, large enough that the aux gradient shows in the norm


def build(root: Path, family: str, quantize: str = "", **over) -> Path:
    """A tiny `family` model with the tiny tokenizer (EOS 2) converted to fp32 (NF4 layers when asked)."""
    from horizon_cli.convert import convert
    from tests.support.tiny import make_model, save
    from tests.support.tokenizer import make_tokenizer

    ids = {"eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
    save(
        make_model(family, **{"vocab_size": 400, "max_position_embeddings": 128, **ids, **over}), root / "hf"
    )
    make_tokenizer(root / "hf")
    convert(root / "hf", root / "store", dtype="float32", quantize=quantize)
    return root / "store"


def batch_of(rs: list[dict], cfg: RLConfig) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """TRL's inputs for one step's rollouts (prompts all P long: no left padding), the ids, the mask."""
    C = max(len(r["completion_ids"]) for r in rs)
    cid = torch.zeros(N, C, dtype=torch.long)
    cmask = torch.zeros(N, C, dtype=torch.long)
    for i, r in enumerate(rs):
        cid[i, : len(r["completion_ids"])] = torch.tensor(r["completion_ids"])
        cmask[i, : len(r["completion_ids"])] = 1
    pid = torch.tensor([r["prompt_ids"] for r in rs])
    per = torch.tensor([[r["rewards"]["low_ids"], r["rewards"]["length"]] for r in rs])
    adv, _, _ = advantages(per, torch.tensor([1.0, 0.5]), G, cfg.scale_rewards)
    assert rel_err(adv, torch.tensor([r["advantage"] for r in rs])) < 1e-6
    inputs = {"prompt_ids": pid, "prompt_mask": torch.ones_like(pid), "completion_ids": cid,
              "completion_mask": cmask, "advantages": adv, "num_items_in_batch": cmask.sum()}  # fmt: skip
    return inputs, torch.cat([pid, cid], 1), torch.cat([torch.ones_like(pid), cmask], 1)


def replay(run: Path, rows: list[dict], cfg: RLConfig, policy, ref, aux: float = 0.0) -> None:
    """TRL's loss + AdamW (the run's lr 3e-3, betas, eps, weight decay 0.01, clip 1.0) over the
    run's rollouts, step by step against its metrics. `ref(ids, mask, C)`: the reference's log-probs."""
    stub = trl_stub(cfg, policy)
    stub.aux_loss_enabled, stub.router_aux_loss_coef = aux > 0, aux
    stub.accelerator.gather_for_metrics = lambda x: x  # one process
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    old = None
    for k, row in enumerate(rows):
        g = k - k % cfg.num_iterations
        inputs, ids, am = batch_of(_rollouts(run, g + 1), cfg)
        C = inputs["completion_ids"].shape[1]
        with torch.no_grad():
            if cfg.num_iterations > 1 and k == g:  # the rollout policy: the weights that sampled them
                old, _, _ = stub._get_per_token_logps_and_entropies(policy, ids, am, C)
            if cfg.num_iterations > 1:
                inputs["old_per_token_logps"] = old
            if cfg.beta > 0:
                inputs["ref_per_token_logps"] = ref(stub, ids, am, C)
        opt.zero_grad()
        stub._metrics["train"].clear()
        loss = GRPOTrainer._compute_loss(stub, policy, inputs)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        m = {n: v[-1] for n, v in stub._metrics["train"].items()}
        ours = row["loss"]
        if aux:  # horizon's `loss` is the policy loss; the aux loss is its own metric, as in SFT
            assert row["aux_loss"] == pytest.approx(m["aux_loss"], rel=1e-5), k
            ours += aux * row["aux_loss"]
        assert ours == pytest.approx(loss.item(), rel=1e-5, abs=1e-7), k
        assert row["grad_norm"] == pytest.approx(norm.item(), rel=1e-5), k
        if cfg.beta > 0:
            assert row["kl"] == pytest.approx(m["kl"], rel=1e-3, abs=1e-7), k
            # past step 1 the policy has moved off the reference: a reference that followed it
            # (LoRA's adapters left on) gives kl 0 exactly
            assert k == 0 or row["kl"] > 0, k
        if cfg.num_iterations > 1:
            assert row["clip_ratio/region_mean"] == pytest.approx(m["clip_ratio/region_mean"], abs=1e-6), k


def metrics_of(run: Path) -> list[dict]:
    from horizon_cli.train.metrics import read_metrics

    return read_metrics(run / "metrics.jsonl")


# -- LoRA and QLoRA: peft ------------------------------------------------------------------------
def peft_policy(store: Path, cfg: RLConfig, seed: int):
    """peft on the HF model (the store's dequantized base when NF4) with horizon's fresh adapters
    (lora.state.initial_adapters: PEFT's init from train.seed), TRL's fused head added first."""
    import transformers

    from horizon_cli.config.schema import LoraConfig
    from horizon_cli.lora.setup import lora_for
    from horizon_cli.lora.state import initial_adapters
    from horizon_cli.store import Store

    model = transformers.AutoModelForCausalLM.from_pretrained(store.parent / "hf", dtype=torch.float32)
    st = Store.open(store)
    if st.quant:
        from tests.lora.test_lora_engine import load_dequantized

        load_dequantized(model, st)
    add_fused_lm_head(model, temperature=cfg.temperature, outputs=("log_probs", "entropy"))
    pc = peft.LoraConfig(
        r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=LORA["targets"], lora_dropout=0.0
    )
    pm = peft.get_peft_model(model, pc)
    init = initial_adapters(lora_for(LoraConfig(**LORA), st, seed))
    theirs = peft.get_peft_model_state_dict(pm)
    assert set(init) == set(theirs)
    peft.set_peft_model_state_dict(pm, init)
    return pm.train()


def base_ref(stub, ids, am, C):
    """TRL's reference under peft (a new adapter): the same model with the adapters off."""
    with use_adapter(stub.model, adapter_name=None):  # as GRPOTrainer takes it for a new adapter
        lp, _, _ = stub._get_per_token_logps_and_entropies(stub.model, ids, am, C)
    return lp


LORA_CASES = {
    "lora-beta": ("", dict(beta=0.04)),
    "lora-mu2-clipped": ("", dict(loss_type="grpo", num_iterations=2, temperature=0.8, epsilon=0.05)),
    "qlora-beta": ("nf4", dict(beta=0.04, loss_type="bnpo")),
}


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_lora_and_qlora_steps_equal_trl_on_peft(tmp_path, tiny_store, case):
    from safetensors.torch import load_file

    quant, rlkw = LORA_CASES[case]
    store = build(tmp_path / "m", "llama", quant, tie=True) if quant else tiny_store
    run = _run(tmp_path, store, "run", rlkw, ["train.steps=4"], lora=LORA,
               output={"save_every": 0, "export": True})  # fmt: skip
    rows = metrics_of(run)
    assert len(rows) == 4
    cfg = RLConfig(max_completion_length=8, num_generations=G, **rlkw)
    pm = peft_policy(store, cfg, seed=2)
    replay(run, rows, cfg, pm, base_ref)
    ours = load_file(run / "adapter" / "adapter_model.safetensors")
    theirs = peft.get_peft_model_state_dict(pm)
    assert set(ours) == set(theirs)
    for k, w in theirs.items():
        assert rel_err(ours[k], w) < 1e-5, k


# -- MoE (router aux loss) and a generic architecture: full fine-tuning -----------------------------
FULL_CASES = {
    "moe-aux": ("qwen3_moe", dict(output_router_logits=True, router_aux_loss_coef=AUX), dict(beta=0.04)),
    "generic-olmo2": ("olmo2", {}, dict(beta=0.04, loss_type="dr_grpo")),
}


@pytest.mark.parametrize("case", list(FULL_CASES))
def test_moe_and_generic_steps_equal_trl(tmp_path, case):
    import transformers

    family, over, rlkw = FULL_CASES[case]
    store = build(tmp_path / "m", family, **over)
    run = _run(tmp_path, store, "run", rlkw, ["train.steps=3"], output={"save_every": 0, "export": True})
    rows = metrics_of(run)
    assert len(rows) == 3
    if over.get("output_router_logits"):
        assert all(r["aux_loss"] is not None for r in rows)
    cfg = RLConfig(max_completion_length=8, num_generations=G, **rlkw)
    policy = transformers.AutoModelForCausalLM.from_pretrained(
        store.parent / "hf", dtype=torch.float32
    ).train()
    frozen = copy.deepcopy(policy).eval()
    add_fused_lm_head(policy, temperature=cfg.temperature, outputs=("log_probs", "entropy"))
    add_fused_lm_head(frozen, temperature=cfg.temperature)

    def ref(stub, ids, am, C):
        lp, _, _ = stub._get_per_token_logps_and_entropies(frozen, ids, am, C)
        return lp

    replay(run, rows, cfg, policy, ref, aux=over.get("router_aux_loss_coef", 0.0))
    out = transformers.AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32).state_dict()
    # as test_grpo_train: AdamW turns the fp32 rounding of a near-zero gradient into an lr-sized
    # update of either sign, so the weights agree less closely than the gradients (grad_norm above)
    for name, w in policy.state_dict().items():
        assert rel_err(out[name], w) < 1e-3, name
