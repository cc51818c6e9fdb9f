"""Dropout and router noise trained as transformers trains them (engine/dropout.py).

The oracle is transformers' own model in train mode with its generators seeded as horizon seeds
them: before the owner's forward (the embedding's dropout and the first layer share call 0's
seed) and before each later layer, from (seed, step, call, micro-batch). Under the same masks the
loss and every gradient equal transformers'; the backward recompute draws the forward's masks bit
for bit; forward-only passes run with dropout off; `model.dropout: 0` is a store without dropout.
"""

import pytest
import torch
import transformers

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.convert import convert
from horizon_cli.engine import Engine
from horizon_cli.engine.dropout import SeededDropout, call_seed
from horizon_cli.store import Store
from tests.support.oracle import (
    DEVICE,
    check_grads,
    engine_grads,
    engine_weights,
    hf_batch_loss,
    label_ce_sum,
    micro_batches,
    one_thread,  # noqa: F401 (autouse fixture: tiny models on one thread)
    random_rows,
    rel_err,
)
from tests.support.tiny import make_model, save

SEED = 7
# transformers' reference draws from the CPU generator: its masks are the engine's on the CPU only
# (on a GPU, scripts/gpu_check.sh, the other tests check the CUDA generator's masks)
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="transformers' reference runs on the CPU")
DIMS = dict(vocab_size=96, num_hidden_layers=2, num_attention_heads=4)


def gpt2(**over):
    """transformers' default GPT-2 config (attn / resid / embd_pdrop 0.1, summary_first_dropout
    0.1), tiny."""
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, **over)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).float().eval()


def phi(**over):
    """Phi-2's dropout (resid_pdrop 0.1), the embedding's and the attention's on too."""
    kw = dict(
        DIMS, hidden_size=32, intermediate_size=64, resid_pdrop=0.1, embd_pdrop=0.1, attention_dropout=0.1
    )
    cfg = transformers.PhiConfig(**{**kw, **over})
    torch.manual_seed(0)
    return transformers.PhiForCausalLM(cfg).float().eval()


def seed_oss(**over):
    """SeedOssConfig's defaults: residual_dropout and attention_dropout 0.1."""
    kw = dict(DIMS, hidden_size=32, intermediate_size=64, num_key_value_heads=2, head_dim=8)
    cfg = transformers.SeedOssConfig(**{**kw, **over})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


MODELS = {
    "gpt2": gpt2,
    "phi": phi,
    "seed_oss": seed_oss,
    "llama-native": lambda **o: make_model("llama", attention_dropout=0.2, **o),
    "mixtral-jitter": lambda **o: make_model("mixtral", router_jitter_noise=0.2, **o),
}


def store_of(model, tmp, name="store"):
    save(model, tmp / f"{name}-hf")
    convert(tmp / f"{name}-hf", tmp / name, dtype="float32")
    return Store.open(tmp / name)


def engine(store, seed: int | None = SEED, keep: int = 0, tile: int = 0) -> Engine:
    return Engine(
        store,
        EngineConfig(device=DEVICE, dtype="float32", loss_chunk=16, keep_activations=keep, seq_tile=tile),
        OptimConfig(kernel="torch", lr=1e-3, grad_clip=0.0), dropout_seed=seed,
    )  # fmt: skip


def batch(model, n=4, micro=2, seed=1):
    return micro_batches(random_rows(n, model.config.vocab_size, seed=seed, lo=10, hi=24), micro)


def seeded_hooks(model, seed: int, step: int, mb: list[int]):
    """transformers' model seeded as engine.dropout seeds each call: the owner's forward (its
    embedding dropout, then layer 0) with call 0's seed, each later layer with its own."""
    owner = model.base_model
    layers = list(model.base_model.h if hasattr(model.base_model, "h") else model.base_model.layers)

    def at(call):
        return lambda *_: torch.manual_seed(call_seed(seed, step, call, mb[0])) and None

    hooks = [owner.register_forward_pre_hook(at(0))]
    hooks += [la.register_forward_pre_hook(at(j)) for j, la in enumerate(layers) if j > 0]
    return hooks


def hf_backward(model, mbs, seed=SEED, step=0, inner=None) -> float:
    """Summed CE over the batch's label tokens / their count, in train mode under horizon's masks
    (inner: the transformers model inside `model`, a PEFT model)."""
    n = sum(mb.label_tokens for mb in mbs)
    mb_index = [0]
    hooks = seeded_hooks(inner or model, seed, step, mb_index)
    model.train()
    total = 0.0
    try:
        for m, mb in enumerate(mbs):
            mb_index[0] = m
            loss = label_ce_sum(model(input_ids=mb.input_ids).logits, mb.labels)
            (loss / n).backward()
            total += loss.item()
    finally:
        model.eval()
        for h in hooks:
            h.remove()
    return total / n


@cpu_only
@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_equal_transformers_under_the_same_masks(tmp_path, name):
    model = MODELS[name]()
    store = store_of(model, tmp_path)
    eng = engine(store)
    try:
        assert isinstance(eng.p.dropout, SeededDropout)
        mbs = batch(model)
        loss_sum, tokens, _ = eng.forward_backward(mbs)
        eng.t.synchronize()
        model.zero_grad()
        ref = hf_backward(model, mbs)
        assert abs(loss_sum / tokens - ref) / ref < 1e-5
        check_grads(eng, model, 1e-5)
        # the masks matter: without them (eval mode) the gradients are others
        model.zero_grad()
        hf_eval(model, mbs, backward=True)
        ours = engine_grads(eng)
        assert max(rel_err(ours[k], p.grad) for k, p in model.named_parameters()) > 1e-2
    finally:
        eng.close()


def hf_eval(model, mbs, backward=False) -> float:
    """The same loss in eval mode (dropout off)."""
    return hf_batch_loss(model, mbs, backward=backward)


@cpu_only
def test_lora_on_a_dropping_base_equals_peft_under_the_same_masks(tmp_path):
    """LoRA adapters on Phi with its dropout on: the adapters' gradients equal PEFT's (its model in
    train mode, seeded the same way); the base's dropout and LoRA's own draw apart."""
    peft = pytest.importorskip("peft")
    from horizon_cli.config.schema import LoraConfig
    from horizon_cli.lora.setup import lora_setup

    model = phi()
    store = store_of(model, tmp_path)
    targets = ["q_proj", "dense", "fc1"]
    torch.manual_seed(1)
    pm = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    )
    pm.save_pretrained(tmp_path / "init")
    cfg = LoraConfig(r=4, alpha=8, targets=targets, init=str(tmp_path / "init"))
    eng = Engine(
        store, EngineConfig(device=DEVICE, dtype="float32", loss_chunk=16), OptimConfig(kernel="torch"),
        lora=lora_setup(cfg, store.arch, seed=SEED), dropout_seed=SEED,
    )  # fmt: skip
    try:
        mbs = batch(model)
        loss_sum, tokens, _ = eng.forward_backward(mbs)
        ref = hf_backward(pm, mbs, inner=pm.get_base_model())
        assert abs(loss_sum / tokens - ref) / ref < 1e-5
        ours = engine_grads(eng)
        theirs = {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if p.requires_grad}
        assert set(ours) == set(theirs)
        for k, g in theirs.items():
            assert rel_err(ours[k], g) < 1e-5, k
    finally:
        eng.close()


@pytest.mark.parametrize("name", ["gpt2", "llama-native"])
def test_recompute_draws_the_forward_masks_bitwise(tmp_path, name):
    """Each call's output in the backward recompute equals its forward's, bit for bit, and a kept
    layer (its graph held, not recomputed) gives the recomputed run's gradients bit for bit."""
    model = MODELS[name]()
    store = store_of(model, tmp_path)
    eng = engine(store)
    seen: dict[str, list[torch.Tensor]] = {"fwd": [], "bwd": []}
    tmpl = eng.p.tmpl
    fwd, obj = tmpl.forward, tmpl.objective

    def forward(*a, **k):
        y = fwd(*a, **k)
        if not torch.is_grad_enabled():  # the forward sweep's (native: the recompute calls it too)
            seen["fwd"].append(y)
        return y

    def objective(*a, **k):
        y, extra = obj(*a, **k)
        seen["bwd"].append(y.detach().clone())
        return y, extra

    tmpl.forward, tmpl.objective = forward, objective
    mbs = batch(model)
    try:
        eng.forward_backward(mbs)
        recomputed = {k: v.clone() for k, v in engine_grads(eng).items()}
    finally:
        eng.close()
    n = len(mbs)
    assert len(seen["fwd"]) == len(seen["bwd"]) == 2 * n
    for j in range(2):  # the backward visits the layers from the top
        for m in range(n):
            assert torch.equal(seen["fwd"][j * n + m], seen["bwd"][(1 - j) * n + m]), (j, m)
    kept = engine(store, keep=1)
    try:
        assert kept.kept_layers == 1
        kept.forward_backward(mbs)
        for k, g in engine_grads(kept).items():
            assert torch.equal(g, recomputed[k]), k
    finally:
        kept.close()


def train(store, data, seed=SEED) -> dict[str, torch.Tensor]:
    eng = engine(store, seed)
    try:
        for mbs in data:
            eng.step(mbs, 1e-3)
        eng.wait()
        return engine_weights(eng)
    finally:
        eng.close()


def test_the_same_seed_trains_the_same_model(tmp_path):
    model = gpt2()
    store = store_of(model, tmp_path)
    data = [batch(model, seed=s) for s in (1, 2)]
    a, b, other = train(store, data), train(store, data), train(store, data, seed=SEED + 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], other[k]) for k in a)  # the seed draws the masks


def test_dropout_off_is_a_store_without_dropout(tmp_path):
    """model.dropout: 0 (dropout_seed None) trains a dropping store as the same model converted
    with every dropout at 0, bit for bit; a store without dropout is untouched by the seed."""
    off = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "summary_first_dropout": 0.0}
    drop, zero = store_of(gpt2(), tmp_path, "drop"), store_of(gpt2(**off), tmp_path, "zero")
    model = gpt2()
    data = [batch(model, seed=s) for s in (1, 2)]
    a, b, c = train(drop, data, seed=None), train(zero, data), train(zero, data, seed=None)
    assert all(torch.equal(a[k], b[k]) and torch.equal(b[k], c[k]) for k in a)
    assert any(not torch.equal(a[k], v) for k, v in train(drop, data).items())


@cpu_only
def test_forward_only_passes_run_without_dropout(tmp_path):
    model = phi()
    store = store_of(model, tmp_path)
    mbs = batch(model)
    on, off = engine(store), engine(store, seed=None)
    try:
        a, b = on.eval_loss(mbs), off.eval_loss(mbs)
        assert a == b
        assert abs(a[0] / a[1] - hf_eval(model, mbs)) < 1e-5
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize(
    "over,seed",
    [([], 3), (["model.dropout=0"], None), (["preference.loss=dpo"], None), (["preference.loss=kto"], None)],
)
def test_which_runs_train_with_dropout(over, seed):
    """train.seed seeds the masks, but with model.dropout: 0 and in preference runs (TRL's DPO,
    KTO, CPO and ORPO trainers default to disable_dropout)."""
    from horizon_cli.config import load_config
    from horizon_cli.engine.build import dropout_seed

    base = {
        "model": {"path": "store"},
        "data": {"path": "d.jsonl"},
        "train": {"seed": 3},
        "output": {"dir": "run"},
    }
    assert dropout_seed(load_config(None, over, base=base)) == seed


@pytest.mark.parametrize("name", ["gpt2", "phi"])
def test_tiled_blocks_recompute_in_train_mode_with_the_forward_masks(tmp_path, name):
    """engine.seq_tile with the model's dropout on: each tile's checkpointed recompute runs in the
    backward, after the call's dropout scope has ended; it runs in train mode with its forward's
    generator state (torch's checkpoint checks that it saves what the forward saved, and raised
    before), a kept layer's gradients equal the recomputed ones bit for bit, and the masks act."""
    model = MODELS[name]()
    store = store_of(model, tmp_path)
    mbs = batch(model)
    grads = {}
    for tile, keep, seed in ((4, 0, SEED), (4, 2, SEED), (4, 0, None)):
        eng = engine(store, seed, keep=keep, tile=tile)
        try:
            assert eng.p.tmpl.seq_tile == tile and eng.kept_layers == keep
            eng.forward_backward(mbs)
            grads[keep, seed] = {k: v.clone() for k, v in engine_grads(eng).items()}
        finally:
            eng.close()
    for k, g in grads[2, SEED].items():
        assert torch.equal(g, grads[0, SEED][k]), k
    off = grads[0, None]
    assert max(rel_err(grads[0, SEED][k], off[k]) for k in off) > 1e-2
