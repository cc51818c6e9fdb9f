"""Gradient clipping on both sides of its threshold, as torch.nn.utils.clip_grad_norm_ does it.

The 20-step oracle test clips every step (all its gradient norms exceed its grad_clip), so a clip
that also scaled small gradients *up* would pass it. Here the threshold sits inside the range of
the run's norms: some steps are clipped, the others must be left alone.
"""

from __future__ import annotations

from tests.engine.test_engine_training import HP, batches, run_engine
from tests.support.oracle import engine_weights, hf_train_hp, make_engine, make_store, one_thread, rel_err  # noqa: F401

CLIP = 1.2  # the tiny Llama's gradient norms on this data run from ~1.0 to ~1.8


def test_clipping_leaves_small_gradients_alone(tmp_path):
    model, store = make_store(tmp_path, "llama", False)
    data = batches(model.config.vocab_size, micro=2)
    hp = {**HP, "grad_clip": CLIP}
    eng = make_engine(store, **hp)
    try:
        res = run_engine(eng, data, hp["lr"])
        ours = engine_weights(eng)
    finally:
        eng.close()
    norms = [r.grad_norm for r in res]
    assert min(norms) < CLIP < max(norms), norms  # both branches of the clip
    ref = hf_train_hp(model, data, hp)
    for r, l_ref in zip(res, ref, strict=True):
        assert abs(r.loss - l_ref) / l_ref < 1e-5
    for name, p in model.named_parameters():
        assert rel_err(ours[name], p.detach()) < 1e-5, name
