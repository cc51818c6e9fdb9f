"""LoRA in the engine against PEFT: 20 optimizer steps of the streamed engine with adapters against
peft + transformers + torch.optim.AdamW from the same initial adapters (loss and adapter weights
within 1e-5 relative), the frozen base bitwise unchanged; PEFT's target_modules rules; lora.init
read strictly."""

from __future__ import annotations

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, LoraConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.errors import InputError
from horizon_cli.lora.setup import lora_setup
from horizon_cli.lora.targets import resolve_targets
from tests.support.oracle import DEVICE, hf_train_hp, make_store, micro_batches, random_rows, rel_err

peft = pytest.importorskip("peft")

STEPS = 20
HP = dict(lr=3e-4, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, grad_clip=0.15)


def peft_model(model, targets, rslora=False, r=4, alpha=8, seed=1):
    """PEFT's LoRA with random A *and* B (init_lora_weights=False), so every adapter moves from
    the first step."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=0.0,
        use_rslora=rslora,
        init_lora_weights=False,
    )
    return peft.get_peft_model(model, cfg)


def lora_engine(store, init_dir, targets, rslora=False, dtype="float32", **over) -> Engine:
    cfg = LoraConfig(r=4, alpha=8, targets=targets, use_rslora=rslora, init=str(init_dir), **over)
    return Engine(
        store,
        EngineConfig(device=DEVICE, dtype=dtype, loss_chunk=16),
        OptimConfig(kernel="torch", **HP),
        lora=lora_setup(cfg, store.arch),
    )


def batches(vocab, steps=STEPS, batch=4, micro=2):
    rows = random_rows(steps * batch, vocab)
    return [micro_batches(rows[s * batch : (s + 1) * batch], micro) for s in range(steps)]


def check_against_peft(tmp_path, family, targets, rslora, steps=STEPS, quantize=""):
    model, store = make_store(tmp_path, family, False, quantize=quantize)
    if quantize:  # PEFT's base: the store's dequantized weights, exactly as the engine computes with
        load_dequantized(model, store)
    pm = peft_model(model, targets, rslora)
    pm.save_pretrained(tmp_path / "init")
    data = batches(model.config.vocab_size, steps)
    base = {
        u: st.stream.clone()
        for u, st in lora_engine(store, tmp_path / "init", targets, rslora).base.units.items()
    }
    eng = lora_engine(store, tmp_path / "init", targets, rslora)
    try:
        res = [eng.step(mbs, HP["lr"]) for mbs in data]
        eng.wait()
        ref = hf_train_hp(pm, data, HP)
        assert any(r.grad_norm > HP["grad_clip"] for r in res), "clipping must be exercised"
        for r, l_ref in zip(res, ref, strict=True):
            assert abs(r.loss - l_ref) / l_ref < 1e-5
        ours, theirs = eng.host.tensors(), peft.get_peft_model_state_dict(pm)
        assert set(ours) == set(theirs)
        for k in theirs:
            assert rel_err(ours[k], theirs[k]) < 1e-5, k
        for u, st in eng.base.units.items():  # the base never changes
            assert torch.equal(st.stream, base[u]), u
        assert all(r.weight_loads == 2 * store.arch.n_layers for r in res)
    finally:
        eng.close()


def load_dequantized(model, store) -> None:
    """The model's weights := the store's, NF4 layers dequantized as the engine does."""
    from horizon_cli.state.frozen import FrozenState

    base = FrozenState(store, store.dtype, lambda n, dt: torch.empty(n, dtype=dt))
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for u, st in base.units.items():
            dense = torch.zeros(st.layout.numel, dtype=store.dtype)
            views = base.dequantize(u, st.stream, dense) if st.packed else st.views(st.stream)
            for p in st.layout.tensors:
                tensors[p.hf].copy_(views[p.name])


@pytest.mark.parametrize(
    "family,targets,rslora,steps",
    [
        ("llama", ["q_proj", "v_proj"], False, STEPS),
        ("llama", "all-linear", True, STEPS),
        ("qwen3_moe", ["q_proj", "o_proj"], False, 5),  # the generic path: hooks on transformers' modules
    ],
)
def test_lora_steps_match_peft(tmp_path, family, targets, rslora, steps):
    check_against_peft(tmp_path, family, targets, rslora, steps)


@pytest.mark.parametrize(
    "family,targets", [("llama", ["q_proj", "v_proj", "down_proj"]), ("qwen3_moe", ["q_proj", "o_proj"])]
)
def test_lora_on_an_nf4_base_matches_peft_on_the_dequantized_base(tmp_path, family, targets):
    """Every expert of a MoE layer is a tensor of its own on disk: each is quantized by itself."""
    check_against_peft(tmp_path, family, targets, False, steps=6, quantize="nf4")


@pytest.mark.parametrize(
    "family,targets",
    [
        ("llama", ["q_proj", "v_proj"]),
        ("llama", ["layers.1.self_attn.k_proj", "up_proj"]),  # suffixes with dots
        ("llama", ["proj", "q_proj"]),  # a suffix matches after a dot only: "proj" matches nothing
        ("llama", r"model\.layers\.0\.self_attn\.(q|v)_proj"),  # a regex string: whole name
        ("llama", "all-linear"),
        ("qwen2", ["model.layers.0.mlp.down_proj"]),  # an exact full name
        ("gemma2", "all-linear"),
        ("qwen3_moe", ".*(q|k)_proj"),
    ],
)
def test_targets_follow_peft(family, targets):
    from horizon_cli.arch import spec_from_hf
    from tests.support.tiny import make_model

    model = make_model(family)
    cfg = model.config.to_dict()
    spec = spec_from_hf(cfg)
    ours = sorted(t.module for layer in resolve_targets(targets, spec) for t in layer)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets))
    assert ours == sorted(pm.targeted_module_names)


@pytest.mark.parametrize(
    "targets,says",
    [
        (["mlp"], "not a linear layer"),
        ("lm_head", "LM head"),
        (["nothing_here"], "matches no module"),
        ("mlp", "no module"),
    ],
)
def test_targets_that_peft_would_refuse(targets, says):
    from horizon_cli.arch import spec_from_hf
    from tests.support.tiny import BASE

    spec = spec_from_hf({**BASE, "model_type": "llama"})
    with pytest.raises(InputError, match=says):
        resolve_targets(targets, spec)


def test_lora_init_is_read_strictly(tmp_path):
    """PEFT loads adapters with strict=False: a missing or an extra key passes silently there."""
    from safetensors.torch import load_file, save_file

    model, store = make_store(tmp_path, "llama", False)
    peft_model(model, ["q_proj", "v_proj"]).save_pretrained(tmp_path / "a")
    cfg = LoraConfig(r=4, alpha=8, targets=["q_proj", "v_proj"], init=str(tmp_path / "a"))
    lora_setup(cfg, store.arch)  # as saved: accepted
    path = tmp_path / "a" / "adapter_model.safetensors"
    sd = load_file(str(path))
    k = next(iter(sd))
    save_file({**sd, k.replace("layers.0", "layers.7"): sd[k].clone()}, str(path))
    with pytest.raises(InputError, match="unexpected tensor .*layers.7"):
        lora_setup(cfg, store.arch)
    save_file({kk: v for kk, v in sd.items() if kk != k}, str(path))
    with pytest.raises(InputError, match="is missing"):
        lora_setup(cfg, store.arch)
    save_file(sd, str(path))
    with pytest.raises(InputError, match="lora.r 8"):
        lora_setup(
            LoraConfig(r=8, alpha=8, targets=["q_proj", "v_proj"], init=str(tmp_path / "a")), store.arch
        )
    with pytest.raises(InputError, match="is missing"):  # the config's targets decide, not the file's
        lora_setup(LoraConfig(r=4, alpha=8, targets="all-linear", init=str(tmp_path / "a")), store.arch)


def test_dropout_masks_are_the_same_in_the_recompute(tmp_path):
    """With dropout the step's gradient equals autograd through a resident layer stack that draws
    the same masks (the recompute must not draw new ones)."""
    from horizon_cli.lora import linear as adapters

    model, store = make_store(tmp_path, "llama", False)
    peft_model(model, ["q_proj", "v_proj"]).save_pretrained(tmp_path / "init")
    mbs = micro_batches(random_rows(4, model.config.vocab_size), 2)
    grads = {}
    for drop in (0.0, 0.3):
        eng = lora_engine(store, tmp_path / "init", ["q_proj", "v_proj"], dropout=drop)
        try:
            calls = []
            real = adapters.LayerLora._dropout

            def spy(self, name, x, real=real, calls=calls):
                out = real(self, name, x)
                calls.append((self.seed, self.mb, name, out.detach().clone()))
                return out

            adapters.LayerLora._dropout = spy
            try:
                eng.step(mbs, 0.0)
            finally:
                adapters.LayerLora._dropout = real
            eng.wait()
            grads[drop] = {u: st.grad.clone() for u, st in eng.host.units.items()}
        finally:
            eng.close()
        # each (layer seed, micro-batch, module) drew its mask twice: forward and recompute, the same
        seen: dict = {}
        for seed, mb, name, out in calls:
            seen.setdefault((seed, mb, name), []).append(out)
        assert seen and all(len(v) == 2 and torch.equal(v[0], v[1]) for v in seen.values())
        if drop:
            assert any((v[0] == 0).float().mean() > 0.2 for v in seen.values())
    assert any(not torch.equal(grads[0.0][u], grads[0.3][u]) for u in grads[0.0])


def test_dropout_scales_what_it_keeps_as_torch_dropout_does():
    """PEFT's lora_dropout is nn.Dropout: an input is zeroed with probability p and the kept ones
    are scaled by 1 / (1 - p), so the adapter's expected input is x. The recompute test above only
    compares the engine with itself; here each kept element must equal torch's own scaling of it."""
    from horizon_cli.lora.linear import LayerLora

    p = 0.3
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0))
    ab = {"wq": (torch.zeros(2, 32), torch.zeros(32, 2))}
    out = LayerLora(ab, scaling=1.0, dropout=p, seed=5)._dropout("wq", x)
    kept = out != 0
    assert 0.6 < kept.float().mean() < 0.8  # about 1 - p kept
    torch_scale = torch.nn.functional.dropout(torch.ones(64), p, training=True).max()  # 1 / (1 - p)
    torch.testing.assert_close(out[kept], x[kept] * torch_scale)
    assert torch.equal(LayerLora(ab, scaling=1.0, dropout=p, seed=None)._dropout("wq", x), x)  # evaluation


def test_lora_on_the_cuda_transport_equals_the_cpu_one(tmp_path, quantize="nf4"):
    """The CUDA transport's logic through the fake CUDA (tests/support/fake_cuda.py): adapters riding with
    their layer's load and NF4 layers dequantized on the compute stream, in stream order, bitwise
    as on the CPU."""
    from tests.runtime import test_cuda_transport as tc
    from tests.support.fake_cuda import FakeCuda

    model, store = make_store(
        tmp_path, "llama", True, dtype="bfloat16", quantize=quantize, num_hidden_layers=3
    )
    peft_model(model, ["q_proj", "v_proj", "up_proj"]).save_pretrained(tmp_path / "init")
    rows = random_rows(12, model.config.vocab_size, seed=3)

    def run(transport):
        eng = Engine(
            store,
            EngineConfig(device="cpu", dtype="bfloat16", loss_chunk=16),
            OptimConfig(kernel="torch", **HP),
            transport=transport,
            lora=lora_setup(
                LoraConfig(
                    r=4, alpha=8, targets=["q_proj", "v_proj", "up_proj"], init=str(tmp_path / "init")
                ),
                store.arch,
            ),
        )
        try:
            losses = [eng.step(micro_batches(rows[4 * s : 4 * s + 4], 2), 1e-3).loss for s in range(2)]
            logits = eng.logits(micro_batches(rows[-2:], 2)[0])
            eng.wait()
            return losses, logits, eng.host.tensors()
        finally:
            eng.close()

    fake = FakeCuda(index=1)
    with fake.watching():
        got = run(tc.cuda(fake))
    want = run(None)
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][k], want[2][k]) for k in want[2])
    assert fake.problems == []
    assert fake.registrations > 0 and not fake.registered
