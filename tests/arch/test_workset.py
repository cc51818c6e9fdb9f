"""The recurrent mixers' working set (arch.workset) against what the real mixers save.

convert measures, on the meta device, what each recurrent mixer saves for its backward at two
lengths and records rows * (fixed + per_token * T); here the real mixer of a tiny model runs on
the CPU with random weights at another length and batch, and autograd's saved tensors (by
storage, weights excluded) must match the record; the memory plan's layer working set covers
the whole layer's saved tensors."""

from __future__ import annotations

import pytest
import torch
import transformers

from horizon_cli.arch.generic import generic_spec
from horizon_cli.arch.spec import ArchSpec
from horizon_cli.planning.memory import layer_work_bytes

QWEN3_NEXT = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32,
    layer_types=["linear_attention", "full_attention"],
)  # fmt: skip
BAMBA = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=64,
    attn_layer_indices=[1],
)  # fmt: skip


def saved_by(fn) -> int:
    """Bytes autograd saves while fn runs, by storage, parameters excluded."""
    weights: set[int] = set()
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if not isinstance(t, torch.nn.Parameter) and s.data_ptr() not in weights:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(weights)
    return sum(seen.values())


@pytest.mark.parametrize(
    "family,over,mixer", [("qwen3_next", QWEN3_NEXT, "linear_attn"), ("bamba", BAMBA, "mamba")]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measured_workset_is_what_the_mixer_saves(family, over, mixer, dtype):
    cfg = transformers.AutoConfig.for_model(family, **over)
    g = generic_spec(cfg.to_dict(), "config.json")
    entry = g["workset"][g["layer_kinds"][0]]
    assert entry["module"] == mixer
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dt).eval()
    mod = model.get_decoder().layers[0].get_submodule(mixer)
    call: dict = {}
    hook = mod.register_forward_pre_hook(lambda m, a, k: call.update(a=a, k=k), with_kwargs=True)
    rows, T = 2, 384  # neither the batch nor a length the measurement used
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (rows, T)), use_cache=False)
    hook.remove()

    def run(weights):
        weights.update(p.untyped_storage().data_ptr() for p in mod.parameters())
        x = call["a"][0].detach().requires_grad_(True) if call["a"] else None
        args = (x, *call["a"][1:]) if call["a"] else ()
        kw = dict(call["k"])
        if x is None:
            kw["hidden_states"] = kw["hidden_states"].detach().requires_grad_(True)
        mod(*args, **kw)

    real = saved_by(run)
    fixed, per_token = entry[dtype]
    planned = rows * (fixed + per_token * T)
    assert real <= planned <= 1.25 * real, (family, dtype, real, planned)


def test_the_plan_covers_a_hybrid_layer(tmp_path):
    """The plan's layer working set of a Gated DeltaNet layer covers what the whole layer saves
    (the mixer's states and decay matrices, its projections, the MoE block), in fp32."""
    cfg = transformers.AutoConfig.for_model("qwen3_next", **QWEN3_NEXT)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(tmp_path / "hf")
    from horizon_cli.convert import convert
    from horizon_cli.store import Store

    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    spec: ArchSpec = Store.open(tmp_path / "store").arch
    layer = model.get_decoder().layers[0]
    call: dict = {}
    hook = layer.register_forward_pre_hook(lambda m, a, k: call.update(a=a, k=k), with_kwargs=True)
    rows, T = 2, 384
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (rows, T)), use_cache=False)
    hook.remove()

    def run(weights):
        weights.update(p.untyped_storage().data_ptr() for p in layer.parameters())
        args = (call["a"][0].detach().requires_grad_(True), *call["a"][1:])
        layer(*args, **call["k"])

    real = saved_by(run)
    assert real <= layer_work_bytes(spec, rows * T, rows, T, 4), real
