"""Sequence tiles (engine.seq_tile, model.tiling): a layer's token-local block run tile by tile in
the forward and in the backward's recompute gives the untiled model — the same arithmetic per
token, so the forward and every gradient agree to fp32 rounding (1e-6), and so do three AdamW
steps — for the native layer and for transformers' own layers of every kind the structural rule
(arch.tiling) finds a block in: dense with sliding windows and its own norms around the MLP,
MoE with the load-balancing loss trained, multi-head latent attention, a hybrid of linear
attention and MoE, post-norm layers. Tiles that do not divide the tokens, tiles across rows and
across packed documents, and the two-pass DPO objective."""

from __future__ import annotations

import datasets
import pytest
import torch
import transformers

from horizon_cli.arch.tiling import blocks, untiled_kinds
from horizon_cli.config.schema import EngineConfig, OptimConfig, PreferenceConfig
from horizon_cli.convert import convert
from horizon_cli.data.batch import IGNORE, MicroBatch
from horizon_cli.data.pairs import collate_pairs
from horizon_cli.engine import Engine
from horizon_cli.recipes.preference.loss import PairObjective
from horizon_cli.store import Store
from tests.preference.test_pref_engine import RECORDS, pairs_of
from tests.support.oracle import (  # noqa: F401
    engine_grads,
    engine_weights,
    make_store,
    micro_batches,
    one_thread,
    random_rows,
)

TOL = 1e-6


_COUNT = [0]  # tilings of a block (model.tiling.tiles), counted by `tiled_runs`
_TILE = [0]  # the tile of the run `compare` is making (0: the untiled one)


def tiled_count() -> int:
    return _COUNT[0]


QWEN3_NEXT = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, output_router_logits=True,
    layer_types=["linear_attention", "full_attention"], pad_token_id=0,
)  # fmt: skip


def engine(store, tile: int, objective=None, lr: float = 1e-4, keep: int = 0) -> Engine:
    ecfg = EngineConfig(device="cpu", dtype="float32", loss_chunk=16, seq_tile=tile)
    return Engine(
        store, ecfg, OptimConfig(kernel="torch", lr=lr), objective=objective, keep=keep if tile else 0
    )


def batches(steps: int = 3) -> list[list[MicroBatch]]:
    """Rows of 20-40 tokens, two per micro-batch: 40-80 tokens a micro-batch, which tiles of 7
    never divide, and tiles that span the end of one row and the start of the next."""
    return [micro_batches(random_rows(4, 96, seed=s, lo=20, hi=40), 2) for s in range(steps)]


def close(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, relative: bool, floor: float = 1e-3
) -> None:
    """Every tensor within TOL: of its largest element (gradients: at least a thousandth of the
    model's largest (floor), whose rounding reaches a tensor with tiny gradients through dx), or
    absolutely (weights)."""
    assert a.keys() == b.keys()
    top = max(v.abs().max().item() for v in a.values())
    for k in a:
        scale = max(a[k].abs().max().item(), floor * top) if relative else 1.0
        assert (a[k] - b[k]).abs().max().item() <= TOL * scale, (
            what,
            k,
            (a[k] - b[k]).abs().max().item(),
            scale,
        )


@pytest.fixture(autouse=True)
def tiled_runs(monkeypatch):
    """Counts the blocks run tile by tile (so a test cannot pass untiled)."""
    from horizon_cli.model import tiling

    real = tiling.tiles

    def counted(*a, **k):
        _COUNT[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(tiling, "tiles", counted)


def compare(store, tile: int, steps=None, objective=None, keep: int = 0, floor: float = 1e-3) -> None:
    """The first step's gradients, its outputs (loss, norm, aux loss) and the weights after three
    AdamW steps (keep: the tiled run keeps that many layers' graphs, engine.keep_activations) (lr 1e-4: Adam's first steps move each weight by about lr whatever its gradient's
    size, so a gradient at the rounding floor moves it by up to 2 lr either way)."""
    steps = steps or batches()
    runs, count = [], tiled_count()
    for t in (0, tile):
        _TILE[0] = t
        eng = engine(store, t, objective() if objective else None, keep=keep)
        try:
            div = eng.objective.divisor
            res = [eng.step(mbs, 1e-4, div(mbs)) for mbs in steps[:1]]
            eng.wait()
            g = {k: v.clone() for k, v in engine_grads(eng).items()}
            res += [eng.step(mbs, 1e-4, div(mbs)) for mbs in steps[1:]]
            eng.wait()
            runs.append((res, g, {k: v.clone() for k, v in engine_weights(eng).items()}))
        finally:
            eng.close()
        assert (tiled_count() > count) == bool(t), "the tiled run ran tiles, the untiled none"
        count = tiled_count()
    (ra, ga, wa), (rb, gb, wb) = runs
    for x, y in zip(ra, rb, strict=True):
        assert x.loss == pytest.approx(y.loss, rel=TOL, abs=TOL)
        assert x.grad_norm == pytest.approx(y.grad_norm, rel=TOL, abs=TOL)
        assert (x.aux_loss is None) == (y.aux_loss is None)
        if x.aux_loss is not None:
            assert x.aux_loss == pytest.approx(y.aux_loss, rel=TOL)
    close(ga, gb, "gradient", relative=True, floor=floor)
    close(wa, wb, "weights after three AdamW steps", relative=False)


@pytest.fixture
def queries(monkeypatch):
    """The longest query block and key block the attention kernel (SDPA) ran on in the tiled runs,
    and the most mask elements it was given in memory (a view's storage: a Toeplitz mask is one
    vector), so a tiled run cannot pass with its attention whole."""
    import torch.nn.functional as F

    seen = {"q": 0, "k": 0, "mask": 0}
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, *a, **kw):
        if _TILE[0]:
            seen["q"], seen["k"] = max(seen["q"], q.shape[-2]), max(seen["k"], k.shape[-2])
            if isinstance(attn_mask, torch.Tensor):
                held = attn_mask.untyped_storage().nbytes() // attn_mask.element_size()
                seen["mask"] = max(seen["mask"], held)
        return real(q, k, v, attn_mask, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return seen


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_native_layer_tiled_equals_untiled(tmp_path, family, queries):
    """The native layer with every token-local part tiled and its attention run per query tile:
    Llama, Mistral (a sliding window shorter than the rows), Qwen2 (Q/K/V biases), Qwen3 (q/k
    norms); micro-batches of two rows of 20-40 tokens, tiles of 7."""
    _, store = make_store(tmp_path, family)
    steps = batches()
    compare(store, 7, steps)
    assert queries["q"] == 7 and queries["k"] <= 40, queries  # query tiles against a row's keys
    # causal rows on the CPU: the mask one vector of t + keys (attend.causal_rows), not (t, keys) rows
    assert 0 < queries["mask"] < 7 + 40, queries


@pytest.mark.parametrize(
    "family,over",
    [
        ("gemma2", {}),  # sliding windows, soft-capping, norms before and after the MLP
        ("olmo2", {}),  # norms after attention and MLP instead of before
        ("mixtral", dict(output_router_logits=True)),  # MoE, the aux loss trained through the tiles
        ("qwen2_moe", dict(output_router_logits=True)),  # shared expert, a dense layer after a MoE one
        ("deepseek_v3", {}),  # multi-head latent attention, group-limited routing, dense then MoE
    ],
)
def test_generic_layers_tiled_equal_untiled(tmp_path, family, over):
    _, store = make_store(tmp_path, family, **over)
    assert not untiled_kinds(store.arch.generic)
    compare(store, 7)


def test_a_hybrid_tiles_its_moe_and_keeps_its_scan_whole(tmp_path):
    """Qwen3-Next: Gated DeltaNet layers (the recurrent scan untiled: it takes a mask and a cache)
    beside attention layers, each with a MoE block, which is what is tiled."""
    cfg = transformers.AutoConfig.for_model("qwen3_next", **QWEN3_NEXT)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    store = Store.open(tmp_path / "store")
    found = blocks(store.arch.generic)
    assert set(found.values()) == {("mlp",)}, found
    # floor 1e-2: the DeltaNet scan carries the rounding of dx into linear_attn.dt_bias (1.2e-10 apart
    # on an AMD EPYC with AVX-512 BF16, no AMX, against 6e-11 at a thousandth of the largest gradient)
    rows = [micro_batches(random_rows(4, 96, seed=s, lo=20, hi=40), 2) for s in range(2)]
    compare(store, 7, steps=rows, floor=1e-2)


def packed(seed: int) -> list[MicroBatch]:
    """One row of three documents (9, 13, 11 tokens) packed: positions restart, attention stays
    inside each document; tiles of 5 and 7 cross every document edge."""
    g = torch.Generator().manual_seed(seed)
    lens = (9, 13, 11)
    ids = torch.randint(3, 96, (1, sum(lens)), generator=g)
    labels = ids.clone()
    labels[0, 0] = IGNORE
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    doc = torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in enumerate(lens)])[None]
    return [MicroBatch(ids, labels, pos, doc, None)]


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_packed_documents_across_tile_edges(tmp_path, family, queries):
    """Native (Llama; Mistral: its window and the documents together) and transformers' layers."""
    _, store = make_store(tmp_path, family)
    steps = [packed(s) for s in range(3)]
    compare(store, 5, steps)
    compare(store, 7, steps)
    if store.arch.generic is None:  # the document mask built per query tile: rows of it only
        assert queries["q"] == 7 and 0 < queries["mask"] <= 7 * 33, queries


def test_dpo_with_tiles(tmp_path, tok):
    """The two-pass preference objective (DPO, a reference log-prob per row) over tiled layers."""
    _, store = make_store(tmp_path, "llama", vocab_size=400)
    pairs = pairs_of(datasets.Dataset.from_dict(RECORDS), tok)
    ref = torch.randn(6, 2, generator=torch.Generator().manual_seed(0)).numpy() - 30
    steps = [collate_pairs(pairs.rows(range(s, s + 2)), 1, 0, ref[s : s + 2]) for s in range(3)]
    compare(store, 3, steps, objective=lambda: PairObjective(PreferenceConfig(loss="dpo", beta=0.2)))


def test_untiled_layers_are_named():
    """The structural rule: a layer whose only children are attention, a recurrent mixer and
    norms has no token-local block (Mamba: the mixer takes a cache and a mask)."""
    from horizon_cli.arch.generic import generic_spec

    cfg = transformers.AutoConfig.for_model(
        "mamba", vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4
    )
    g = generic_spec(cfg.to_dict(), "config.json")
    assert untiled_kinds(g) == list(dict.fromkeys(g.layer_kinds))


@pytest.mark.parametrize("family", ["llama", "olmo2", "qwen2_moe"])
def test_lora_tiled_equals_untiled(tmp_path, family):
    """LoRA on every linear layer (natively passed down; on transformers' layers a hook reading
    the adapters the tile's recompute binds again): the adapters after three steps agree."""
    from horizon_cli.config.schema import LoraConfig
    from horizon_cli.lora.setup import lora_setup

    _, store = make_store(tmp_path, family)
    out = []
    for t in (0, 7):
        setup = lora_setup(LoraConfig(r=4, alpha=8, targets="all-linear"), store.arch)
        ecfg = EngineConfig(device="cpu", dtype="float32", loss_chunk=16, seq_tile=t)
        eng = Engine(store, ecfg, OptimConfig(kernel="torch", lr=1e-4), lora=setup)
        try:
            for mbs in batches():
                eng.step(mbs, 1e-4)
            eng.wait()
            out.append({k: v.clone() for k, v in eng.host.tensors().items()})
        finally:
            eng.close()
    close(out[0], out[1], "adapters after three AdamW steps", relative=False)
    assert any(v.abs().max() > 0 for k, v in out[1].items() if "lora_B" in k)


@pytest.mark.parametrize("family,over", [("llama", {}), ("mixtral", dict(output_router_logits=True))])
def test_kept_layers_tiled_equal_untiled(tmp_path, family, over):
    """Every layer kept (its forward under autograd, each tile checkpointed: the graph holds the
    tiles' inputs, the backward recomputes them) against the untiled recompute."""
    _, store = make_store(tmp_path, family, **over)
    compare(store, 7, keep=store.arch.n_layers)


def test_inspect_says_what_is_tiled(tmp_path):
    from tests.conftest import horizon

    _, store = make_store(tmp_path, "qwen2_moe")
    r = horizon("inspect", store.root)
    assert r.exit_code == 0, r.output
    assert "sequence tiles" in r.output and "mlp of layer kind(s)" in r.output, r.output


@pytest.mark.parametrize("family,over", [("llama", {}), ("mixtral", dict(output_router_logits=True))])
def test_tiled_runs_are_bitwise_repeatable(tmp_path, family, over):
    """Two tiled runs give the same model bit for bit (what a bitwise resume rests on)."""
    _, store = make_store(tmp_path, family, **over)
    out = []
    for _ in range(2):
        eng = engine(store, 7)
        try:
            for mbs in batches(2):
                eng.step(mbs, 1e-4)
            eng.wait()
            out.append({k: v.clone() for k, v in engine_weights(eng).items()})
        finally:
            eng.close()
    assert all(torch.equal(out[0][k], out[1][k]) for k in out[0])
