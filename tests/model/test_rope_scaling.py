"""RoPE scaling on the native layer: Llama-3.1 ("llama3") with frequencies inside its smoothing band,
as in the real 8B, and linear scaling.

The scaling leaves short wavelengths alone (< original_max / high_freq_factor), divides long ones
by `factor` (> original_max / low_freq_factor), and blends the two in between. The parity family
`llama31` of tests.support.tiny (head_dim 8, original max 64) has no wavelength in that band,
so the blend was never exercised. This config takes the real 8B's settings (theta 500000, factor 8, low 1,
high 4, original 8192) with head_dim 64, which puts three of its 32 frequencies in the band.
"""

import math

import pytest
import torch

from horizon_cli.data.batch import IGNORE, MicroBatch
from horizon_cli.model.layer import inv_freq
from tests.support.oracle import make_engine, make_store, one_thread, rel_err  # noqa: F401 (one_thread: autouse)

ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPE = dict(
    head_dim=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    rope_scaling=ROPE,
    rope_theta=500000.0,
    max_position_embeddings=131072,
)


@pytest.fixture(scope="module")
def model_store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("rope"), "llama", False, **SHAPE)


def test_the_config_has_frequencies_in_the_smoothing_band():
    """Arithmetic, independent of any code under test: wavelength 2*pi*theta^(2i/d) of each pair."""
    d, theta, old = SHAPE["head_dim"], SHAPE["rope_theta"], ROPE["original_max_position_embeddings"]
    waves = [2 * math.pi * theta ** (2 * i / d) for i in range(d // 2)]
    lo, hi = old / ROPE["high_freq_factor"], old / ROPE["low_freq_factor"]  # 2048, 8192
    inside = [w for w in waves if lo < w < hi]
    assert [round(w) for w in inside] == [2948, 4443, 6695]
    assert any(w < lo for w in waves) and any(w > hi for w in waves)  # all three regimes


def test_inverse_frequencies_match_transformers(model_store):
    model, store = model_store
    ours = inv_freq(store.arch)
    ref = model.model.rotary_emb.inv_freq
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-6
    # the blended frequencies lie strictly between the unscaled and the fully scaled ones
    base = 1.0 / (SHAPE["rope_theta"] ** (torch.arange(0, 64, 2).float() / 64))
    blended = (ours < base * 0.999) & (ours > base / ROPE["factor"] * 1.001)
    assert int(blended.sum()) == 3


def test_logits_and_grads_match_transformers_far_into_the_sequence(model_store):
    """Positions near 5000, where the blended frequencies have turned the most."""
    model, store = model_store
    eng = make_engine(store)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=g)
    pos = (torch.arange(24) + 5000).expand(2, 24).contiguous()
    labels = ids.clone()
    labels[:, :3] = IGNORE
    mb = MicroBatch(ids, labels, pos)
    try:
        ours = eng.logits(mb)
        ref = model(input_ids=ids, position_ids=pos).logits.detach()
        assert rel_err(ours, ref) < 1e-5

        loss_sum, tokens, _ = eng.forward_backward([mb])
        eng.t.synchronize()
        model.zero_grad()
        n = mb.label_tokens
        logits = model(input_ids=ids, position_ids=pos).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
        )
        (loss / n).backward()
        assert abs(loss_sum / tokens - loss.item() / n) / (loss.item() / n) < 1e-5
        hf = dict(model.named_parameters())
        for st in eng.host.units.values():
            grads = st.views(st.dense_grad())
            for s in st.layout.slots:
                assert rel_err(grads[s.name], hf[s.hf].grad) < 1e-5, s.hf
    finally:
        eng.close()


LINEAR = dict(rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_theta=10000.0)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    """Linear scaling (positions divided by `factor`) on the native layer: no other native test
    model scales its RoPE linearly."""
    model, store = make_store(tmp_path, "llama", False, **LINEAR)
    assert store.arch.rope["rope_type"] == "linear"
    assert rel_err(inv_freq(store.arch), model.model.rotary_emb.inv_freq) < 1e-6
    eng = make_engine(store)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    mb = MicroBatch(ids, ids.clone(), torch.arange(24).expand(2, 24).contiguous())
    try:
        assert rel_err(eng.logits(mb), model(input_ids=ids).logits.detach()) < 1e-5
    finally:
        eng.close()
