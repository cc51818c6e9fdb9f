"""Preference training with the engine's other strategies, against TRL: LoRA DPO (the reference is
the base with the adapters off) against TRL's DPOTrainer on a peft model, which disables the
adapters for its reference; DPO of a mixture-of-experts model with the router's load-balancing loss
added as in SFT, against DPOTrainer's loss with its aux_loss; pairs whole in every micro-batch."""

from __future__ import annotations

import copy

import pytest
import torch

from horizon_cli.config.schema import DataConfig, EngineConfig, LoraConfig, OptimConfig, PreferenceConfig
from horizon_cli.data.pairs import as_pairs, build_pairs, collate_pairs
from horizon_cli.engine import Engine
from horizon_cli.lora.setup import lora_setup
from horizon_cli.recipes.preference.loss import PairObjective
from tests.support.oracle import check_grads, make_store, one_thread, rel_err  # noqa: F401

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

RECORDS = {
    "prompt": ["hello there", "one two", "The quick", "Paris is", "Write a", "How are"],
    "chosen": [" blue sky", " three", " brown fox jumps", " in France", " short poem", " you today?"],
    "rejected": [" green", " four five six", " red", " big city of", " word", " we"],
}
LR = 1e-3


def dpo_trainer(tmp, model, ds, tok, beta=0.2, precompute=False, ref_model=None):
    args = trl.DPOConfig(
        output_dir=str(tmp / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=64, beta=beta,
        precompute_ref_log_probs=precompute,
    )  # fmt: skip
    return trl.DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=ds, processing_class=tok)


def pairs_of(ds, tok):
    return as_pairs(build_pairs(ds, tok, DataConfig(max_seq_len=64), "pairs", lambda s: None, None))


def test_lora_dpo_equals_trl_on_a_peft_model(tmp_path, tok):
    """Adapters from lora.init (random A and B): the engine's adapters-off pass is the base, its
    adapters-on pass the peft model; the reference is the initial policy, as TRL's "ref" copy of a
    given adapter; three DPO steps then equal TRL + peft + torch AdamW."""
    model, store = make_store(tmp_path, "llama", vocab_size=400)
    torch.manual_seed(1)
    targets = ["q_proj", "v_proj", "down_proj"]
    pm = peft.get_peft_model(
        copy.deepcopy(model),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False),
    )
    pm.save_pretrained(tmp_path / "init")
    setup = lora_setup(LoraConfig(r=4, alpha=8, targets=targets, init=str(tmp_path / "init")), store.arch)
    eng = Engine(
        store, EngineConfig(device="cpu", dtype="float32", loss_chunk=8), OptimConfig(kernel="torch", lr=LR),
        lora=setup, objective=PairObjective(PreferenceConfig(loss="dpo", beta=0.2)),
    )  # fmt: skip
    ds = datasets.Dataset.from_dict(RECORDS)
    pairs = pairs_of(ds, tok)
    steps = [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 0, 1]]
    try:
        every = collate_pairs(pairs.rows(range(len(pairs))), 2, 0)
        for adapters, hf in ((False, model), (True, pm)):
            ours = torch.cat(eng.sequence_logps(every, adapters=adapters))
            assert rel_err(ours, row_logps(hf, every)) < 1e-5, adapters
        ref = torch.cat(eng.sequence_logps(every, adapters=True)).reshape(-1, 2).numpy()
        res = []
        for idx in steps:
            mbs = collate_pairs(pairs.rows(idx), 2, 0, ref[idx])
            res.append(eng.step(mbs, LR, eng.objective.divisor(mbs)))
        eng.wait()
        tr = dpo_trainer(tmp_path, pm, ds, tok)  # no ref_model: TRL copies the given adapter as "ref"
        pm.train()
        params = [p for n, p in pm.named_parameters() if p.requires_grad and ".default." in n]
        opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        for r, idx in zip(res, steps, strict=True):
            opt.zero_grad()
            loss = tr.compute_loss(pm, tr.data_collator([tr.train_dataset[i] for i in idx]))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            assert r.loss == pytest.approx(loss.item(), rel=1e-5)
        ours, theirs = eng.host.tensors(), peft.get_peft_model_state_dict(pm, adapter_name="default")
        assert set(ours) == set(theirs)
        for k in theirs:
            assert rel_err(ours[k], theirs[k]) < 1e-5, k
    finally:
        eng.close()


def row_logps(model, mbs) -> torch.Tensor:
    """Each row's summed log-prob of its labelled tokens: a resident no-grad forward."""
    out = []
    with torch.no_grad():
        for mb in mbs:
            logits = model(input_ids=mb.input_ids).logits.float()
            lp = torch.log_softmax(logits[:, :-1], -1)
            lab = mb.labels[:, 1:]
            tok = lp.gather(-1, lab.clamp(min=0)[..., None]).squeeze(-1)
            out.append((tok * (lab != -100)).sum(1))
    return torch.cat(out)


def test_moe_dpo_adds_the_router_aux_loss_as_trl(tmp_path, tok):
    model, store = make_store(tmp_path, "qwen3_moe", vocab_size=400, output_router_logits=True)
    eng = Engine(
        store, EngineConfig(device="cpu", dtype="float32", loss_chunk=8), OptimConfig(kernel="torch"),
        objective=PairObjective(PreferenceConfig(loss="dpo", beta=0.2)),
    )  # fmt: skip
    ds = datasets.Dataset.from_dict(RECORDS)
    pairs = pairs_of(ds, tok)
    ref = torch.randn(4, 2, generator=torch.Generator().manual_seed(0)).numpy() - 30
    try:
        mbs = collate_pairs(pairs.rows(range(4)), 2, 0, ref)
        res = eng.step(mbs, 0.0, eng.objective.divisor(mbs))  # lr 0: the gradients stay on the host
        m = copy.deepcopy(model).train()
        tr = dpo_trainer(tmp_path, m, ds, tok, precompute=True, ref_model=copy.deepcopy(model))
        rows = [
            {
                **tr.train_dataset[i],
                "ref_chosen_logps": float(ref[i, 0]),
                "ref_rejected_logps": float(ref[i, 1]),
            }
            for i in range(4)
        ]
        loss = tr.compute_loss(m, tr.data_collator(rows))  # + router_aux_loss_coef * aux_loss
        loss.backward()
        assert res.aux_loss == pytest.approx(tr._metrics["train"]["aux_loss"][-1], rel=1e-5)
        coef = model.config.router_aux_loss_coef
        assert res.loss + coef * res.aux_loss == pytest.approx(loss.item(), rel=1e-5)
        check_grads(eng, m, 1e-5)
    finally:
        eng.close()


def test_pairs_stay_whole_in_every_micro_batch(tok):
    ds = datasets.Dataset.from_dict(RECORDS)
    pairs = pairs_of(ds, tok)
    order = [5, 2, 0, 3]
    mbs = collate_pairs(pairs.rows(order), 2, 0)
    assert [mb.input_ids.shape[0] for mb in mbs] == [4, 4]
    k = 0
    for mb in mbs:
        for j in range(0, 4, 2):
            want_c, want_r = pairs.rows([order[k]])
            for row, want in ((j, want_c), (j + 1, want_r)):
                n = len(want.input_ids)
                assert mb.input_ids[row, :n].tolist() == want.input_ids.tolist()
            k += 1
    assert PairObjective(PreferenceConfig()).divisor(mbs) == 4
