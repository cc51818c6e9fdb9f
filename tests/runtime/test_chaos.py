"""The chaos transport (engine.link_chaos): the engine's schedules under it equal the plain CPU
transport bitwise, and a run with one of the engine's waits removed does not.

Under chaos every copy runs on a thread of its own after a random delay, ordered only by the
events the engine records (runtime/chaos.py); fresh device buffers hold NaN. So an ordering bug
that CUDA would show as a race shows here as different numbers."""

from __future__ import annotations

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, LoraConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.errors import HorizonError
from horizon_cli.runtime.chaos import ChaosTransport
from tests.support.oracle import engine_weights, make_store, micro_batches, one_thread, random_rows  # noqa: F401

HP = dict(lr=3e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, grad_clip=0.5)


def data(vocab: int, steps: int = 3, batch: int = 4, micro: int = 2, hi: int = 24):
    rows = random_rows(steps * batch, vocab, seed=5, hi=hi)
    return [micro_batches(rows[s * batch : (s + 1) * batch], micro) for s in range(steps)]


def train(
    store, chaos: bool, steps, lora=None, optim: dict | None = None, **engine
) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = EngineConfig(device="cpu", dtype="float32", loss_chunk=16, link_chaos=chaos, **engine)
    eng = Engine(store, cfg, OptimConfig(kernel="torch", **{**HP, **(optim or {})}), lora=lora)
    assert isinstance(eng.t, ChaosTransport) == chaos
    try:
        losses = [eng.step(mbs, HP["lr"]).loss for mbs in steps]
        eng.wait()
        return losses, engine_weights(eng)
    finally:
        eng.close()


def assert_same(a, b) -> None:
    assert a[0] == b[0], (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name, w in a[1].items():
        assert torch.equal(w, b[1][name]), name


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Four layers: each of the gradient ring's two buffers is reused within a step."""
    return make_store(tmp_path_factory.mktemp("chaos"), "llama", False, num_hidden_layers=4)


@pytest.mark.parametrize("prefetch", [1, 2, 3])
@pytest.mark.parametrize("keep", [0, "auto"])
def test_sft_steps_equal_the_plain_transport(llama, prefetch, keep):
    model, store = llama
    steps = data(model.config.vocab_size)
    plain = train(store, False, steps, prefetch=prefetch, keep_activations=keep)
    assert_same(train(store, True, steps, prefetch=prefetch, keep_activations=keep), plain)


def test_sequence_tiles_equal_the_plain_transport(llama):
    model, store = llama
    steps = data(model.config.vocab_size, steps=2)
    plain = train(store, False, steps, seq_tile=8, keep_activations=0)
    assert_same(train(store, True, steps, seq_tile=8, keep_activations=0), plain)


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_gradient_release_in_chunks_equals_the_plain_transport(llama, monkeypatch, clip):
    """optim.grad_release in small chunks (128-element slices, 3 to a chunk): each chunk's copy
    waits on its buffer's last AdamW on the copy thread, each AdamW on its chunk's landing; with
    grad_clip > 0 the norm-first pass first."""
    from horizon_cli.state import pool, slices

    monkeypatch.setattr(slices, "SLICE", 128)
    monkeypatch.setattr(pool, "RELEASE_CHUNK", 3 * 128)
    model, store = llama
    steps = data(model.config.vocab_size, steps=2)
    optim = dict(grad_release="true", grad_clip=clip)
    plain = train(store, False, steps, optim=optim, prefetch=2, keep_activations=0)
    assert_same(train(store, True, steps, optim=optim, prefetch=2, keep_activations=0), plain)


def test_lora_steps_equal_the_plain_transport(tmp_path):
    from horizon_cli.lora.setup import lora_setup

    model, store = make_store(tmp_path, "qwen2", True)
    steps = data(model.config.vocab_size, steps=2)
    lora = LoraConfig(r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])
    plain = train(store, False, steps, lora=lora_setup(lora, store.arch))
    assert_same(train(store, True, steps, lora=lora_setup(lora, store.arch)), plain)


def generate(store, chaos: bool, host: bool) -> list[list[int]]:
    from horizon_cli.generate.decoder import Decoder
    from horizon_cli.model.sample import Sampler

    cfg = EngineConfig(device="cpu", dtype="float32", link_chaos=chaos)
    eng = Engine(store, cfg, OptimConfig(kernel="torch"), forward_only=True)
    g = torch.Generator().manual_seed(3)
    items = [(i, torch.randint(3, 90, (n,), generator=g).tolist()) for i, n in enumerate((3, 11, 7, 14, 5))]
    try:
        eos = list(range(3, 15))  # an eighth of the vocabulary: rows end at different times
        dec = Decoder(eng, Sampler(temperature=1.0, seed=4), max_new_tokens=9, eos_ids=eos, host_kv=host)
        return [c.ids for c in dec.run(items)]
    finally:
        eng.close()


@pytest.mark.parametrize("host", [False, True])
def test_generation_equals_the_plain_transport(llama, host):
    """Sampled rows that end at different times (an EOS id), the KV cache on the device or
    written back to the host between sweeps."""
    _, store = llama
    plain = generate(store, False, host=False)
    assert len({len(r) for r in plain}) > 1  # rows end at different times
    assert generate(store, True, host=host) == plain


class NoWait:
    """A transport whose `wait` does nothing: stands in for one part's transport to remove its waits."""

    def __init__(self, t):
        self._t = t

    def wait(self, ev) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._t, name)


def without_waits(cls, method: str):
    """cls.method with its transport's `wait` calls removed (each other call goes through)."""
    orig = getattr(cls, method)

    def patched(self, *args, **kw):
        t, self.t = self.t, NoWait(self.t)
        try:
            return orig(self, *args, **kw)
        finally:
            self.t = t

    return patched


@pytest.mark.parametrize(
    "where",
    [
        ("horizon_cli.runtime.loader", "Loader", "acquire"),  # compute before the weights land
        ("horizon_cli.engine.grads", "GradSums", "buffer"),  # zeroed before its last D2H read it
    ],
)
def test_a_missing_wait_gives_other_numbers(llama, monkeypatch, where):
    """One of the engine's waits removed: under chaos the numbers differ from the plain run's."""
    import importlib

    cls = getattr(importlib.import_module(where[0]), where[1])
    model, store = llama
    steps = data(model.config.vocab_size, steps=2)
    plain = train(store, False, steps, prefetch=1)
    monkeypatch.setattr(cls, where[2], without_waits(cls, where[2]))
    losses, weights = train(store, True, steps, prefetch=1)
    assert losses != plain[0] or any(not torch.equal(w, plain[1][n]) for n, w in weights.items())


def test_releasing_a_host_buffer_under_a_copy_raises():
    t = ChaosTransport(seed=1, scale=20.0)
    host, dev = torch.ones(1000), t.device_empty(1000, torch.float32)
    assert torch.isnan(dev).all()  # a fresh device buffer is garbage until a copy fills it
    ev = t.d2h([(host, dev)])
    with pytest.raises(HorizonError, match="released while a copy still uses it"):
        t.host_release(host)
    ev.host_wait()
    t.host_release(host)  # the copy has landed: fine
    t.close()


def grpo(tmp_path, store, name: str, chaos: bool) -> tuple[list, dict[str, bytes]]:
    """Three GRPO steps of `horizon train` (sampled rollouts on the host KV cache, the reference
    pass, two iterations per batch): the metrics, rollouts and checkpoint files."""
    from rich.console import Console

    from horizon_cli.train import run_training
    from horizon_cli.train.metrics import read_metrics
    from tests.conftest import write_config, write_jsonl

    g = torch.Generator().manual_seed(11)
    rows = [{"prompt_input_ids": torch.randint(3, 400, (6,), generator=g).tolist()} for _ in range(8)]
    rl = {"num_generations": 4, "max_completion_length": 6, "num_iterations": 2, "beta": 0.04,
          "temperature": 0.9, "rewards": [{"function": "length", "target": 4}]}  # fmt: skip
    cfg = write_config(tmp_path / f"{name}.yaml", store, write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / name,
                       rl=rl, train={"steps": 3, "batch_size": 2, "micro_batch_size": 4, "seed": 2},
                       engine={"device": "cpu", "dtype": "float32", "link_chaos": chaos, "kv_cache": "host"},
                       output={"save_every": 3, "keep_last": 1})  # fmt: skip
    threads = torch.get_num_threads()
    try:
        run_training(cfg, [], console=Console(quiet=True))
    finally:
        torch.set_num_threads(threads)
    run = tmp_path / name
    files = {
        str(f.relative_to(run)): f.read_bytes()
        for f in sorted(run.rglob("*"))
        if f.suffix in (".bin", ".jsonl")
    }
    return [(r["loss"], r["reward"]) for r in read_metrics(run / "metrics.jsonl")], files


def test_grpo_rollouts_and_steps_equal_the_plain_transport(tmp_path, tiny_store):
    plain = grpo(tmp_path, tiny_store, "plain", False)
    chaos = grpo(tmp_path, tiny_store, "chaos", True)
    assert plain[0] == chaos[0] and len(plain[0]) == 3
    rollouts = [k for k in plain[1] if k.startswith("rollouts")]
    assert rollouts and all(plain[1][k] == chaos[1][k] for k in rollouts)
    ckpt = [k for k in plain[1] if k.endswith(".bin")]
    assert ckpt and all(plain[1][k] == chaos[1][k] for k in ckpt)


@pytest.mark.parametrize(
    "over,says",
    [
        (
            ["engine.device=cuda"],
            "engine.link_chaos: is a CPU transport; it needs engine.device: cpu (or auto)",
        ),
        (
            ["engine.link_gbps=10"],
            "engine.link_chaos: its copies have random delays; leave engine.link_gbps at 0",
        ),
    ],
)
def test_chaos_with_a_gpu_or_an_emulated_link_is_refused(over, says):
    import re

    from horizon_cli.config.load import load_config
    from horizon_cli.errors import InputError

    def base():
        return {
            "model": {"path": "m"},
            "data": {"path": "d.jsonl"},
            "output": {"dir": "o"},
            "engine": {"link_chaos": True},
        }

    with pytest.raises(InputError, match=re.escape(says)):
        load_config(None, over, base=base())
    assert load_config(None, [], base=base()).engine.link_chaos is True
