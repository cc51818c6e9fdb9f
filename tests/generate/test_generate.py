"""Streamed generation against transformers: greedy output equals `generate(do_sample=False)` token
for token on tiny models of each layer kind (native dense and sliding window, transformers' own
sliding-window and MoE layers, a hybrid model's recurrent layers), prompts of different lengths in one batch cut into several
left-padded micro-batches, the KV cache on the device and in host memory; sampling's warpers
against transformers' logits processors, its draws against their distribution, reproducible from
the seed whatever the batch or where the cache lives."""

from __future__ import annotations

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.generate import decoder as loop
from horizon_cli.generate.decoder import Decoder
from horizon_cli.model.sample import Sampler
from tests.support.oracle import DEVICE, make_store, one_thread  # noqa: F401 (autouse fixture)
from tests.support.tiny import FAMILIES, GENERIC

LENGTHS = (3, 11, 7, 14, 5)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def engine(store, host: bool = False) -> Engine:
    # host mode needs a link: the CPU transport copies (at an emulated 1000 GB/s) instead of lending
    cfg = EngineConfig(device=DEVICE, dtype="float32", link_gbps=1000.0 if host else 0.0)
    return Engine(store, cfg, OptimConfig(kernel="torch"), forward_only=True)


def run(store, items, sampler, *, host=False, eos=(), new=10, batch=None) -> list[list[int]]:
    eng = engine(store, host)
    try:
        dec = Decoder(eng, sampler, max_new_tokens=new, eos_ids=list(eos), host_kv=host)
        batch = batch or len(items)
        out = []
        for a in range(0, len(items), batch):
            out += [c.ids for c in dec.run([(i, items[i]) for i in range(a, min(len(items), a + batch))])]
        return out
    finally:
        eng.close()


def hf_greedy(model, ids: list[int], new: int, eos) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


CASES = [("llama", False), ("mistral", True), ("gemma3", False), ("qwen3_moe", True)]


@pytest.mark.parametrize("family,host", CASES, ids=[f"{f}-{'host' if h else 'device'}" for f, h in CASES])
def test_greedy_equals_transformers_generate(tmp_path, monkeypatch, family, host):
    """mistral: a window of 8 (native masks); gemma3: transformers' sliding layer (window 6);
    qwen3_moe: routed experts. 5 prompts of 3..14 tokens in micro-batches of <= 24 tokens."""
    monkeypatch.setattr(loop, "MICRO_TOKENS", 24)
    model, store = make_store(tmp_path, family)
    items = prompts(model.config.vocab_size)
    eos = [model.config.eos_token_id]
    ours = run(store, items, Sampler(), host=host, eos=eos, new=12)
    for ids, got in zip(items, ours, strict=True):
        assert got == hf_greedy(model, ids, 12, eos)


@pytest.mark.slow
@pytest.mark.parametrize("family", [*FAMILIES, *GENERIC])
def test_every_family_generates_as_transformers(tmp_path, monkeypatch, family):
    """Every architecture that trains (native and transformers' own layers), the cache on the host."""
    monkeypatch.setattr(loop, "MICRO_TOKENS", 24)
    model, store = make_store(tmp_path, family)
    items = prompts(model.config.vocab_size, seed=2)
    eos = [model.config.eos_token_id] if model.config.eos_token_id is not None else []  # qwen2/3: none
    for ids, got in zip(items, run(store, items, Sampler(), host=True, eos=eos, new=12), strict=True):
        assert got == hf_greedy(model, ids, 12, eos or None)


def test_host_and_device_cache_sample_alike_whatever_the_batch(tmp_path, monkeypatch):
    """Sampling (temperature, top-k, top-p) reads every logit: the host cache gives the tokens of
    the device cache, batches of 2 those of one batch of 5, a seed its own stream."""
    monkeypatch.setattr(loop, "MICRO_TOKENS", 24)
    model, store = make_store(tmp_path, "llama")
    items = prompts(model.config.vocab_size, seed=1)
    sampler = lambda seed=3: Sampler(temperature=0.9, top_p=0.95, top_k=40, seed=seed)  # noqa: E731
    device = run(store, items, sampler())
    assert run(store, items, sampler(), host=True, batch=2) == device
    assert run(store, items, sampler(), batch=3) == device
    assert run(store, items, sampler(seed=4)) != device


def test_warpers_equal_transformers_logits_processors():
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    ids = torch.zeros(6, 1, dtype=torch.int64)
    for t, k, p in [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.5, 10, 0.6), (2.0, 1, 0.9)]:
        ref = TemperatureLogitsWarper(t)(ids, logits.clone())
        if k:
            ref = TopKLogitsWarper(k)(ids, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(ids, ref)
        ours = Sampler(temperature=t, top_k=k, top_p=p).warp(logits)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))
        torch.testing.assert_close(torch.softmax(ours, -1), torch.softmax(ref, -1), rtol=1e-6, atol=1e-7)


def test_sampled_tokens_follow_the_warped_distribution():
    """4000 rows, each its own seeded stream: the frequencies match softmax of the warped logits."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -5.0]])
    s = Sampler(temperature=0.8, top_k=6, top_p=0.9, seed=11)
    probs = torch.softmax(s.warp(logits), -1)[0]
    draws = s.pick(logits.expand(4000, -1), list(range(4000)))
    freq = torch.bincount(draws, minlength=8).float() / 4000
    assert (freq[probs == 0] == 0).all()
    assert (freq - probs).abs().max() < 0.03
    assert torch.equal(
        draws,
        Sampler(temperature=0.8, top_k=6, top_p=0.9, seed=11).pick(
            logits.expand(4000, -1), list(range(4000))
        ),
    )


def test_a_hybrid_model_generates_as_transformers(tmp_path, monkeypatch):
    """Qwen3-Next: Gated DeltaNet layers (a recurrent state and a short convolution in the cache)
    beside a full-attention layer, routed experts; prompts of unequal lengths left-padded in one
    batch, the cache on the device and on the host."""
    import transformers

    from horizon_cli.convert import convert
    from horizon_cli.store import Store

    monkeypatch.setattr(loop, "MICRO_TOKENS", 24)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=400, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=128,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(cfg).float().eval()
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    items = prompts(cfg.vocab_size, seed=3)
    want = [hf_greedy(model, ids, 8, [2]) for ids in items]
    for host in (False, True):
        assert run(Store.open(tmp_path / "store"), items, Sampler(), host=host, eos=[2], new=8) == want
