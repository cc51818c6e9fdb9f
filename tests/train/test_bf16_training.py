"""bf16 runs against an independent mixed-precision reference, and bf16 checkpoints resumed bitwise.

The reference is what a bf16 run means: transformers' model with bf16 weights computes the loss
and gradients, torch.optim.AdamW updates an fp32 master from those gradients (upcast), and the
bf16 weights are the master rounded after every step. horizon's engine differs from it only in
rounding (fp32 accumulation of micro-batch gradients before narrowing them to bf16, where
transformers accumulates in bf16), so over 20 steps every weight's movement agrees to ~1% of the
movement itself, and every loss to ~3e-5. An engine whose bf16 weights do not move (updates
written into a copy, a master that never reaches the streaming copy) misses by 100%.

Resume: in bf16 runs the fp32 master is the bf16 streaming copy plus a 16-bit remainder `lo`
(optim/split.py); a checkpoint must carry `lo`, or a resumed run continues from the rounded
weights. Every other resume test runs in fp32, which has no `lo`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.optim import native
from horizon_cli.store import Store
from horizon_cli.train import checkpoint
from tests.engine.test_engine_training import HP, batches, run_engine
from tests.support.oracle import DEVICE, engine_weights, hf_loss_backward, make_store, one_thread  # noqa: F401

KERNELS = ["torch", "native"]


def bf16_engine(store: Store, kernel: str) -> Engine:
    if kernel == "native" and not native.available():
        pytest.skip(f"native AdamW kernel unavailable: {native.reason()}")
    cfg = EngineConfig(device=DEVICE, dtype="bfloat16", loss_chunk=16)
    return Engine(store, cfg, OptimConfig(kernel=kernel, **HP))


def mixed_precision_reference(model, data, hp) -> tuple[list[float], dict[str, torch.Tensor]]:
    """bf16 forward/backward in transformers, fp32 master + torch.optim.AdamW: (losses, master)."""
    bf = copy.deepcopy(model).to(torch.bfloat16)
    master = {n: p.detach().float().clone().requires_grad_(True) for n, p in bf.named_parameters()}
    opt = torch.optim.AdamW(
        list(master.values()),
        lr=hp["lr"],
        betas=tuple(hp["betas"]),
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
    )
    losses = []
    for mbs in data:
        bf.zero_grad(set_to_none=True)
        losses.append(hf_loss_backward(bf, mbs))
        for n, p in bf.named_parameters():
            master[n].grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(list(master.values()), hp["grad_clip"])
        opt.step()
        with torch.no_grad():
            for n, p in bf.named_parameters():
                p.copy_(master[n])  # the streaming copy: the master rounded to bf16
    return losses, {n: t.detach() for n, t in master.items()}


@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_twenty_steps_match_a_mixed_precision_reference(tmp_path, kernel):
    model, store = make_store(tmp_path, "llama", False, dtype="bfloat16")
    data = batches(model.config.vocab_size, micro=2)
    eng = bf16_engine(store, kernel)
    start = engine_weights(eng)
    try:
        res = run_engine(eng, data, HP["lr"])
        ours = engine_weights(eng)
        streamed = {p.hf: v for st in eng.host.units.values() for p in st.layout.tensors
                    for v in [st.views(st.stream)[p.name].float()]}  # fmt: skip
    finally:
        eng.close()
    ref_losses, ref = mixed_precision_reference(model, data, HP)
    for r, l_ref in zip(res, ref_losses, strict=True):
        assert abs(r.loss - l_ref) / l_ref < 2e-4  # the loss itself moves ~8e-4 over the run
    for name, want in ref.items():
        moved = want - start[name]
        assert float(moved.norm()) > 0, name
        # each tensor's movement, within 5% of itself (measured: <= 1.4%; no update: 100%)
        assert float((ours[name] - want).norm() / moved.norm()) < 0.05, name
        # the streaming copy is the master rounded to bf16: to nearest, an exact tie away from zero
        # (optim/split.py; torch's .to rounds ties to even: they differ on ~2^-16 of the values)
        m = ours[name].contiguous()
        tie = (m.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(streamed[name][~tie], m.to(torch.bfloat16).float()[~tie]), name
        assert bool((streamed[name][tie].abs() > m[tie].abs()).all()), name


def host_state(eng) -> dict[str, bytes]:
    """Every buffer a resumed run continues from, as bytes: streaming copy, lo, m, v."""
    out = {}
    for name, st in eng.host.units.items():
        for key, t in st.buffers().items():
            if key != "grad":
                out[f"{name}.{key}"] = t.view(torch.uint8).numpy().tobytes()
    return out


@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_checkpoint_resumes_bitwise(tmp_path, kernel):
    """Four steps straight, against two steps, a checkpoint, a fresh engine on it, two more."""
    model, store = make_store(tmp_path, "llama", False, dtype="bfloat16")
    data = batches(model.config.vocab_size, micro=2, steps=4)

    eng = bf16_engine(store, kernel)
    try:
        straight = [r.loss for r in run_engine(eng, data, HP["lr"])]
        want = host_state(eng)
    finally:
        eng.close()

    eng = bf16_engine(store, kernel)
    try:
        first = [r.loss for r in run_engine(eng, data[:2], HP["lr"])]
        assert any(bool(st.lo.any()) for st in eng.host.units.values())  # the master has low bits
        trainer = {"step": 2, "adam_step": eng.adam_step}
        ck = checkpoint.save(eng, tmp_path / "run", 2, trainer, "", store, keep_last=1)
    finally:
        eng.close()

    eng = bf16_engine(Store.open(ck), kernel)
    try:
        assert checkpoint.load(eng, ck)["step"] == 2
        rest = [r.loss for r in run_engine(eng, data[2:], HP["lr"])]
        got = host_state(eng)
    finally:
        eng.close()
    assert first + rest == straight
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == want[key], key
