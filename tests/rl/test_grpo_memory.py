"""GRPO under the memory modes test_grpo_train / test_grpo_modes leave out: kept layers
(`engine.keep_activations` > 0: the last layers keep their autograd graph from the forward to the
backward instead of recomputing it, the same arithmetic) train bit for bit what recompute-every-
layer trains, and `optim.memory: lean` (bf16 weight + quantized moments) starts exactly where
exact starts on a bf16-valued store and stays within lean's drift after."""

from __future__ import annotations

import json

import pytest

from horizon_cli.train.metrics import read_metrics
from tests.rl.test_grpo_train import _rollouts, _run

pytest.importorskip("trl")

STEPS = 3


def _bins(run) -> dict:
    ck = run / "checkpoints" / f"step_{STEPS}"
    return {str(f.relative_to(ck)): f.read_bytes() for f in sorted(ck.rglob("*.bin"))}


# the tiny store has 2 layers: the last one kept, and all (the slow tier)
@pytest.mark.parametrize("keep", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_kept_layers_train_bitwise_what_recompute_trains(tmp_path, tiny_store, keep):
    """Bitwise, not a tolerance: a kept layer's backward runs the graph its forward built, a
    recomputed layer's backward runs the same forward again on the same inputs and weights (same
    kernels, same order, deterministic on the CPU), so every loss, grad norm, rollout file and
    weight byte is equal."""
    rl = {"beta": 0.04}
    out = {"save_every": STEPS, "keep_last": 1}
    over = [f"train.steps={STEPS}"]
    base = _run(tmp_path, tiny_store, "k0", rl, over, output=out, engine={"keep_activations": 0})
    kept = _run(tmp_path, tiny_store, f"k{keep}", rl, over, output=out, engine={"keep_activations": keep})
    assert json.loads((kept / "checkpoints" / f"step_{STEPS}" / "state" / "trainer.json").read_text())[
        "kept_layers"
    ] == keep  # fmt: skip
    a, b = (read_metrics(r / "metrics.jsonl") for r in (base, kept))
    assert len(a) == STEPS
    assert {r["kept_layers"] for r in a} == {0} and {r["kept_layers"] for r in b} == {keep}
    # a kept layer is not loaded again for its backward
    assert all(x["weight_loads"] > y["weight_loads"] for x, y in zip(a, b, strict=True))
    for key in ("loss", "grad_norm", "kl", "reward"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    for n in range(1, STEPS + 1):
        f = f"rollouts/step-{n}.jsonl"
        assert (base / f).read_bytes() == (kept / f).read_bytes(), f
    wa, wb = _bins(base), _bins(kept)
    assert wa and wa.keys() == wb.keys() and all(wa[k] == wb[k] for k in wa)


def test_lean_starts_where_exact_starts_and_stays_within_its_drift(tmp_path, tiny_store):
    """On a bf16 store, computing in fp32 in both: step 1 runs on the same weights (lean's bf16
    weight is the store's; exact's fp32 master is the store's bf16 values upcast), so its rollouts,
    loss and gradient norm are exact's bit for bit (measured; the same fp32 kernels on the same
    values, the norm taken before lean keeps the gradient in bf16). After that lean's update differs
    (bf16 gradient, quantized moments, the bf16 compute weight of a 24-bit master): the gradient
    norm stays within test_lean's 0.3 % loss bound (measured 0.13 %); the loss here is ~beta x kl,
    second order in how far the weights moved from the reference, so its relative drift is about
    twice that of the displacement: held to 2 % (measured 0.75 %), and nonzero (lean ran)."""
    from horizon_cli.convert import convert

    s16 = tmp_path / "store16"
    convert(tiny_store.parent / "hf", s16, dtype="bfloat16")
    rl = {"beta": 0.04}
    out = {"save_every": 0}
    over = [f"train.steps={STEPS}"]
    exact = _run(tmp_path, s16, "exact", rl, over, output=out)
    lean = _run(tmp_path, s16, "lean", rl, over, output=out, optim={"memory": "lean"})
    a, b = (read_metrics(r / "metrics.jsonl") for r in (exact, lean))
    assert len(a) == len(b) == STEPS
    for key in ("loss", "grad_norm", "kl", "reward"):
        assert a[0][key] == b[0][key], key
    f = "rollouts/step-1.jsonl"
    assert (exact / f).read_bytes() == (lean / f).read_bytes()
    for x, y in zip(a[1:], b[1:], strict=True):
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=3e-3)
        assert y["kl"] == pytest.approx(x["kl"], rel=2e-2) and y["loss"] == pytest.approx(x["loss"], rel=2e-2)
    assert any(
        x["kl"] != y["kl"] for x, y in zip(a[1:], b[1:], strict=True)
    )  # lean's own update, not exact's
    for n in range(1, STEPS + 1):
        rs = _rollouts(lean, n)
        assert len(rs) == 8 and all(1 <= len(r["completion_ids"]) <= 8 for r in rs)
