"""Architecture description, read from an HF config: native flags, or the generic path's tables.

Architectures are data: Llama, Mistral, Qwen2 and Qwen3 differ only in the flags below
(biases, q/k norm, sliding windows, RoPE scaling), so one `ArchSpec` describes each of them and
`arch.names` maps its tensors to Hugging Face names (`path: native`). The native path is chosen by
the class the checkpoint is (config.json's `architectures`, else transformers' causal-LM mapping),
not by its `model_type`: EXAONE, InternLM 3 and IQuest-Coder are `LlamaForCausalLM`s under other
names, read through their own config class (attribute names normalised) and, where their checkpoint
names differ (EXAONE's `transformer.h.N.attn.attention.q_proj`), with transformers' own renamings
(`hf_names`). A native class with a feature the native layer lacks (another RoPE type or
activation) takes the generic path. Every other decoder-only causal LM of transformers takes the
generic path (`path: generic`): `generic` then holds the tensor table and model-level data
`arch.generic` derived from transformers' own model class (the native fields hold the config's
sizes, for reports and memory plans).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from ..errors import InputError
from ..fsutil import read_json
from .generic import generic_spec, hf_config, model_class
from .generic_arch import GenericArch
from .kind import NATIVE, ArchKind, NativeArch

T = TypeVar("T")

# model_type -> family.  The family picks the HF name table and default flags.
FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
# the transformers classes the native layer computes exactly
NATIVE_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE = ("default", "linear", "llama3")


class Unsupported(InputError):
    """A native class with a feature the native layer does not have (the generic path may run it)."""


SUPPORTED_ACT = ("silu",)


@dataclass
class ArchSpec:
    family: str
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    max_positions: int
    tie_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    windows: list[int | None] = field(default_factory=list)  # per layer: sliding window or None
    hidden_act: str = "silu"
    padding_idx: int | None = None  # the embedding row transformers never updates (config pad_token_id)
    path: str = "native"  # native | generic
    generic: GenericArch | None = None  # path generic: arch.generic.generic_spec's description
    # native: checkpoint names that differ from the Llama layout (`model.layers.{i}....` -> disk name)
    hf_names: dict[str, str] | None = None
    # native: the attention probabilities' dropout in training (config attention_dropout; 0: none,
    # as every store converted before it, whose manifest has no such key)
    attn_dropout: float = 0.0

    @property
    def kind(self) -> ArchKind:
        """Native or generic (arch.kind): the one place the two are told apart."""
        return NATIVE if self.generic is None else self.generic

    def visit(self, native: Callable[[NativeArch], T], generic: Callable[[GenericArch], T]) -> T:
        """The kind's function called with the kind (a generic description typed as one)."""
        kind = self.kind
        return native(kind) if isinstance(kind, NativeArch) else generic(kind)

    def pick(self, native: T, generic: T) -> T:
        """`native` for a native spec, `generic` for a generic one: each kind's strategy (a
        function, a class, a value), chosen here so that no caller branches on the kind."""
        return self.visit(lambda _: native, lambda _: generic)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def boundary(self, b: int, T: int) -> tuple[int, ...]:
        """The shape of the tensor one layer passes to the next for b rows of T tokens: (b, T,
        hidden), or the model's own (several residual streams: arch.probe's `boundary`)."""
        form = self._form
        if form is None:
            return (b, T, self.hidden)
        return tuple(b if d == "b" else T if d == "T" else int(d) for d in form)

    @property
    def _form(self) -> tuple[int | str, ...] | None:
        return self.kind.boundary

    @property
    def streams(self) -> bool:
        """Layers pass more than (b, T, hidden): several residual streams."""
        return self._form is not None

    @property
    def tokens_dim(self) -> int:
        """Which dim of the boundary tensor is the tokens'."""
        form = self._form
        return 1 if form is None else form.index("T")

    @property
    def boundary_width(self) -> int:
        """Elements per token of what crosses layers, never less than the hidden size (layer 0's
        input is the embedding rows)."""
        return max(self.hidden, math.prod(self.boundary(1, 1)))

    def to_dict(self, versioned: bool = True) -> dict:
        """The manifest's `arch`; versioned=False: the generic section without its version (what a
        model fingerprint hashes, as for stores converted before it had one)."""
        d = asdict(replace(self, generic=None))
        kind = self.kind
        if isinstance(kind, NativeArch):  # native stores keep the version-1 manifest
            del d["path"], d["generic"]
        else:
            d["generic"] = kind.to_dict(versioned)
        if self.padding_idx is None:  # and stores without a padding row, their fingerprint
            del d["padding_idx"]
        if self.hf_names is None:
            del d["hf_names"]
        if not self.attn_dropout:  # stores without dropout keep their manifest and fingerprint
            del d["attn_dropout"]
        return d

    @staticmethod
    def from_dict(d: dict) -> ArchSpec:
        """A manifest's `arch`, of any version (arch.generic_arch)."""
        g = d.get("generic")
        return ArchSpec(**{**d, "generic": None if g is None else GenericArch.from_dict(g)})


def read_hf_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise InputError(f"{path}: missing (an HF checkpoint directory has a config.json)")
    return read_json(path)


def spec_from_hf(
    cfg: dict, where: str = "config.json", disk: dict[str, tuple[int, ...]] | None = None, path: str = "auto"
) -> ArchSpec:
    """HF config dict (transformers 4.x or 5.x layout) -> ArchSpec, or InputError naming the key.

    path: auto (native where there is a native layer, else generic) | native | generic.
    disk: the checkpoint's tensor names and shapes, which the generic path maps onto transformers'
    in-memory tensors (None: assume the in-memory layout)."""
    mt = cfg.get("model_type")
    family, ncfg = (None, cfg) if path == "generic" else native_family(cfg, where)
    if path == "generic" or (path == "auto" and family is None):
        return _generic_spec(cfg, where, disk)
    if family is None:
        raise InputError(
            f"{where}: no native layer for model_type {mt!r} (native: {', '.join(NATIVE_CLASSES)})"
        )
    try:
        spec = _native_spec(ncfg, family, where)
    except Unsupported:
        if path == "auto":
            return _generic_spec(cfg, where, disk)
        raise
    return spec


def native_family(cfg: dict, where: str) -> tuple[str | None, dict]:
    """(the native family, the config as the native reader wants it) by the checkpoint's class:
    its model_type's own, or a native class under another model_type (its config normalised by
    its own config class: EXAONE's `num_layers` is `num_hidden_layers`); None: not native."""
    mt = cfg.get("model_type")
    if mt in FAMILIES:
        return FAMILIES[mt], cfg
    try:
        cls = model_class(cfg, where)
    except InputError:
        return None, cfg
    family = NATIVE_CLASSES.get(cls.__name__)
    return (family, hf_config(cfg).to_dict()) if family else (None, cfg)


def _native_spec(cfg: dict, family: str, where: str) -> ArchSpec:
    mt = cfg.get("model_type")

    def need(key: str) -> Any:
        if key not in cfg or cfg[key] is None:
            raise InputError(f"{where}: missing key {key!r} for model_type {mt!r}")
        return cfg[key]

    hidden, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    n_layers = int(need("num_hidden_layers"))
    act = cfg.get("hidden_act", "silu")
    if act not in SUPPORTED_ACT:
        raise Unsupported(
            f"{where}: hidden_act {act!r} is not supported (supported: {', '.join(SUPPORTED_ACT)})"
        )
    attn_bias = bool(cfg.get("attention_bias", False))
    spec = ArchSpec(
        family=family,
        hidden=hidden,
        intermediate=int(need("intermediate_size")),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        vocab=int(need("vocab_size")),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_positions=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else attn_bias,
        o_bias=False if family == "qwen2" else attn_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        rope=_rope(cfg, where),
        windows=_windows(cfg, family, n_layers),
        hidden_act=act,
        padding_idx=_padding_idx(cfg),
        attn_dropout=float(cfg.get("attention_dropout") or 0.0),
    )
    if spec.n_heads % spec.n_kv_heads:
        raise InputError(f"{where}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads")
    return spec


def _rope(cfg: dict, where: str) -> dict[str, Any]:
    """Normalise RoPE settings: transformers 5 `rope_parameters`, or 4.x `rope_theta` + `rope_scaling`."""
    rp = dict(cfg.get("rope_parameters") or {})
    if not rp:
        rp = dict(cfg.get("rope_scaling") or {})
        rp["rope_theta"] = cfg.get("rope_theta", 10000.0)
    kind = rp.get("rope_type") or rp.get("type") or "default"
    rp.pop("type", None)
    rp["rope_type"] = kind
    rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if kind not in SUPPORTED_ROPE:
        raise Unsupported(
            f"{where}: rope type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})"
        )
    if kind == "llama3":
        rp.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key not in rp:
                raise InputError(f"{where}: llama3 rope scaling needs {key!r}")
    if kind == "linear" and "factor" not in rp:
        raise InputError(f"{where}: linear rope scaling needs 'factor'")
    return rp


def _windows(cfg: dict, family: str, n_layers: int) -> list[int | None]:
    sw = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if family == "mistral":
        return [int(sw) if sw else None] * n_layers
    if family in ("qwen2", "qwen3"):
        if layer_types:
            return [int(sw) if t == "sliding_attention" and sw else None for t in layer_types]
        if cfg.get("use_sliding_window") and sw:
            first = int(cfg.get("max_window_layers", n_layers))
            return [int(sw) if i >= first else None for i in range(n_layers)]
    return [None] * n_layers


def _generic_spec(cfg: dict, where: str, disk) -> ArchSpec:
    g = generic_spec(cfg, where, disk)
    c = hf_config(dict(g.config)).get_text_config()

    def get(key: str, default: Any = 0) -> Any:
        try:
            v = getattr(c, key, None)
        except Exception:  # noqa: BLE001 (a per-layer attribute without one global value: dots3)
            v = None
        return default if v is None or isinstance(v, (list, dict)) and not isinstance(default, dict) else v

    hidden = int(get("hidden_size", 0) or get("d_model", 0))
    heads = int(get("num_attention_heads", 1))
    n_layers = len(g.layer_kinds)
    return ArchSpec(
        family=str(c.model_type),
        hidden=hidden,
        intermediate=int(get("intermediate_size")),
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=int(get("num_key_value_heads", heads)),
        head_dim=int(get("head_dim", hidden // max(heads, 1))),
        vocab=int(c.vocab_size),
        rms_eps=float(get("rms_norm_eps", 1e-6)),
        max_positions=int(get("max_position_embeddings", 2048)),
        tie_embeddings="lm_head" not in [e.name for e in g.units.head],
        rope=dict(get("rope_parameters", {}) or {}),
        windows=generic_windows(c, n_layers),
        hidden_act=str(get("hidden_act", "") or get("hidden_activation", "")),
        padding_idx=_padding_idx(c.to_dict()),
        path="generic",
        generic=g,
    )


def generic_windows(c, n_layers: int) -> list[int | None]:
    """Per layer the sliding window (None: full attention), from the config's layer types (or one
    window for every layer, Mistral-style), for memory plans."""
    sw = getattr(c, "sliding_window", None)
    if not isinstance(sw, int) or sw <= 0:
        return [None] * n_layers
    types = getattr(c, "layer_types", None)
    if isinstance(types, list) and len(types) == n_layers:
        return [sw if "sliding" in str(t) else None for t in types]
    return [sw] * n_layers


def _padding_idx(cfg: dict) -> int | None:
    """transformers builds the embedding with padding_idx = pad_token_id when it is a valid row."""
    pad, vocab = cfg.get("pad_token_id"), int(cfg.get("vocab_size") or 0)
    return int(pad) if isinstance(pad, int) and 0 <= pad < vocab else None
