"""KTO (unpaired preference) against TRL 1.16's KTOTrainer: its own dataset preparation (tokens and
the rotated KL completions), its precomputed reference log-probs, its `_compute_loss` on its own
collator's batch; horizon's rows (data.unpaired), streamed reference pass and objective
(recipes.kto.loss) through the engine: one step's loss, every gradient and the logged metrics (fp32,
1e-5), with desirable/undesirable weights != 1 and a batch of desirable examples only. Both record
forms (TRL's label, LLaMA-Factory's kto_tag) give the same examples; bad values stop with one line;
`horizon train` equals KTOTrainer's loss + AdamW over three shuffled steps, and resumes bitwise.
"""

from __future__ import annotations

import copy
import json
import types

import numpy as np
import pytest
import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig, PreferenceConfig
from horizon_cli.data.unpaired import build_unpaired, collate_unpaired, examples_of
from horizon_cli.engine import Engine
from horizon_cli.errors import InputError
from horizon_cli.recipes.kto.loss import KTOObjective
from tests.support.oracle import check_grads, make_store, one_thread, rel_err  # noqa: F401

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

PROMPTS = ["hello there", "one two", "The quick", "Paris is", "Write a", "How are", "three four", "the sky"]
COMPLETIONS = [
    " blue sky",
    " three",
    " brown fox jumps",
    " in France",
    " short poem",
    " you?",
    " five",
    " falls",
]
LABELS = [True, False, True, True, False, True, False, False]
GROUP = 4  # TRL's per_device_train_batch_size: the KL completions rotate within blocks of it
PREF = dict(loss="kto", beta=0.2, desirable_weight=1.3, undesirable_weight=0.7)
TRL_NAMES = {"rewards_chosen": ("rewards/chosen", "count_chosen"), "rewards_rejected": ("rewards/rejected", "count_rejected"),
             "logps_chosen": ("logps/chosen", "count_chosen"), "logps_rejected": ("logps/rejected", "count_rejected")}  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tok_plain):
    tmp = tmp_path_factory.mktemp("kto")
    model, store = make_store(tmp, "llama", vocab_size=400)
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS, "completion": COMPLETIONS, "label": LABELS})
    ts = build_unpaired(examples_of(ds, tok_plain, "kto.jsonl"), 64, GROUP)
    args = trl.KTOConfig(
        output_dir=str(tmp / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=64,
        per_device_train_batch_size=GROUP, precompute_ref_log_probs=True, beta=PREF["beta"],
        desirable_weight=PREF["desirable_weight"], undesirable_weight=PREF["undesirable_weight"],
    )  # fmt: skip
    policy = copy.deepcopy(model).train()
    tr = trl.KTOTrainer(
        model=policy, ref_model=copy.deepcopy(model), args=args, train_dataset=ds, processing_class=tok_plain
    )
    return types.SimpleNamespace(
        tmp=tmp, model=model, store=store, ds=ds, ts=ts, tok=tok_plain, tr=tr, policy=policy
    )


def engine(s) -> Engine:
    ecfg = EngineConfig(device="cpu", dtype="float32", loss_chunk=7)  # several chunks per micro-batch
    return Engine(
        s.store, ecfg, OptimConfig(kernel="torch"), objective=KTOObjective(PreferenceConfig(**PREF))
    )


def rows_of(s, idx):
    return s.ts.rows([r for i in idx for r in (2 * i, 2 * i + 1)])


def test_rows_and_kl_completions_equal_trls_dataset(setup):
    s = setup
    assert len(s.ts) == 2 * len(PROMPTS) and s.ts.stats["desirable"] == LABELS
    for k, ex in enumerate(s.tr.train_dataset):
        own, kl = s.ts[2 * k], s.ts[2 * k + 1]
        p, c, m = ex["prompt_ids"], ex["completion_ids"], ex["KL_completion_ids"]
        assert own.input_ids.tolist() == p + c and kl.input_ids.tolist() == p + m
        assert own.labels.tolist() == [-100] * len(p) + c and kl.labels.tolist() == [-100] * len(p) + m
        assert ex["label"] == LABELS[k]
    # the rotation: within each block of GROUP, example j's mismatched completion is j - 1's
    comp = [ex["completion_ids"] for ex in s.tr.train_dataset]
    assert (
        s.tr.train_dataset[0]["KL_completion_ids"] == comp[3]
        and s.tr.train_dataset[5]["KL_completion_ids"] == comp[4]
    )


def test_streamed_reference_equals_trls_precomputed(setup):
    s = setup
    eng = engine(s)
    try:
        mbs = collate_unpaired(rows_of(s, range(8)), LABELS, 2, 0)
        ours = torch.cat(eng.sequence_logps(mbs, adapters=False)).reshape(-1, 2)
        theirs = torch.tensor([[ex["ref_logps"], ex["ref_KL_logps"]] for ex in s.tr.train_dataset])
        assert rel_err(ours, theirs) < 1e-5
    finally:
        eng.close()


@pytest.mark.parametrize("idx", [[0, 1, 2, 3], [0, 2, 3, 5]], ids=["mixed", "desirable_only"])
def test_one_step_loss_gradients_and_metrics_equal_trl(setup, idx):
    s = setup
    data = s.tr.train_dataset
    # a reference away from the policy, so the KL estimate and every log-ratio are non-trivial
    g = torch.Generator().manual_seed(5)
    ref = np.array([[data[i]["ref_logps"], data[i]["ref_KL_logps"]] for i in idx], np.float32)
    ref += torch.randn(len(idx), 2, generator=g).numpy() * 3.0
    eng = engine(s)
    try:
        mbs = collate_unpaired(rows_of(s, idx), [LABELS[i] for i in idx], 2, 0, ref)  # 2 micro-batches
        loss_sum, n, _ = eng.forward_backward(mbs, eng.objective.divisor(mbs))
        _, _, stats = eng.evaluate(mbs)
        model = s.policy  # TRL's KTOTrainer patched its forward (the fused LM head); weights untouched
        model.zero_grad(set_to_none=True)
        batch = s.tr.data_collator(
            [
                {**data[i], "ref_logps": float(ref[k, 0]), "ref_KL_logps": float(ref[k, 1])}
                for k, i in enumerate(idx)
            ]
        )
        s.tr._metrics["train"].clear()
        loss = s.tr.compute_loss(model, batch)
        metrics = {k: v[-1] for k, v in s.tr._metrics["train"].items()}
        loss.backward()
        assert n == len(idx) and abs(loss_sum / n - loss.item()) <= 1e-5 * abs(loss.item())
        check_grads(eng, model, 1e-5)
        assert stats["kl"] / n == pytest.approx(metrics["kl"], rel=1e-5, abs=1e-7)
        for ours, (theirs, count) in TRL_NAMES.items():
            if theirs in metrics:
                assert stats[ours] / stats[count] == pytest.approx(metrics[theirs], rel=1e-5), ours
            else:
                assert stats[count] == 0
        if all(LABELS[i] for i in idx):
            assert "rewards/rejected" not in metrics
    finally:
        eng.close()


def test_kl_estimate_is_clamped_and_gets_no_gradient():
    """On fixed log-probs: the mismatched rows' coefficient is zero, and a negative KL mean is 0."""
    cfg = PreferenceConfig(**PREF)
    obj = KTOObjective(cfg)
    t = types.SimpleNamespace(
        ref=torch.tensor([-5.0, -1.0, -6.0, -2.0]), seq=torch.tensor([0, 1, 2, 3]),
        desirable=torch.tensor([True, False]), valid=torch.tensor([True, True]), examples=2.0,
    )  # fmt: skip
    lp = torch.tensor([-4.0, -3.0, -7.0, -4.0], requires_grad=True)
    total, stats = obj.loss([lp], [t])  # type: ignore[list-item]
    (g,) = torch.autograd.grad(total, lp)
    assert g[1] == 0 and g[3] == 0 and g[0] != 0 and g[2] != 0
    assert stats["kl"] == 0  # mean of (-2, -2) clamped at 0
    b = cfg.beta
    want = 1.3 * (1 - torch.sigmoid(torch.tensor(b * 1.0))) + 0.7 * (1 - torch.sigmoid(torch.tensor(b * 1.0)))
    assert total.item() == pytest.approx(want.item(), rel=1e-6)


def test_trl_label_and_llamafactory_kto_tag_give_the_same_examples(tmp_path, tok_plain, tok):
    trl_ds = datasets.Dataset.from_dict({"prompt": PROMPTS, "completion": COMPLETIONS, "label": LABELS})
    lf = datasets.Dataset.from_dict(
        {
            "conversations": [
                [{"from": "human", "value": p}, {"from": "gpt", "value": c}]
                for p, c in zip(PROMPTS, COMPLETIONS, strict=True)
            ],
            "kto_tag": LABELS,
        }  # fmt: skip
    )
    msgs = datasets.Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p}] for p in PROMPTS],
            "completion": [[{"role": "assistant", "content": c}] for c in COMPLETIONS],
            "label": LABELS,
        }  # fmt: skip
    )
    a, b = examples_of(lf, tok, "lf.jsonl"), examples_of(msgs, tok, "trl.jsonl")
    assert len(a) == len(b) == len(PROMPTS)
    for x, y in zip(a, b, strict=True):
        assert x.prompt.tolist() == y.prompt.tolist() and x.completion.tolist() == y.completion.tolist()
        assert x.desirable == y.desirable
    # LLaMA-Factory alpaca (instruction/output/kto_tag) without a chat template: the Alpaca prompt
    alp = datasets.Dataset.from_dict(
        {"instruction": PROMPTS, "input": [""] * 8, "output": COMPLETIONS, "kto_tag": LABELS}
    )
    ex = examples_of(alp, tok_plain, "alpaca.jsonl")
    assert [e.desirable for e in ex] == LABELS
    for e, p, c in zip(ex, PROMPTS, COMPLETIONS, strict=True):
        assert tok_plain.decode(e.completion.tolist()) == c + tok_plain.eos_token  # TRL's EOS appended
        assert tok_plain.decode(e.prompt.tolist()).endswith(f"### Instruction:\n{p}\n\n### Response:\n")
    plain = examples_of(trl_ds, tok_plain, "trl.jsonl")
    assert [e.desirable for e in plain] == LABELS


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_label_that_is_not_a_boolean_is_refused(tok_plain, bad):
    ds = datasets.Dataset.from_list(
        [{"prompt": "a", "completion": " b", "label": bad}, {"prompt": "c", "completion": " d", "label": bad}]
    )
    with pytest.raises(InputError, match=r"kto.jsonl: record 1: label must be true or false"):
        examples_of(ds, tok_plain, "kto.jsonl")


@pytest.mark.parametrize("key", ["desirable_weight", "undesirable_weight"])
def test_negative_weights_are_one_line_exit_2(tmp_path, tiny_store, key):
    from tests.conftest import horizon
    from tests.train.test_train_cli import one_error_line

    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": c, "label": b}) + "\n"
                            for p, c, b in zip(PROMPTS, COMPLETIONS, LABELS, strict=True)))  # fmt: skip
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"model": {"path": str(tiny_store)}, "data": {"path": str(data)},
                               "output": {"dir": str(tmp_path / "run")},
                               "preference": {"loss": "kto", key: -0.5}}))  # fmt: skip
    msg = one_error_line(horizon("train", cfg, "--dry-run"))
    assert f"preference.{key}: -0.5 is below the minimum 0.0" in msg


def test_horizon_train_kto_equals_trls_kto_loss_with_adamw(tmp_path, tiny_store):
    """`horizon train` with preference.loss kto on TRL's unpaired records (shuffled batches, two
    micro-batches a step) against TRL's KTOTrainer loss + torch.optim.AdamW on the same batches of
    its own dataset: the streamed reference equals TRL's precomputed one; every step's loss, kl and
    rewards equal TRL's (fp32)."""
    import transformers
    from rich.console import Console

    from horizon_cli.data.sampler import batch_indices
    from horizon_cli.train import run_training
    from horizon_cli.train.metrics import read_metrics
    from tests.conftest import write_config, write_jsonl

    recs = [
        {"prompt": p, "completion": c, "label": b}
        for p, c, b in zip(PROMPTS, COMPLETIONS, LABELS, strict=True)
    ]
    data = write_jsonl(tmp_path / "kto.jsonl", recs)
    hp = dict(lr=3e-3, eps=1e-6, weight_decay=0.01)
    cfg = write_config(
        tmp_path / "c.yaml", tiny_store, data, tmp_path / "run", train={"steps": 3, "seed": 1},
        optim={"lr": hp["lr"], "eps": hp["eps"]}, preference=PREF, output={"save_every": 0},
    )  # fmt: skip
    threads = torch.get_num_threads()
    try:
        run_training(cfg, [], console=Console(quiet=True))
    finally:
        torch.set_num_threads(threads)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    hf = tiny_store.parent / "hf"
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    args = trl.KTOConfig(
        output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=64,
        per_device_train_batch_size=4, precompute_ref_log_probs=True, beta=PREF["beta"],
        desirable_weight=PREF["desirable_weight"], undesirable_weight=PREF["undesirable_weight"],
    )  # fmt: skip
    policy = copy.deepcopy(model).train()
    ds = datasets.Dataset.from_list(recs)
    tr = trl.KTOTrainer(
        model=policy, ref_model=copy.deepcopy(model), args=args, train_dataset=ds, processing_class=tok
    )
    ref = np.load(tmp_path / "run" / "reference" / "train.npy")
    theirs = np.array([[ex["ref_logps"], ex["ref_KL_logps"]] for ex in tr.train_dataset], np.float32)
    assert rel_err(torch.as_tensor(ref), torch.as_tensor(theirs)) < 1e-5
    opt = torch.optim.AdamW(
        policy.parameters(), lr=hp["lr"], betas=(0.9, 0.95), eps=hp["eps"], weight_decay=hp["weight_decay"]
    )
    for k, row in enumerate(rows):
        idx = batch_indices(len(recs), k, 4, 1, True)
        opt.zero_grad()
        tr._metrics["train"].clear()
        loss = tr.compute_loss(policy, tr.data_collator([tr.train_dataset[int(i)] for i in idx]))
        metrics = {m: v[-1] for m, v in tr._metrics["train"].items()}
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = row["lr"]
        opt.step()
        assert row["loss"] == pytest.approx(loss.item(), rel=1e-5), k
        assert row["kl"] == pytest.approx(metrics["kl"], rel=1e-4, abs=1e-6), k
        for ours, theirs_name in (
            ("rewards_chosen", "rewards/chosen"),
            ("rewards_rejected", "rewards/rejected"),
        ):
            if theirs_name in metrics:
                assert row[ours] == pytest.approx(metrics[theirs_name], rel=1e-4, abs=1e-6), (k, ours)
            else:
                assert row[ours] is None


def test_unpaired_data_without_kto_and_bad_labels_are_one_line(tmp_path, tiny_store):
    from tests.conftest import horizon, write_config, write_jsonl
    from tests.train.test_train_cli import one_error_line

    recs = [
        {"prompt": p, "completion": c, "label": b}
        for p, c, b in zip(PROMPTS, COMPLETIONS, LABELS, strict=True)
    ]
    data = write_jsonl(tmp_path / "kto.jsonl", recs)
    msg = one_error_line(
        horizon("train", write_config(tmp_path / "a.yaml", tiny_store, data, tmp_path / "a"))
    )
    assert (
        "kto.jsonl holds unpaired preference examples (label or kto_tag); train them with preference: {loss: kto}"
        in msg
    )
    bad = write_jsonl(tmp_path / "bad.jsonl", [{**r, "label": "yes"} for r in recs])
    cfg = write_config(tmp_path / "b.yaml", tiny_store, bad, tmp_path / "b", preference=PREF)
    assert "bad.jsonl: record 1: label must be true or false (desirable or not), got 'yes'" in one_error_line(
        horizon("train", cfg)
    )
    assert not (tmp_path / "b" / "checkpoints").exists()


def test_a_resumed_kto_run_equals_an_uninterrupted_one(tmp_path, tiny_store):
    """The reference (both rows of every example) is kept in the run dir and reused; resuming at a
    checkpoint gives the same losses, metrics, weights and moments, bit for bit."""
    from rich.console import Console

    from horizon_cli.train import run_training
    from horizon_cli.train.metrics import read_metrics
    from tests.conftest import write_config, write_jsonl

    recs = [
        {"prompt": p, "completion": c, "label": b}
        for p, c, b in zip(PROMPTS, COMPLETIONS, LABELS, strict=True)
    ]
    data = write_jsonl(tmp_path / "kto.jsonl", recs)
    cfgs = {
        n: write_config(
            tmp_path / f"{n}.yaml",
            tiny_store,
            data,
            tmp_path / n,
            train={"steps": 2},
            preference=PREF,
            output={"save_every": 1},
        )  # fmt: skip
        for n in ("whole", "cut")
    }
    threads = torch.get_num_threads()
    try:
        run_training(cfgs["whole"], [], console=Console(quiet=True))
        run_training(cfgs["cut"], ["train.steps=1"], console=Console(quiet=True))
        assert (tmp_path / "cut" / "reference" / "train.npy").is_file()
        run_training(cfgs["cut"], [], console=Console(quiet=True))
    finally:
        torch.set_num_threads(threads)
    a, b = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("whole", "cut"))
    assert len(a) == 2 and [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["kl"] for r in a] == [r["kl"] for r in b] and [r["rewards_chosen"] for r in a] == [
        r["rewards_chosen"] for r in b
    ]
    ca, cb = (tmp_path / n / "checkpoints" / "step_2" for n in ("whole", "cut"))
    files = [f.relative_to(ca) for f in ca.rglob("*.bin")]
    assert files
    for f in files:
        assert (ca / f).read_bytes() == (cb / f).read_bytes(), f


@pytest.mark.slow
def test_two_ranks_train_what_one_trains(tmp_path, tiny_store):
    """torchrun with 2 ranks: the KL estimate is the global batch's (summed across the ranks), so
    losses, metrics (eval included, whose second batch pads a rank) and the export equal 1 rank's."""
    from safetensors.torch import load_file

    from horizon_cli.train.metrics import read_metrics
    from tests.conftest import write_config, write_jsonl
    from tests.parallel.test_dist import torchrun
    from tests.preference.test_pref_train import quiet

    recs = [
        {"prompt": p, "completion": c, "label": b}
        for p, c, b in zip(PROMPTS * 2, COMPLETIONS[::-1] + COMPLETIONS, LABELS + LABELS[::-1], strict=True)
    ]
    data = write_jsonl(tmp_path / "kto.jsonl", recs)
    sections = dict(
        train={"steps": 3, "batch_size": 4, "micro_batch_size": 1, "eval_every": 3, "eval_batches": 2},
        data={"eval_fraction": 0.2},
        engine={"compute_threads": 1},
        preference=PREF,
        output={"save_every": 0, "export": True},
    )
    cfgs = {
        n: write_config(tmp_path / f"{n}.yaml", tiny_store, data, tmp_path / n, **sections)
        for n in ("one", "two")
    }
    quiet(cfgs["one"])
    r = torchrun(2, cfgs["two"])
    assert r.returncode == 0, r.stderr
    a, b = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("one", "two"))
    assert a[-1].get("eval_kl") is not None
    for x, y in zip(a, b, strict=True):
        for k in ("loss", "kl", "rewards_chosen", "logps_rejected", "eval_loss", "eval_kl"):
            assert (x.get(k) is None) == (y.get(k) is None), k
            if x.get(k) is not None:
                assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), k
    ea, eb = (load_file(str(next((tmp_path / n / "export").glob("*.safetensors")))) for n in ("one", "two"))
    for k in ea:
        assert torch.allclose(ea[k], eb[k], rtol=1e-5, atol=1e-6), k


def test_lora_kto_equals_trl_on_a_peft_model(tmp_path, tok_plain):
    """LoRA KTO: adapters from lora.init (random A and B), the reference the initial policy (TRL's
    "ref" copy of a given adapter, computed by TRL itself here: no precomputed values), three steps of
    two micro-batches against KTOTrainer's loss on the peft model + torch AdamW: every loss, the KL
    estimate, and the adapters after the steps (fp32, 1e-5)."""
    from horizon_cli.config.schema import LoraConfig
    from horizon_cli.lora.setup import lora_setup

    peft = pytest.importorskip("peft")
    model, store = make_store(tmp_path, "llama", vocab_size=400)
    torch.manual_seed(1)
    targets = ["q_proj", "v_proj", "down_proj"]
    pm = peft.get_peft_model(
        copy.deepcopy(model),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False),
    )
    pm.save_pretrained(tmp_path / "init")
    setup = lora_setup(LoraConfig(r=4, alpha=8, targets=targets, init=str(tmp_path / "init")), store.arch)
    lr = 1e-3
    eng = Engine(
        store, EngineConfig(device="cpu", dtype="float32", loss_chunk=7), OptimConfig(kernel="torch", lr=lr),
        lora=setup, objective=KTOObjective(PreferenceConfig(**PREF)),
    )  # fmt: skip
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS, "completion": COMPLETIONS, "label": LABELS})
    ts = build_unpaired(examples_of(ds, tok_plain, "kto.jsonl"), 64, GROUP)
    s = types.SimpleNamespace(ts=ts)
    steps = [[0, 1, 2, 3], [4, 5, 6, 7], [6, 2, 3, 5]]
    try:
        every = collate_unpaired(rows_of(s, range(8)), LABELS, 2, 0)
        ref = torch.cat(eng.sequence_logps(every, adapters=True)).reshape(-1, 2).numpy()
        res = []
        for idx in steps:
            mbs = collate_unpaired(rows_of(s, idx), [LABELS[i] for i in idx], 2, 0, ref[idx])
            res.append(eng.step(mbs, lr, eng.objective.divisor(mbs)))
        eng.wait()
        args = trl.KTOConfig(
            output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=64,
            per_device_train_batch_size=GROUP, beta=PREF["beta"],
            desirable_weight=PREF["desirable_weight"], undesirable_weight=PREF["undesirable_weight"],
        )  # fmt: skip
        tr = trl.KTOTrainer(model=pm, args=args, train_dataset=ds, processing_class=tok_plain)
        pm.train()
        params = [p for n, p in pm.named_parameters() if p.requires_grad and ".default." in n]
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        for r, idx in zip(res, steps, strict=True):
            opt.zero_grad()
            tr._metrics["train"].clear()
            loss = tr.compute_loss(pm, tr.data_collator([tr.train_dataset[i] for i in idx]))
            kl = tr._metrics["train"]["kl"][-1]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            assert r.loss == pytest.approx(loss.item(), rel=1e-5)
            assert r.stats["kl"] / len(idx) == pytest.approx(kl, rel=1e-5, abs=1e-7)
        ours, theirs = eng.host.tensors(), peft.get_peft_model_state_dict(pm, adapter_name="default")
        assert set(ours) == set(theirs)
        for k in theirs:
            assert rel_err(ours[k], theirs[k]) < 1e-5, k
    finally:
        eng.close()
