"""Config fields that change how transformers runs a forward, not what the model is (a padding id,
the cache, the outputs a forward returns), leave the probe's description of the model as it is
(arch.probe on the meta device): a fine-tune's config.json that sets `pad_token_id` converts.

The fields were found by probing every exact type of the census with each one changed
(docs/architectures.md, "config fields the probe ignores"); the types here are the census's fast
subset, one per kind of layer."""

from __future__ import annotations

import json

import pytest

from horizon_cli.arch.generic import generic_spec
from tests.conftest import horizon
from tests.support.census_config import tiny_config

FIELDS = {
    "pad_token_id": 0,  # GPT-2 fine-tunes: transformers' padding warning reads the ids' values
    "return_dict": False,  # the forward returns a tuple
    "use_cache": True,
    "output_hidden_states": True,
    "output_attentions": True,
}
TYPES = {"gpt2": 2, "exaone": 2, "qwen3_moe": 2, "gemma3": 6, "granite": 2}


def _with(cfg: dict, name: str, value) -> dict:
    out = json.loads(json.dumps(cfg))
    out[name] = value
    if isinstance(out.get("text_config"), dict):
        out["text_config"][name] = value
    return out


def _description(spec) -> tuple:
    return spec.model, spec.units, spec.kinds, spec.layer_kinds, spec.carried, spec.moe


@pytest.mark.parametrize("mt", list(TYPES))
def test_runtime_fields_leave_the_description_as_it_is(mt):
    base = tiny_config(mt, TYPES[mt]).to_dict()
    want = _description(generic_spec(base, mt))
    for name, value in FIELDS.items():
        got = _description(generic_spec(_with(base, name, value), f"{mt} with {name}: {value}"))
        assert got == want, name


def test_convert_a_gpt2_whose_config_sets_pad_token_id(tmp_path):
    """A GPT-2 fine-tune's config.json with pad_token_id (the probe raised 'Tensor.item() cannot be
    called on meta tensors' from transformers' padding check): converts, to the same model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from horizon_cli.store import Store

    stores = {}
    for name, pad in (("plain", None), ("padded", 0)):
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, pad_token_id=pad)
        GPT2LMHeadModel(cfg).save_pretrained(tmp_path / name)
        r = horizon("convert", tmp_path / name, tmp_path / f"{name}-store")
        assert r.exit_code == 0, r.output
        stores[name] = Store.open(tmp_path / f"{name}-store").arch.generic
    assert _description(stores["padded"]) == _description(stores["plain"])


@pytest.mark.parametrize(
    "mt, name, value, says",
    [
        ("exaone", "pad_token_id", "past", "Padding_idx must be within num_embeddings"),
        ("dbrx", "tie_word_embeddings", True, "tie_word_embeddings is not supported for DBRX models"),
    ],
)
def test_a_config_transformers_cannot_build_is_one_line(mt, name, value, says):
    """What transformers' from_pretrained would fail on (its own checks) is refused in one line."""
    from horizon_cli.errors import InputError

    base = tiny_config(mt, 2).to_dict()
    value = (base.get("text_config") or base)["vocab_size"] if value == "past" else value
    with pytest.raises(InputError, match=f"{mt}: transformers cannot build .* from this config: .*{says}"):
        generic_spec(_with(base, name, value), mt)
