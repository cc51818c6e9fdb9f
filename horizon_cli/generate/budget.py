"""The plan of a generation (`horizon generate`, eval-time samples, the evaluation harness): what one
sweep of the layers moves over the link, what the batch's KV cache needs, where it lives, and the
link-bound decode speed.

Each decode step is one sweep: every layer's streaming bytes (an NF4 store's packed bytes), the
head (with a tied head, the embedding it reuses), a LoRA run's adapters, cross the link once for
the whole batch. So a step takes at least `sweep bytes / link speed`, and the batch's rows all
advance by one token in it: the link bound is `rows x link / sweep bytes` tokens per second,
until the compute (2 FLOPs per parameter per token) or the KV cache's memory stops the batch from
growing. The cache lives on the device when it fits beside the engine's buffers; otherwise in host
memory, and then each sweep also carries it (once in, once back) over the link.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arch import ArchSpec
from ..arch.calls import is_loop, spec_sequence
from ..errors import InputError
from ..lora.sizes import base_bytes
from ..planning.memory import ITEM
from ..store import layouts

KV_WHERE = ("auto", "device", "host")


@dataclass
class GenPlan:
    rows: int  # prompts generating together (the batch)
    sweep_bytes: int  # weights crossing the link per sweep
    kv_bytes: int  # the batch's whole KV cache at its longest
    kv_where: str  # device | host
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    link_gbps: float = 0.0  # the link's speed (0: none, the CPU's shared memory)
    device_free: int | None = None  # CUDA: free bytes the plan was judged against
    why: str = ""  # why the cache lives where it does

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def link_bytes(self) -> int:
        """Bytes per decode sweep over the link: the weights, and a host cache in and out (at
        its longest: an upper bound)."""
        return self.sweep_bytes + (2 * self.kv_bytes if self.kv_where == "host" else 0)

    @property
    def sweep_s(self) -> float | None:
        """The link's time for one decode sweep (None: no link)."""
        return self.link_bytes / (self.link_gbps * 1e9) if self.link_gbps else None

    @property
    def bound_tokens_per_s(self) -> float | None:
        """The link-bound decode speed of the whole batch (tokens per second)."""
        s = self.sweep_s
        return self.rows / s if s else None


def weights_per_sweep(
    spec: ArchSpec, dtype: str, quant: str = "", adapter_numel: int = 0, stream: str = ""
) -> int:
    """Bytes that cross the link in one forward sweep: every layer (a loop: every call's,
    arch.calls), the head (tied: and the embedding, which the head reuses), a LoRA run's adapters.
    stream: the base's streaming dtype ("": dtype; planning.memory.frozen_stream)."""
    base = base_bytes(spec, stream or dtype, quant)
    layers = sum(base[f"layer.{i}"] for i in spec_sequence(spec))
    return layers + base["head"] + (base["embed"] if spec.tie_embeddings else 0) + adapter_numel * ITEM[dtype]


def plan_generation(
    spec: ArchSpec,
    dtype: str,
    batches: list[tuple[int, int, int]],
    kv_bytes: int,
    *,
    quant: str = "",
    prefetch: int = 2,
    adapter_numel: int = 0,
    link_gbps: float = 0.0,
    device_free: int | None = None,
    kv: str = "auto",
    reserve: int = 1 << 30,
    stream: str = "",
    tower: dict[str, int] | None = None,
) -> GenPlan:
    """batches: per micro-batch (rows, prompt length, positions reached); kv_bytes: their whole
    cache (generate.kvcache.kv_bytes); device_free: a CUDA device's free bytes (None: the CPU,
    whose "device" is host memory: the cache stays there). kv: auto | device | host. stream: the
    base's streaming dtype ("": dtype; narrower: upcast on the device, state.widen). tower: the
    vision tower's device rows for prompts with images (vision.plan.generation_bytes)."""
    item = ITEM[dtype]
    stream = stream or dtype
    base = base_bytes(spec, stream, quant)
    lays = {lay.name: lay for lay in layouts(spec)}
    layer_max = max(v for k, v in base.items() if k.startswith("layer."))
    rows = sum(b for b, _, _ in batches)
    p = GenPlan(
        rows,
        weights_per_sweep(spec, dtype, quant, adapter_numel, stream),
        kv_bytes,
        "device",
        link_gbps=link_gbps,
        device_free=device_free,
    )
    p.host[f"base weights{' (NF4 layers)' if quant else ''}"] = sum(base.values())
    p.device["weight buffers"] = (
        prefetch * layer_max + base["head"] + (base["embed"] if spec.tie_embeddings else 0)
    )
    if quant:
        p.device["dequantized layer"] = max(lays[k].numel for k in base if k.startswith("layer.")) * item
    if ITEM[stream] < item:  # the buffers a narrow base is upcast into: one layer's, the head's
        head = lays["head"].numel + (lays["embed"].numel if spec.tie_embeddings else 0)
        layer = 0 if quant else max(lays[k].numel for k in base if k.startswith("layer."))
        p.device["upcast buffers (layer, head)"] = (layer + head) * item
    prefill = sum(b * t for b, t, _ in batches)
    p.device["activations (prefill)"] = 2 * prefill * spec.boundary_width * item
    widest = max(b * t for b, t, _ in batches)
    p.device["layer working set"] = widest * (spec.q_dim + 2 * spec.kv_dim + 3 * spec.intermediate) * item
    p.device["logits"] = max(b for b, _, _ in batches) * spec.vocab * (item + 8)
    p.device.update(tower or {})  # prompts with images: the vision tower's weights and prefill (vision.plan)
    fits = device_free is None or p.device_total + kv_bytes + reserve <= device_free
    if kv == "host" or (kv == "auto" and not fits):
        calls = spec_sequence(spec)
        if calls != list(range(spec.n_layers)) and is_loop(calls):
            raise InputError(
                f"engine.kv_cache: {kv}: the KV cache on the host is not supported for a model that runs "
                f"its layers in a loop ({len(calls)} calls for {spec.n_layers} layers); it must fit on the device"
            )
        p.kv_where = "host"
        p.host["KV cache"] = kv_bytes
        per_layer = kv_bytes // max(spec.n_layers, 1)
        p.device["KV cache in flight"] = (prefetch + 1) * per_layer
        p.why = "asked for" if kv == "host" else "it does not fit beside the engine's buffers"
    else:
        p.device["KV cache"] = kv_bytes
        p.why = (
            "asked for"
            if kv == "device"
            else "the device is host memory"
            if device_free is None
            else "it fits"
        )
    return p
