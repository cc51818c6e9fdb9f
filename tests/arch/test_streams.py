"""Models whose layers pass several residual streams (hyper-connections): the tensor crossing
layers is (b, T, streams, H) or (b, T, streams * H), as the model's own code makes it; layer 0 takes
the embedding rows (b, T, H) and the owner's modules after the last layer merge the streams back.

Each type through convert -> steps of 2 micro-batches against transformers (micro-batched the
same way: hf_loss_backward) + torch AdamW: logits, losses, the squared gradient norm, every
gradient and the weights after the steps; and greedy generation against transformers' generate.
"""

import io

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from horizon_cli import api
from horizon_cli.convert import convert
from horizon_cli.errors import InputError
from horizon_cli.export import export
from horizon_cli.store import Store
from tests.engine.test_engine_training import batches, run_engine
from tests.support.census_config import build, tiny_config
from tests.support.oracle import (
    DEVICE,
    engine_grads,
    engine_weights,
    hf_loss_backward,
    hf_train,
    make_engine,
    micro_batches,
    one_thread,  # noqa: F401 (autouse fixture: tiny models on one thread)
    random_rows,
    rel_err,
)

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.0, grad_clip=0.0)


def _store(tmp_path, mt: str, layers: int, top: int = 0):
    model = build(mt, tiny_config(mt, layers)).float().eval()
    torch.manual_seed(1)
    for name, b in model.named_buffers():  # DeepSeek-V4's token -> expert table (zeros at init)
        if name.endswith("tid2eid"):
            b.copy_(torch.randint(0, top or model.config.n_routed_experts, b.shape))
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    return model, Store.open(tmp_path / "store")


CASES = [("hy_v4", 2, (1, 1, 4, 64)), ("qwen4_exp_text", 4, (1, 1, 256)), ("deepseek_v4", 3, (1, 1, 4, 64))]


@pytest.mark.parametrize("mt,layers,shape", CASES)
def test_streams_train_as_transformers(tmp_path, mt, layers, shape):
    model, store = _store(tmp_path, mt, layers)
    assert store.arch.boundary(1, 1) == shape  # what the probe recorded, not (b, T, hidden)
    eng = make_engine(store, **HP)
    try:
        rows = random_rows(4, model.config.vocab_size, seed=1, lo=10, hi=24)
        mbs = micro_batches(rows, 2)
        logits, ref = eng.logits(mbs[0]), model(input_ids=mbs[0].input_ids).logits.detach()
        for r, (ids, _) in enumerate(rows[:2]):
            assert rel_err(logits[r, : len(ids)], ref[r, : len(ids)]) < 1e-5
        loss_sum, tokens, _ = eng.forward_backward(mbs)
        eng.t.synchronize()
        model.zero_grad(set_to_none=True)
        assert abs(loss_sum / tokens - hf_loss_backward(model, mbs)) < 1e-5 * loss_sum / tokens
        grads = engine_grads(eng)
        for name, p in model.named_parameters():  # some get none (tensors the loss never reaches)
            assert rel_err(grads[name], p.grad) < 1e-5 if p.grad is not None else not grads[name].any(), name
        data = batches(model.config.vocab_size, micro=2, steps=2)
        ours = [r.loss for r in run_engine(eng, data, HP["lr"])]
        theirs = hf_train(model, data, HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"], HP["grad_clip"])
        for a, b in zip(ours, theirs, strict=True):
            assert abs(a - b) / b < 1e-5
        if mt == "deepseek_v4":  # step 1's gradients are transformers' (71 of 72 bitwise); its
            return  # zero-init hyper-connection biases get fp32-noise gradients (1e-11) that Adam's
            # eps-linear range turns into ~lr * noise / eps weights: transformers against itself
            # (4 rows vs 2 x 2) differs by 1.6e-4 there after 3 steps
        w = engine_weights(eng)
        for name, p in model.state_dict().items():
            assert rel_err(w[name], p) < 1e-5, name
    finally:
        eng.close()


def test_streams_generate_as_transformers(tmp_path, monkeypatch):
    """Greedy generation: the newest position of every stream goes through the merging modules;
    unequal prompts left-padded in micro-batches, the cache on the device and on the host."""
    from horizon_cli.model.sample import Sampler
    from tests.generate.test_generate import hf_greedy, loop, prompts, run

    monkeypatch.setattr(loop, "MICRO_TOKENS", 24)
    model, _ = _store(tmp_path, "hy_v4", 2)
    items = prompts(model.config.vocab_size, seed=3)
    want = [hf_greedy(model, ids, 8, []) for ids in items]
    for host in (False, True):
        assert run(Store.open(tmp_path / "store"), items, Sampler(), host=host, new=8) == want


def test_integer_buffers_travel_exactly(tmp_path):
    """DeepSeek-V4's frozen token -> expert table (int64) is held in the float units: convert
    refuses values no compute dtype holds exactly, export writes the table back as it was."""
    model, store = _store(tmp_path, "deepseek_v4", 3)
    out = io.StringIO()
    api.inspect(tmp_path / "store", console=Console(file=out, width=400))
    assert "residual streams between layers (b, T, 4, 64)" in out.getvalue(), out.getvalue()
    export(tmp_path / "store", tmp_path / "out")
    out = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        out.update(load_file(f))
    tables = {
        k: v for k, v in load_file(tmp_path / "hf" / "model.safetensors").items() if k.endswith("tid2eid")
    }
    assert tables and all(out[k].dtype == torch.int64 and out[k].equal(v) for k, v in tables.items())
    with pytest.raises(InputError, match=r"tid2eid: integer values beyond 256"):
        _store(tmp_path / "big", "deepseek_v4", 3, top=1000)
    assert not (tmp_path / "big" / "store").exists()  # nothing half-written


def test_streams_kept_and_lora_equal_recomputed(tmp_path):
    """The top layer kept (its graph over the streams held from forward to backward) gives the
    model of recomputing it bit for bit, full fine-tuning and LoRA alike."""
    from horizon_cli.config.schema import LoraConfig
    from horizon_cli.lora.setup import lora_setup
    from tests.engine.test_keep import assert_same, run

    _, store = _store(tmp_path, "hy_v4", 2)
    assert_same(run(store, "float32", 0), run(store, "float32", 1), "float32", DEVICE)

    def setup():
        return lora_setup(LoraConfig(r=4, alpha=8, targets="all-linear"), store.arch)

    assert_same(
        run(store, "float32", 0, lora=setup()), run(store, "float32", 1, lora=setup()), "float32", "cpu"
    )


def test_streams_merged_by_arithmetic_stay_refused(tmp_path):
    """Gemma 3n merges its AltUp streams after the last layer with arithmetic of its own forward
    (no module to run as the head's suffix): refused at convert, naming it, nothing written."""
    cfg = tiny_config("gemma3n_text", 4)
    cfg.num_kv_shared_layers = 0  # KV sharing is refused first (tests/model/test_side_inputs.py)
    build("gemma3n_text", cfg).save_pretrained(tmp_path / "hf")
    with pytest.raises(InputError, match=r"merges its residual streams \(4, b, T, 64\) after its last layer"):
        convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    assert not (tmp_path / "store").exists()
