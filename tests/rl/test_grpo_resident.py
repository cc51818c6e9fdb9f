"""The resident rollout engine (recipes.grpo.rollout_engine, generate.resident) on the CPU, whose
"device" is host memory: `full` rollouts equal the streamed engine's line for line and train the
same weights bitwise; a narrowed copy's rollouts record the sampler's log-probs, which a
transformers model holding the same quantized weights gives (and the trained weights do not);
a run resumed inside a num_iterations group with a narrowed copy equals an uninterrupted one; the
copy's device memory and its link bytes (once per refresh, not per token)."""

from __future__ import annotations

import json

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig, RLConfig
from horizon_cli.engine import Engine
from horizon_cli.generate.decoder import Decoder
from horizon_cli.generate.resident import ResidentCopy
from horizon_cli.model.sample import Sampler
from horizon_cli.quant.weight_only import quantize
from horizon_cli.recipes.grpo.plan import copy_bytes
from horizon_cli.recipes.grpo.rollout_engine import choose, engine_copy_bytes
from horizon_cli.store import Store
from horizon_cli.train.metrics import read_metrics
from tests.rl.test_grpo_train import _run

LINES = lambda run, n: (run / "rollouts" / f"step-{n}.jsonl").read_text().splitlines()  # noqa: E731


def _bins(run) -> dict:
    ck = run / "checkpoints" / "step_3"
    return {f.relative_to(ck): f.read_bytes() for f in sorted(ck.rglob("*.bin"))}


def test_resident_full_equals_streamed_and_its_refresh_carries_each_update(tmp_path, tiny_store):
    """Three steps at a large lr: every step's rollouts line for line, every weight bitwise; the
    rollouts of steps 2 and 3 differ from those of a run that does not learn (lr 0), so a copy
    that missed an update would not have matched."""
    out = {"save_every": 3, "keep_last": 1}
    over = ["train.steps=3", "optim.lr=0.05"]
    s = _run(tmp_path, tiny_store, "s", {"rollout_engine": "streamed"}, over, output=out)
    r = _run(
        tmp_path, tiny_store, "r", {"rollout_engine": "resident", "rollout_weights": "full"}, over, output=out
    )
    frozen = _run(
        tmp_path, tiny_store, "z", {"rollout_engine": "streamed"}, [*over, "optim.lr=0"], output=out
    )
    for n in (1, 2, 3):
        assert LINES(r, n) == LINES(s, n), n
        assert all("sampling_logps" not in json.loads(ln) for ln in LINES(r, n))
    assert LINES(s, 2) != LINES(frozen, 2) and LINES(s, 3) != LINES(frozen, 3)
    assert _bins(r) == _bins(s)
    rows = read_metrics(r / "metrics.jsonl")
    assert all(x["rollout_refresh_s"] > 0 for x in rows) and not any(
        k.startswith("sampling/") for k in rows[0]
    )


def _hf_logps(
    tiny_store, fmt: str | None, ids: list[int], n_prompt: int, temperature: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """transformers' log_softmax(logits) of the completion ids, every decoder layer's matrices
    quantized and dequantized as the copy holds them (fmt None: the weights as trained); with a
    temperature and top_k, of the scores transformers' warpers sample from (processed log-probs)."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(tiny_store.parent / "hf", dtype=torch.float32)
    with torch.no_grad():
        for name, w in m.named_parameters():
            if fmt and ".layers." in name and w.dim() == 2:
                q = quantize(w.data.clone(), fmt)
                q.dequantize(w.data)
        lg = m(torch.tensor([ids])).logits[0].float()
    if top_k:
        warp = transformers.LogitsProcessorList(
            [transformers.TemperatureLogitsWarper(temperature), transformers.TopKLogitsWarper(top_k)]
        )
        lg = warp(torch.tensor([ids]), lg)
    lp = torch.log_softmax(lg, dim=-1)
    return lp[n_prompt - 1 : -1].gather(1, torch.tensor(ids[n_prompt:]).view(-1, 1)).view(-1)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "nf4"])
def test_a_narrowed_copy_records_the_samplers_logps(tmp_path, tiny_store, fmt):
    """Step 1's rollouts (the initial weights): each line's sampling_logps are the quantized
    model's log-probs of its ids (transformers, the same dequantized weights), close to but not
    the trained weights'; the correction's metrics are logged."""
    rl = {"rollout_engine": "resident", "rollout_weights": fmt}
    run = _run(tmp_path, tiny_store, fmt, rl, ["train.steps=1"])
    gaps = []
    for ln in LINES(run, 1):
        rec = json.loads(ln)
        ids, got = rec["prompt_ids"] + rec["completion_ids"], torch.tensor(rec["sampling_logps"])
        assert got.shape == (len(rec["completion_ids"]),)
        want = _hf_logps(tiny_store, fmt, ids, len(rec["prompt_ids"]))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        gaps.append((got - _hf_logps(tiny_store, None, ids, len(rec["prompt_ids"]))).abs().max())
    assert 1e-4 < max(gaps) < 0.5
    row = read_metrics(run / "metrics.jsonl")[0]
    assert 0 < row["sampling/sampling_logp_difference/max"] < 0.5


def test_a_narrowed_copy_records_processed_logps(tmp_path, tiny_store):
    """With temperature and top_k, each sampled id's log-prob under the scores it was drawn from
    (vLLM's processed_logprobs, which TRL's correction asks for), not the full softmax."""
    rl = {"rollout_engine": "resident", "rollout_weights": "int8", "temperature": 0.7, "top_k": 3}
    run = _run(tmp_path, tiny_store, "k", rl, ["train.steps=1"])
    for ln in LINES(run, 1):
        rec = json.loads(ln)
        ids, got = rec["prompt_ids"] + rec["completion_ids"], torch.tensor(rec["sampling_logps"])
        n = len(rec["prompt_ids"])
        torch.testing.assert_close(got, _hf_logps(tiny_store, "int8", ids, n, 0.7, 3), atol=2e-5, rtol=0)
        assert bool(
            (got > _hf_logps(tiny_store, "int8", ids, n) + 1e-3).all()
        )  # temperature and top-k raise each pick's


def test_resumed_inside_a_group_with_a_narrowed_copy(tmp_path, tiny_store):
    """num_iterations 2, int8 copy: cut after step 3 and resumed (step 4 reuses step 3's rollouts,
    their sampler log-probs and IS ratios from rollouts/step-3.pt): files, losses, weights bitwise."""
    rl = {"num_iterations": 2, "rollout_engine": "resident", "rollout_weights": "int8"}
    out = {"save_every": 1, "keep_last": 5}
    whole = _run(tmp_path, tiny_store, "whole", rl, ["train.steps=4"], output=out)
    _run(tmp_path, tiny_store, "cut", rl, ["train.steps=3"], output=out)
    cut = _run(tmp_path, tiny_store, "cut", rl, ["train.steps=4"], output=out)
    a, b = (read_metrics(r / "metrics.jsonl") for r in (whole, cut))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert a[3]["sampling/importance_sampling_ratio/mean"] == b[3]["sampling/importance_sampling_ratio/mean"]
    for n in (1, 3):
        assert LINES(whole, n) == LINES(cut, n)
    ca, cb = (r / "checkpoints" / "step_4" for r in (whole, cut))
    files = [f.relative_to(ca) for f in ca.rglob("*.bin")]
    assert files and all((ca / f).read_bytes() == (cb / f).read_bytes() for f in files)


def _decode(engine, copy=None, n_new=6):
    sweeps = []
    dec = Decoder(engine, Sampler(1.0, seed=3), max_new_tokens=n_new, on_sweep=sweeps.append,
                  weights=copy.loader() if copy else None)  # fmt: skip
    prompts = [(i, [5 + i, 9, 17, 33]) for i in range(4)]
    return [c.ids for c in dec.run(prompts)], sweeps


@pytest.mark.parametrize("fmt", ["full", "int8", "nf4"])
def test_the_link_carries_the_model_once_per_refresh_and_memory_is_the_planned(tiny_store, fmt):
    """With an emulated link: the streamed engine moves every layer in each sweep; the resident
    copy moves the model once (its refresh) and no layer in any sweep. The device's accounting
    holds the copy (engine_copy_bytes, what `auto` judges) while it lives, nothing after."""
    cfg = EngineConfig(device="cpu", dtype="float32", link_gbps=50.0)
    e = Engine(Store.open(tiny_store), cfg, OptimConfig(), forward_only=True)
    try:
        host = e.p.loader.host
        model = sum(host[u].stream.numel() * 4 for u in ["layer.0", "layer.1", "head", "embed"])
        streamed, s_sweeps = _decode(e)
        layers = sum(host[u].stream.numel() * 4 for u in ["layer.0", "layer.1"])
        assert all(s.h2d_bytes >= layers for s in s_sweeps)
        with ResidentCopy.refresh(e, fmt) as copy:
            assert copy.refresh_bytes == model
            held = e.t.memory.current
            planned = copy_bytes(Store.open(tiny_store).arch, "float32", fmt)  # the dry run's figure
            assert held["resident copy"] + held.get("resident dequantized layer", 0) == planned
            assert engine_copy_bytes(e, fmt) == planned
            ids, r_sweeps = _decode(e, copy)
        assert all(s.h2d_bytes < layers // 10 for s in r_sweeps)  # the embedding's rows only
        assert e.t.memory.current["resident copy"] == 0
        if fmt == "full":
            assert ids == streamed
    finally:
        e.close()


def test_refresh_reads_the_host_weights_as_they_are_now(tiny_store):
    """A change to the host weights shows in the next refresh, quantized as quantize() makes it."""
    e = Engine(
        Store.open(tiny_store), EngineConfig(device="cpu", dtype="float32"), OptimConfig(), forward_only=True
    )
    try:
        st = e.p.loader.host["layer.1"]
        st.stream.mul_(1.5)
        with ResidentCopy.refresh(e, "int8") as copy:
            got = {n: v.clone() for n, v in copy.weights("layer.1").items()}
        for n, v in st.views(st.stream).items():
            want = torch.empty_like(v)
            quantize(v, "int8").dequantize(want)
            assert torch.equal(got[n], want), n
    finally:
        e.close()


def test_auto_chooses_by_size():
    rl = RLConfig()
    sizes = {"full": 100, "fp8": 50, "nf4": 30}
    assert choose(rl, None, sizes.__getitem__, 20, None).weights == "full"  # the CPU
    assert choose(rl, None, sizes.__getitem__, 20, 100).weights == "fp8"  # (50 + 20) <= 3/4 of 100
    c = choose(rl, None, sizes.__getitem__, 70, 100)  # nf4: 100 > 9/10 of 100
    assert (c.engine, c.weights) == ("streamed", "full") and "nf4" in c.why
    c = choose(rl, "a LoRA run's rollouts stream", sizes.__getitem__, 0, None)
    assert c.engine == "streamed" and "LoRA" in c.why


REFUSED = [
    ({"rollout_engine": "streamed", "rollout_weights": "int8"}, "rl.rollout_weights: int8 is a resident copy's format"),
    ({"rollout_engine": "resident", "__engine": {"kv_cache": "host"}}, "rl.rollout_engine: resident decodes with its KV cache on the device"),
    ({"rollout_engine": "resident", "__lora": {"r": 4}}, "rl.rollout_engine: resident: a LoRA run's rollouts stream"),
    ({"rollout_engine": "resident", "rollout_weights": "int8", "__lora": {"r": 4}},
     "set streamed or auto with rl.rollout_weights auto or full"),  # the advice that then holds
    ({"rollout_weights": "int4"}, "rl.rollout_weights: 'int4' is not allowed"),
]  # fmt: skip


@pytest.mark.parametrize("keys,line", REFUSED, ids=[r[1][:40] for r in REFUSED])
def test_refused_in_one_line(tmp_path, tiny_store, keys, line):
    from tests.conftest import write_config, write_jsonl
    from tests.rl.test_grpo_train import _prompts
    from tests.train.test_train_cli import horizon, one_error_line

    rl = {k: v for k, v in keys.items() if not k.startswith("__")}
    more = {k[2:]: v for k, v in keys.items() if k.startswith("__")}
    data = write_jsonl(tmp_path / "p.jsonl", _prompts())
    rl |= {"max_completion_length": 8, "rewards": [{"function": "length", "target": 4}]}
    cfg = write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "run", rl=rl, **more)
    assert line in one_error_line(horizon("train", cfg))
    assert not (tmp_path / "run").exists()
