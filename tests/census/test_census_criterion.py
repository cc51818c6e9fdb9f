"""The census's weight criterion still fails on real bugs (tests/support/census_horizon.train_and_compare).

The exported weights are judged against the oracle that trains the same micro-batches as horizon
(gradient accumulation), within 1e-5, and against the full-batch oracle within 1e-5 plus the two
oracles' own distance. Each mutant below breaks horizon's AdamW in a way no loss, gradient norm or
step-1 gradient can show (the optimizer runs after them), so only the weight check can catch it:
ModernBERT-decoder's weights differ from the full-batch oracle by 2.1e-5 from fp32 summation order
alone (so the old criterion, 1e-5 against the full-batch oracle, called it a mismatch), and each
mutant must still come out `mismatch` while the unmutated run is `exact`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from horizon_cli.engine.objective import TokenCE
from horizon_cli.optim import adamw, kernel
from tests.support.census_horizon import TOL, run_type
from tests.support.oracle import one_thread  # noqa: F401 (autouse fixture: tiny models on one thread)

_CE = TokenCE.train


def _lr_off(p, g, m, v, h):  # the learning rate 0.1 % too large (a wrong scale)
    adamw.adamw_fp32_(p, g, m, v, replace(h, lr=h.lr * 1.001))


def _last_half(p, g, m, v, h):  # step 3's update sees half its gradient (a micro-batch's term lost)
    adamw.adamw_fp32_(p, g * 0.5 if h.step == 3 else g, m, v, h)


def _bias_step(p, g, m, v, h):  # bias correction from the previous step's count
    adamw.adamw_fp32_(p, g, m, v, replace(h, step=max(h.step - 1, 1)))


def _dx_scale(self, head, xs, targets, inv):  # the last micro-batch's gradient into the layers 0.1 % off
    out = _CE(self, head, xs, targets, inv)
    out.dx[-1] = out.dx[-1] * 1.001
    return out


def _dx_lost(self, head, xs, targets, inv):  # the last micro-batch adds nothing to the layers' gradients
    out = _CE(self, head, xs, targets, inv)
    out.dx[-1] = out.dx[-1] * 0.0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mutant", [_dx_scale, _dx_lost], ids=lambda f: f.__name__)
def test_gradient_bugs_fail(mutant, tmp_path, monkeypatch):
    """A wrong scale or a missing term in the gradients: the step-1 gradient check (unchanged: both
    oracles, 1e-5) fails, and so does the whole row."""
    monkeypatch.setattr(TokenCE, "train", mutant)
    got = run_type("modernbert-decoder", 4, tmp_path)
    assert got["result"] == "mismatch" and got["grad_err"] > TOL, got


@pytest.mark.slow
@pytest.mark.parametrize("mutant", [None, _lr_off, _last_half, _bias_step], ids=lambda f: f and f.__name__)
def test_weight_criterion_catches_optimizer_bugs(mutant, tmp_path, monkeypatch):
    if mutant:
        monkeypatch.setattr(kernel.TORCH, "adamw_fp32_", mutant)
    got = run_type("modernbert-decoder", 4, tmp_path)
    assert got["weight_noise"] > TOL, got  # the case the old criterion could not tell from a bug
    if mutant is None:
        assert got["result"] == "exact", got["worst"]
        return
    assert got["grad_err"] <= TOL  # the step-1 gradient: computed before the optimizer runs
    assert got["result"] == "mismatch", got
    assert got["weight_err"] > TOL, got["worst"]
