"""Preference losses on the streamed engine against TRL's own code (recipes/preference/loss.py).

DPO, IPO and DPO + sft_weight against DPOTrainer.compute_loss on batches its own collator made
from its own tokenization of the same records (and DPOTrainer loss_type sigmoid given a
label_smoothing, which TRL 1.16 ignores: horizon's dpo, unsmoothed); conservative DPO (cdpo), SimPO (with and
without cpo_alpha) and ORPO against CPOTrainer's / ORPOTrainer's get_batch_loss_metrics (their
forward, log-prob, NLL and loss code) on the same pairs. One step: the loss, every gradient and the
logged rewards/logps; five optimizer steps against a resident transformers + torch.optim.AdamW loop
on TRL's loss (fp32, 1e-5), with horizon's streamed reference pass checked against TRL's
`compute_ref_log_probs` on the initial model.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from horizon_cli.config.schema import DataConfig, EngineConfig, OptimConfig, PreferenceConfig
from horizon_cli.data.pairs import as_pairs, build_pairs, collate_pairs
from horizon_cli.engine import Engine
from horizon_cli.recipes.preference.loss import PairObjective
from tests.support.oracle import check_grads, make_store, one_thread, rel_err  # noqa: F401

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

PROMPTS = ["hello there", "one two", "The quick", "Paris is", "Write a", "How are", "three four", "the sky"]
CHOSEN = [
    " blue sky",
    " three",
    " brown fox jumps",
    " in France",
    " short poem",
    " you today?",
    " five",
    " is blue",
]
REJECTED = [" green", " four five six", " red", " big city of", " word", " we", " seven eight", " falls down"]
IDX = [2, 3, 4, 5]
# eps 1e-6: a DPO gradient element is often a near-cancelling difference of the chosen and rejected
# rows' (their prompt positions are shared), so its float round-off (1e-7 relative to the tensor) is
# large relative to the element; with eps 1e-8 Adam normalises such elements to +-lr either way
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01, grad_clip=1.0)

# name: (horizon's preference section, how TRL computes the same loss)
CASES = {
    "dpo": (dict(loss="dpo", beta=0.2), ("dpo", "sigmoid", None)),
    "dpo_sft": (dict(loss="dpo", beta=0.2, sft_weight=0.3), ("dpo", ["sigmoid", "sft"], [1.0, 0.3])),
    "ipo": (dict(loss="ipo", beta=0.4), ("dpo", "ipo", None)),
    "cdpo": (dict(loss="cdpo", beta=0.2, label_smoothing=0.1), ("cdpo", "sigmoid", None)),
    # TRL 1.16's DPOTrainer loss_type sigmoid given label_smoothing: the same objective as horizon's dpo
    "dpo_as_trl_smoothed": (dict(loss="dpo", beta=0.2), ("dpo", "sigmoid", None)),
    "simpo": (dict(loss="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=0.05), ("cpo", "simpo", 0.0)),
    "simpo_sft": (dict(loss="simpo", beta=2.0, simpo_gamma=0.5, sft_weight=0.4), ("cpo", "simpo", 0.4)),
    "orpo": (dict(loss="orpo", beta=0.3), ("orpo", None, None)),
}
TRL_SMOOTHING = {"dpo_as_trl_smoothed": 0.2}  # what TRL's DPOConfig is given beyond horizon's section


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tok):
    tmp = tmp_path_factory.mktemp("pref")
    model, store = make_store(tmp, "llama", vocab_size=400)
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED})
    pairs = as_pairs(build_pairs(ds, tok, DataConfig(max_seq_len=64), "pairs", lambda s: None, None))
    return types.SimpleNamespace(tmp=tmp, model=model, store=store, ds=ds, pairs=pairs, tok=tok)


def engine(s, pref: dict) -> Engine:
    ecfg = EngineConfig(device="cpu", dtype="float32", loss_chunk=7)  # several chunks per micro-batch
    ocfg = OptimConfig(
        kernel="torch", lr=HP["lr"], betas=list(HP["betas"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
    )
    return Engine(s.store, ecfg, ocfg, objective=PairObjective(PreferenceConfig(**pref)))


class TrlLoss:
    """TRL's loss for one case on a model: loss(model, pair indices, ref) -> (loss, metrics)."""

    def __init__(self, s, model, case: str):
        self.s, self.pref, (self.kind, self.loss_type, self.extra) = s, CASES[case][0], CASES[case][1]
        beta = self.pref["beta"]
        if self.kind == "dpo":
            args = trl.DPOConfig(
                output_dir=str(s.tmp / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=64, beta=beta,
                loss_type=self.loss_type, loss_weights=self.extra, precompute_ref_log_probs=True,
                label_smoothing=TRL_SMOOTHING.get(case, 0.0),
            )  # fmt: skip
            self.tr = trl.DPOTrainer(
                model=model,
                ref_model=copy.deepcopy(model),
                args=args,
                train_dataset=s.ds,
                processing_class=s.tok,
            )
        else:
            from accelerate import Accelerator

            if self.kind == "orpo":
                from trl.experimental.orpo import ORPOTrainer as cls
            else:
                from trl.experimental.cpo import CPOTrainer as cls
            self.tr = cls.__new__(cls)  # TRL's loss code, without its dataset preparation
            attrs = dict(
                accelerator=Accelerator(cpu=True), is_encoder_decoder=False, aux_loss_enabled=False, beta=beta,
                padding_value=0, pad_token_id=0, loss_type=self.loss_type or "sigmoid", alpha=0.0,
                label_smoothing=self.pref.get("label_smoothing", 0.0), simpo_gamma=self.pref.get("simpo_gamma", 0.5),
                cpo_alpha=self.extra or 0.0,
            )  # fmt: skip
            self.tr.__dict__.update(attrs)

    def __call__(self, model, idx, ref):
        if self.kind == "dpo":
            rows = [{**self.tr.train_dataset[int(i)], "ref_chosen_logps": float(ref[k, 0]),
                     "ref_rejected_logps": float(ref[k, 1])} for k, i in enumerate(idx)]  # fmt: skip
            self.tr._metrics["train"].clear()
            loss = self.tr.compute_loss(model, self.tr.data_collator(rows))
            return loss, {k: v[-1] for k, v in self.tr._metrics["train"].items()}
        batch = pair_batch(self.s.pairs.rows(idx))
        if self.kind == "cdpo":  # TRL's conservative DPO: CPOTrainer's sigmoid loss on the log-ratios
            out = self.tr.concatenated_forward(model, batch)
            ref = torch.as_tensor(ref, dtype=torch.float32)
            losses, rc, rr = self.tr.cpo_loss(out[0] - ref[:, 0], out[1] - ref[:, 1])
            return losses.mean(), {
                "rewards/chosen": rc.mean().item(),
                "rewards/accuracies": (rc > rr).float().mean().item(),
            }
        loss, metrics = self.tr.get_batch_loss_metrics(model, batch)
        return loss, {k: float(v) for k, v in metrics.items()}


def pair_batch(rows) -> dict:
    """CPO/ORPO's batch: chosen_* and rejected_* tensors (labels -100 on the prompt), right-padded."""
    out = {}
    for side, part in (("chosen", rows[0::2]), ("rejected", rows[1::2])):
        T = max(len(r.input_ids) for r in part)
        ids = torch.zeros(len(part), T, dtype=torch.long)
        lab = torch.full((len(part), T), -100, dtype=torch.long)
        mask = torch.zeros(len(part), T, dtype=torch.long)
        for i, r in enumerate(part):
            n = len(r.input_ids)
            ids[i, :n], lab[i, :n], mask[i, :n] = torch.as_tensor(r.input_ids), torch.as_tensor(r.labels), 1
        out |= {f"{side}_input_ids": ids, f"{side}_labels": lab, f"{side}_attention_mask": mask}
    return out


def reference(s, model, idx):
    """(pairs, 2) reference log-probs: TRL's compute_ref_log_probs with the initial model."""
    model = copy.deepcopy(model)  # TRL patches the forward of the model it trains (fused LM head)
    args = trl.DPOConfig(output_dir=str(s.tmp / "ref"), report_to=[], use_cpu=True, bf16=False, max_length=64)
    tr = trl.DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=s.ds, processing_class=s.tok
    )
    batch = tr.data_collator([tr.train_dataset[int(i)] for i in idx])
    c, r = tr.compute_ref_log_probs(copy.deepcopy(model).eval(), batch)
    return torch.stack([c, r], 1).detach().numpy()


TRL_NAMES = {"rewards_chosen": "rewards/chosen", "rewards_accuracy": "rewards/accuracies",
             "rewards_margin": "rewards/margins", "logps_chosen": "logps/chosen", "logps_rejected": "logps/rejected"}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_loss_gradients_and_metrics_equal_trl(setup, case):
    s, idx = setup, IDX
    ref = torch.randn(len(s.pairs), 2, generator=torch.Generator().manual_seed(3)).numpy() - 30.0
    eng = engine(s, CASES[case][0])
    try:
        mbs = collate_pairs(s.pairs.rows(idx), 2, 0, ref[idx])  # 2 micro-batches of 2 pairs
        loss_sum, n, _ = eng.forward_backward(mbs, eng.objective.divisor(mbs))
        _, _, stats = eng.evaluate(mbs)
        model = copy.deepcopy(s.model).train()
        loss, metrics = TrlLoss(s, model, case)(model, idx, ref[idx])
        loss.backward()
        assert n == 4 and abs(loss_sum / n - loss.item()) <= 1e-5 * abs(loss.item())
        check_grads(eng, model, 1e-5)
        for ours, theirs in TRL_NAMES.items():
            if theirs in metrics:
                assert stats[ours] / n == pytest.approx(metrics[theirs], rel=1e-5, abs=1e-6), ours
    finally:
        eng.close()


@pytest.mark.parametrize("case", ["dpo", "ipo", "simpo", "orpo"])
def test_five_steps_equal_a_resident_adamw_loop_on_trls_loss(setup, case):
    s = setup
    steps = [[(2 * k + j) % len(s.pairs) for j in range(4)] for k in range(5)]
    eng = engine(s, CASES[case][0])
    try:
        # horizon's reference: the streamed forward-only pass (each layer loaded once for all pairs)
        every = collate_pairs(s.pairs.rows(range(len(s.pairs))), 2, 0)
        ours = torch.cat(eng.sequence_logps(every, adapters=False)).reshape(-1, 2).numpy()
        theirs = reference(s, s.model, range(len(s.pairs)))
        assert rel_err(torch.as_tensor(ours), torch.as_tensor(theirs)) < 1e-5
        res = []
        for idx in steps:
            mbs = collate_pairs(s.pairs.rows(idx), 2, 0, ours[idx])
            res.append(eng.step(mbs, HP["lr"], eng.objective.divisor(mbs)))
        eng.wait()
        model = copy.deepcopy(s.model).train()
        loss_fn = TrlLoss(s, model, case)
        opt = torch.optim.AdamW(
            model.parameters(), lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"]
        )
        for r, idx in zip(res, steps, strict=True):
            opt.zero_grad()
            loss, _ = loss_fn(model, idx, ours[idx])  # the same reference (checked equal above)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), HP["grad_clip"])
            opt.step()
            assert r.loss == pytest.approx(loss.item(), rel=1e-5)
        from tests.support.oracle import engine_weights

        hf = dict(model.named_parameters())
        for name, w in engine_weights(eng).items():
            assert rel_err(w, hf[name].detach()) < 1e-5, name
        assert all(r.weight_loads == 2 * s.store.arch.n_layers for r in res)
    finally:
        eng.close()
