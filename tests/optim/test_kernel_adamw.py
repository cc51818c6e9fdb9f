"""Parity of the fused C++ AdamW kernel (kernels/adamw.cpp via optim.native) with its oracles.

What "equal" means here, and why:
- m and v are bitwise equal to both torch.optim.AdamW and the torch reference (optim.adamw): the
  kernel performs torch's own fp32 operations in torch's order, fusing exactly where torch's CPU
  kernels fuse (lerp and addcmul are fused multiply-adds in the torch 2.13 wheels).
- p is bitwise equal to the reference with one deliberate change, an IEEE (correctly rounded)
  sqrt (`ieee_reference_` below). torch.sqrt on CPU calls MKL VML in high-accuracy mode, which is
  within 1 ulp but not correctly rounded, and no fused kernel can reproduce that; the kernel uses
  the hardware sqrt, so its result is the same on every ISA and machine. Against torch itself p
  therefore agrees to a few ulps (checked at 1e-6 relative).
- The three ISA paths (avx512, avx2, scalar) are bitwise equal to one another; each is forced in
  turn where this CPU supports it.
"""

from __future__ import annotations

import math

import pytest
import torch

from horizon_cli.optim import native
from horizon_cli.optim.adamw import AdamWHyper, adamw_fp32_, adamw_split_
from horizon_cli.optim.split import join, split_

SIZES = [1, 7, 16, 33, 1000, 70_001]  # odd tails; 70_001 spans several 16K chunks, so threads
STEPS = 5
LR, WD, GRAD_SCALE = 1e-2, 0.1, 0.37


@pytest.fixture(scope="module", autouse=True)
def _kernel() -> None:
    if not native.available():
        pytest.skip(f"native AdamW kernel unavailable: {native.reason()}")


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request) -> str:
    """Each path in turn, forced; one the CPU lacks is skipped (the others still cover it)."""
    if request.param not in native.isas():
        pytest.skip(f"this CPU does not support the {request.param} path")
    return request.param


def hyper(step: int, beta1: float = 0.9) -> AdamWHyper:
    return AdamWHyper(
        lr=LR, beta1=beta1, beta2=0.95, eps=1e-8, weight_decay=WD, step=step, grad_scale=GRAD_SCALE
    )


def grads(n: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    # (n,) per step, magnitudes spread over 1e-4..10 so sqrt(v) and eps both matter somewhere.
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n, generator=gen) * 10.0 ** torch.randint(-4, 2, (n,), generator=gen)
        for _ in range(steps)
    ]


def init(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def ieee_reference_(p, g, m, v, h: AdamWHyper) -> None:
    """optim.adamw.adamw_fp32_ with a correctly rounded sqrt (see the module docstring)."""
    g = g * h.grad_scale
    p.mul_(1.0 - h.lr * h.weight_decay)
    m.lerp_(g, 1.0 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
    bc1 = 1.0 - h.beta1**h.step
    bc2_sqrt = math.sqrt(1.0 - h.beta2**h.step)
    denom = (v.double().sqrt().float() / bc2_sqrt).add_(h.eps)
    p.addcdiv_(m, denom, value=-h.lr / bc1)


def torch_adamw(
    p0: torch.Tensor, gs: list[torch.Tensor], beta1: float = 0.9, **kw
) -> tuple[torch.Tensor, ...]:
    """p, m, v after len(gs) steps of torch.optim.AdamW on fp32 p0, grads pre-scaled by GRAD_SCALE."""
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([param], lr=LR, betas=(beta1, 0.95), eps=1e-8, weight_decay=WD, **kw)
    for g in gs:
        param.grad = g * GRAD_SCALE
        opt.step()
    state = opt.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = int((a.view(torch.int32) != b.view(torch.int32)).sum())
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ in their bits"


def assert_close_p(p: torch.Tensor, expected: torch.Tensor, steps: int) -> None:
    # 1e-6 relative; near zero, relative to the size of the updates made (lr per step).
    torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-6 * LR * steps)


def run_fp32(p0, gs, isa, beta1=0.9) -> tuple[torch.Tensor, ...]:
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(gs, 1):
        native.adamw_fp32_(p, g, m, v, hyper(t, beta1), isa=isa)
    return p, m, v


def run_split(p0, gs, isa, beta1=0.9) -> tuple[torch.Tensor, ...]:
    hi, lo = torch.empty(p0.numel(), dtype=torch.bfloat16), torch.empty(p0.numel(), dtype=torch.int16)
    split_(p0, hi, lo)
    m, v = torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(gs, 1):
        native.adamw_split_(hi, lo, g, m, v, hyper(t, beta1), isa=isa)
    return hi, lo, m, v


# beta1 = 0.3 takes torch's other lerp branch (weight 1 - beta1 >= 0.5).
@pytest.mark.parametrize("beta1", [0.9, 0.3])
@pytest.mark.parametrize("n", SIZES)
def test_fp32_matches_references(isa: str, n: int, beta1: float) -> None:
    p0, gs = init(n), grads(n, STEPS)
    p, m, v = run_fp32(p0, gs, isa, beta1)

    ref_p, ref_m, ref_v = p0.clone(), torch.zeros(n), torch.zeros(n)
    ieee_p, ieee_m, ieee_v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for t, g in enumerate(gs, 1):
        adamw_fp32_(ref_p, g, ref_m, ref_v, hyper(t, beta1))
        ieee_reference_(ieee_p, g, ieee_m, ieee_v, hyper(t, beta1))
    assert_bitwise(m, ref_m, "m vs reference")
    assert_bitwise(v, ref_v, "v vs reference")
    assert_bitwise(p, ieee_p, "p vs reference with IEEE sqrt")
    assert_close_p(p, ref_p, STEPS)


@pytest.mark.parametrize("foreach", [False, None])  # None: torch's default for CPU tensors
@pytest.mark.parametrize("n", SIZES)
def test_fp32_matches_torch_optim(n: int, foreach: bool | None) -> None:
    p0, gs = init(n), grads(n, STEPS)
    p, m, v = run_fp32(p0, gs, "auto")
    t_p, t_m, t_v = torch_adamw(p0, gs, foreach=foreach)
    assert_bitwise(m, t_m, "m vs torch.optim.AdamW")
    assert_bitwise(v, t_v, "v vs torch.optim.AdamW")
    assert_close_p(p, t_p, STEPS)


@pytest.mark.parametrize("n", SIZES)
def test_split_master_matches(isa: str, n: int) -> None:
    p0, gs = init(n), grads(n, STEPS)
    hi, lo, m, v = run_split(p0, gs, isa)
    master = join(hi, lo)

    # (hi, lo) holds the fp32 master exactly, so the split path is the fp32 path, bit for bit.
    f_p, f_m, f_v = run_fp32(p0, gs, isa)
    assert_bitwise(master, f_p, "split master vs fp32 kernel")
    assert_bitwise(m, f_m, "m vs fp32 kernel")
    assert_bitwise(v, f_v, "v vs fp32 kernel")

    t_p, t_m, t_v = torch_adamw(p0, gs, foreach=False)
    assert_close_p(master, t_p, STEPS)
    assert_bitwise(m, t_m, "m vs torch.optim.AdamW")

    # the torch split reference, same moments and a master a few ulps away (its sqrt)
    r_hi, r_lo, r_m, r_v = torch.empty_like(hi), torch.empty_like(lo), torch.zeros(n), torch.zeros(n)
    split_(p0, r_hi, r_lo)
    for t, g in enumerate(gs, 1):
        adamw_split_(r_hi, r_lo, g, r_m, r_v, hyper(t))
    assert_bitwise(v, r_v, "v vs split reference")
    assert_close_p(master, join(r_hi, r_lo), STEPS)


def test_split_hi_is_rounded_master(isa: str) -> None:
    n = 70_001
    hi, lo, _, _ = run_split(init(n), grads(n, 2), isa)
    master = join(hi, lo)
    exp_hi, exp_lo = torch.empty_like(hi), torch.empty_like(lo)
    split_(master, exp_hi, exp_lo)
    assert torch.equal(hi.view(torch.int16), exp_hi.view(torch.int16))
    assert torch.equal(lo, exp_lo)
    # hi is the master rounded to nearest bf16; split.py breaks exact ties away from zero where
    # torch's cast breaks them to even, so compare off the ties.
    not_tie = (master.view(torch.int32) & 0xFFFF) != 0x8000
    assert torch.equal(hi[not_tie], master[not_tie].to(torch.bfloat16))


def test_split_round_trip_including_ties(isa: str) -> None:
    # A zero-lr step leaves every nonzero master unchanged, so (hi, lo) must come back as they
    # went in: exercises join and split on negatives, tiny and huge values and exact ties.
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (4099,), dtype=torch.int64, generator=gen).to(torch.int32)
    bits[::7] = (bits[::7] & ~0xFFFF) | 0x8000  # exact ties
    master = bits.view(torch.float32)
    master = master[torch.isfinite(master) & (master != 0)].contiguous()
    n = master.numel()
    hi, lo = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    split_(master, hi, lo)
    hi0, lo0 = hi.clone(), lo.clone()
    h = AdamWHyper(lr=0.0, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    native.adamw_split_(hi, lo, torch.zeros(n), torch.zeros(n), torch.zeros(n), h, isa=isa)
    assert torch.equal(hi.view(torch.int16), hi0.view(torch.int16))
    assert torch.equal(lo, lo0)


def test_isas_agree_bitwise() -> None:
    n = 70_001
    p0, gs = init(n), grads(n, STEPS)
    results = {isa: run_fp32(p0, gs, isa) for isa in native.isas()}
    base = results[native.isas()[0]]
    for isa, out in results.items():
        for name, a, b in zip("pmv", out, base, strict=True):
            assert_bitwise(a, b, f"{name}: {isa} vs {native.isas()[0]}")


def test_threads_do_not_change_results() -> None:
    n = 100_003
    p0, gs = init(n), grads(n, 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_fp32(p0, gs, "auto")
        torch.set_num_threads(max(2, before))
        many = run_fp32(p0, gs, "auto")
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, many, strict=True):
        assert_bitwise(a, b, "1 thread vs many")


@pytest.mark.parametrize("variant", ["fp32", "split"])
@pytest.mark.parametrize("n", [0, 1, 7, 16, 33])
def test_a_call_touches_exactly_its_elements(isa: str, variant: str, n: int) -> None:
    """The kernel updates views into larger buffers (the optimizer's slices of a unit): it must
    write exactly their n elements, as the reference does, and nothing beside them. n = 0 (an
    empty unit) leaves everything as it was."""
    total, at = n + 64, 29  # the view [at, at + n) with neighbours on both sides
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(total, generator=gen)
    master = torch.randn(total, generator=gen)
    bufs = {"m": torch.rand(total, generator=gen), "v": torch.rand(total, generator=gen)}
    if variant == "fp32":
        bufs["p"] = master.clone()
    else:
        bufs["hi"] = torch.empty(total, dtype=torch.bfloat16)
        bufs["lo"] = torch.empty(total, dtype=torch.int16)
        split_(master, bufs["hi"], bufs["lo"])
    ref = {k: t.clone() for k, t in bufs.items()}
    view = {k: t[at : at + n] for k, t in bufs.items()}
    rview = {k: t[at : at + n] for k, t in ref.items()}
    gv = g[at : at + n]
    if variant == "fp32":
        native.adamw_fp32_(view["p"], gv, view["m"], view["v"], hyper(2), isa=isa)
        ieee_reference_(rview["p"], gv, rview["m"], rview["v"], hyper(2))
    else:
        native.adamw_split_(view["hi"], view["lo"], gv, view["m"], view["v"], hyper(2), isa=isa)
        p = join(rview["hi"], rview["lo"])
        ieee_reference_(p, gv, rview["m"], rview["v"], hyper(2))
        split_(p, rview["hi"], rview["lo"])
    for k in bufs:
        a, b = bufs[k].view(torch.int16 if bufs[k].dtype != torch.float32 else torch.int32), ref[k]
        assert torch.equal(a, b.view(a.dtype)), (
            f"{k}: the call wrote outside, or not all of, its {n} elements"
        )


def test_bad_arguments_are_named() -> None:
    n, h = 8, hyper(1)
    p, g, m, v = (torch.zeros(n) for _ in range(4))
    with pytest.raises(RuntimeError, match="g must be Float"):
        native.adamw_fp32_(p, g.double(), m, v, h)
    with pytest.raises(RuntimeError, match="m must be contiguous"):
        native.adamw_fp32_(p, g, torch.zeros(2 * n)[::2], v, h)
    with pytest.raises(RuntimeError, match="v has 7 elements, expected 8"):
        native.adamw_fp32_(p, g, m, v[:7], h)
    with pytest.raises(RuntimeError, match="hi must be BFloat16"):
        native.adamw_split_(p, torch.zeros(n, dtype=torch.int16), g, m, v, h)
    with pytest.raises(RuntimeError, match="step is 1-based"):
        native.adamw_fp32_(p, g, m, v, hyper(0))
    with pytest.raises(RuntimeError, match="unknown isa 'sse9'"):
        native.adamw_fp32_(p, g, m, v, h, isa="sse9")


def test_unavailable_kernel_reports_why(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(native, "KERNEL_DIR", tmp_path)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_reason", None)
    assert native.available() is False
    assert "kernel source missing" in native.reason()
    with pytest.raises(RuntimeError, match="unavailable: kernel source missing"):
        native.adamw_fp32_(*(torch.zeros(1) for _ in range(4)), hyper(1))


def test_build_error_reason_is_the_compiler_error() -> None:
    log = (
        "Error building extension 'x': [1/2] c++ -c adamw.cpp\nadamw.cpp:3:1: error: 'foo' was not declared\n"
    )
    assert native._first_line(log) == "adamw.cpp:3:1: error: 'foo' was not declared"


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("variant", ["fp32", "split"])
def test_bf16_gradients_equal_their_fp32_upcast(variant, isa):
    """engine.grad_dtype bfloat16: the kernel reads bf16 gradients itself, exactly as if upcast."""
    if isa not in native.isas():
        pytest.skip(f"{isa} not supported on this CPU")
    n = 70_001
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(n, generator=gen)
    g16 = torch.randn(n, generator=gen).to(torch.bfloat16)
    h = AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3, grad_scale=0.37)
    states = []
    for g in (g16, g16.float()):
        m, v = (
            torch.rand(n, generator=torch.Generator().manual_seed(4)),
            torch.rand(n, generator=torch.Generator().manual_seed(5)),
        )
        if variant == "fp32":
            p = master.clone()
            native.adamw_fp32_(p, g, m, v, h, isa=isa)
            states.append((p, m, v))
        else:
            hi, lo = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
            split_(master, hi, lo)
            native.adamw_split_(hi, lo, g, m, v, h, isa=isa)
            states.append((join(hi, lo), m, v))
    for a, b in zip(*states, strict=True):
        assert torch.equal(a, b)
