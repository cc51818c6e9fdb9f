"""The dry run's rollout plan of an `rl:` run, on paper: what one step's rollouts move and hold,
on the rollout engine the run will use (recipes.grpo.rollout_engine.choose, from the same sizes).

Streamed: decoding is link-bound (generate.budget): each of the max_completion_length decode
sweeps moves every layer's weights over the link once for all batch_size x G completions, so a
step's rollout takes at least  max_completion_length x (weights per sweep) / link  seconds, plus,
when the KV cache lives on the host, the cache in and out of each sweep.

Resident: the copy (quant.weight_only's format: full, fp8, int8, nf4; the head as streamed) and
the KV cache live on the device between steps. A step's rollout is at least
    refresh   the weights over the link once (weights per sweep / link) and their quantization on
              the device (QUANT_PASSES fp32 passes over them at the device's bandwidth)
    prefill   2 FLOPs per parameter per prompt token (+ attention) at the device's FLOPs
    decode    per sweep the larger of its bytes at the device's bandwidth (the copy read; a narrowed
              layer also dequantized into the compute dtype, written and read again; the cache
              read at its mean length) and its FLOPs (2 per parameter per row, + attention)
at the device's peak rates, DEVICE_GBPS and DEVICE_TFLOPS (an H200's, assumed; stated): lower
bounds like the link's. The KV cache of the batch is about rows x (prompt + completion)
positions x 2 x n_layers x kv_dim x the dtype's bytes. The reference (beta > 0) and the rollout
policy's log-probs (num_iterations > 1, or a narrowed copy's IS correction) add one forward-only
sweep each over the batch's tokens, each reward model (rl.rewards[i].model) one of its own store's
weights; the training step: 8 FLOPs per parameter per token (forward, recompute, backward) or its
layer loads over the link, whichever is longer.

Sharded (torchrun, `world` ranks): each rank decodes its part of the prompts (at most
ceil(batch_size / world) x G rows, its KV cache that many) and moves only its slice of each layer,
1 / world of the weights, over its own link per sweep (the all-gather between the devices is not
counted); the figures are one rank's. Sharded runs and LoRA runs stream.

The link: engine.link_gbps when set, else 50 GB/s, a PCIe 5.0 x16 host-to-device rate (stated).
"""

from __future__ import annotations

from typing import Any

from ...arch import ArchSpec
from ...config import Config
from ...data import PreparedData
from ...fmt import fmt_bytes
from ...generate.budget import weights_per_sweep
from ...planning.memory import ITEM
from ...quant.weight_only import packed_nbytes
from ...store.layout import layouts
from .prompts import prompt_data
from .rollout_engine import Choice, blocker_of, choose

ASSUMED_GBPS = 50.0
DEVICE_GBPS = 4800.0  # H200 HBM3e, assumed
DEVICE_TFLOPS = 989.0  # H200 dense bf16, assumed
QUANT_PASSES = {"full": 0, "fp8": 4, "int8": 4, "nf4": 20}  # fp32 passes over a unit to narrow it


def copy_bytes(arch: ArchSpec, dtype: str, fmt: str) -> int:
    """A resident copy's device bytes (as rollout_engine.engine_copy_bytes counts an engine's):
    the layers in `fmt`, the head as streamed, a narrowed copy's one dequantized layer."""
    item, total, largest = ITEM[dtype], 0, 0
    for lay in layouts(arch):
        if fmt == "full" or not lay.name.startswith("layer."):
            total += lay.numel * item if lay.name != "embed" or arch.tie_embeddings else 0
        else:
            total += sum(packed_nbytes(t.shape, fmt, item) for t in lay.tensors)
            largest = max(largest, lay.numel * item)
    return total + largest


def rollout_plan(
    cfg: Config,
    data: PreparedData | None,
    arch: ArchSpec,
    dtype: str,
    quant: str = "",
    device_free: int | None = None,
    world: int = 1,
) -> dict | None:
    rl = cfg.rl
    if rl is None:
        return None
    total = cfg.train.batch_size * rl.num_generations
    rows = -(-cfg.train.batch_size // world) * rl.num_generations  # one rank's
    if data is not None and len(data.train):
        prompt = max(len(r.ids) for r in prompt_data(data).train.rows)
        said = "the longest prompt"
    else:
        prompt = max(1, min(cfg.data.max_seq_len, arch.max_positions) - rl.max_completion_length)
        said = "data.max_seq_len less max_completion_length"
    positions = prompt + rl.max_completion_length
    per_pos = 2 * arch.n_layers * arch.kv_dim * ITEM[dtype]  # a row's cache per position
    kv = rows * positions * per_pos
    sweep = -(-weights_per_sweep(arch, dtype, quant) // world)  # one rank's slice over its link
    gbps = cfg.engine.link_gbps or ASSUMED_GBPS
    blocker = blocker_of(cfg.lora is not None, world, cfg.engine.kv_cache)
    choice = choose(rl, blocker, lambda f: copy_bytes(arch, dtype, f), kv, device_free)
    host_kv = choice.engine == "streamed" and (
        cfg.engine.kv_cache == "host"
        or (cfg.engine.kv_cache == "auto" and device_free is not None and kv * 4 > device_free * 3)
    )
    sweeps = rl.max_completion_length
    streamed_s = sweeps * (sweep + (2 * kv if host_kv else 0)) / (gbps * 1e9)
    params = weights_per_sweep(arch, dtype) // ITEM[dtype]  # what a token's matmuls read
    attn = 4 * arch.n_layers * arch.n_heads * arch.head_dim  # FLOPs per query per cached position
    apart = choice.engine == "resident" and choice.weights != "full" and rl.importance_sampling_correction
    passes = (rl.beta > 0) + (rl.num_iterations > 1 or apart)
    tokens = total * positions
    pass_s = max(sweep / (gbps * 1e9), 2 * params * tokens / (DEVICE_TFLOPS * 1e12))
    scorers = [_scorer(r.model, world) for r in rl.rewards if r.model is not None]
    reward_s = sum(max(b / (gbps * 1e9), 2 * n * tokens / (DEVICE_TFLOPS * 1e12)) for b, n in scorers)
    train_s = max(
        (2 * arch.n_layers - 1) * sweep / max(arch.n_layers, 1) / (gbps * 1e9),
        8 * params * tokens / (DEVICE_TFLOPS * 1e12),
    )
    out: dict[str, Any] = {
        "rows": total,
        "rank_rows": rows,
        "world": world,
        "sweeps": sweeps,
        "sweep_bytes": sweep,
        "kv_bytes": kv,
        "kv_where": "host" if host_kv else "device",
        "link_gbps": gbps,
        "engine": choice.engine,
        "weights": choice.weights,
        "engine_why": choice.why,
        "streamed_s": streamed_s,
        "rollout_s": streamed_s,
        "reference_s": passes * pass_s,
        "reward_model_s": reward_s,
        "train_s": train_s,
    }
    if choice.engine == "resident":
        out |= resident_terms(
            arch, dtype, choice, rows, prompt, positions, per_pos, params, attn, sweep, gbps
        )
    out["step_s"] = out["rollout_s"] + out["reference_s"] + reward_s + train_s
    out["text"] = _text(cfg, out, positions, said, prompt, passes)
    return out


def resident_terms(
    arch: ArchSpec,
    dtype: str,
    c: Choice,
    rows: int,
    prompt: int,
    positions: int,
    per_pos: int,
    params: int,
    attn: int,
    sweep: int,
    gbps: float,
) -> dict:
    """The resident rollout's refresh, prefill and decode seconds at the device's peak rates."""
    bw, fl = DEVICE_GBPS * 1e9, DEVICE_TFLOPS * 1e12
    held = copy_bytes(arch, dtype, c.weights)
    layers = sum(lay.numel for lay in layouts(arch) if lay.name.startswith("layer.")) * ITEM[dtype]
    # read the copy; a narrowed layer dequantized into the compute dtype: written, read again
    weights_read = held + (2 * layers if c.weights != "full" else 0)
    refresh = sweep / (gbps * 1e9) + QUANT_PASSES[c.weights] * 4 * layers / ITEM[dtype] / bw
    prefill = (2 * params * prompt + attn * prompt * prompt / 2) * rows / fl
    mean_pos = (prompt + positions) / 2  # the cache's mean length over the sweeps
    per_sweep = max(
        (weights_read + rows * mean_pos * per_pos) / bw, (2 * params + attn * mean_pos) * rows / fl
    )
    n = positions - prompt
    return {
        "copy_bytes": held,
        "device_gbps": DEVICE_GBPS,
        "device_tflops": DEVICE_TFLOPS,
        "refresh_s": refresh,
        "prefill_s": prefill,
        "decode_sweep_s": per_sweep,
        "rollout_s": refresh + prefill + n * per_sweep,
    }


def _text(cfg: Config, r: dict, positions: int, said: str, prompt: int, passes: int) -> str:
    rl = cfg.rl
    assert rl is not None
    world, rows, gbps = r["world"], r["rank_rows"], r["link_gbps"]
    link = f"{gbps:g} GB/s{'' if cfg.engine.link_gbps else ' (PCIe 5.0 x16, assumed)'}"
    where = "host (each sweep carries it in and out)" if r["kv_where"] == "host" else "device"
    head = (
        f"rollouts: {r['rows']:,} completions a step ({cfg.train.batch_size} prompts x G {rl.num_generations})"
        + (f", each of {world} ranks decoding at most {rows:,} of them" if world > 1 else "")
        + f", {r['sweeps']:,} decode sweeps; KV cache about {fmt_bytes(r['kv_bytes'])} ({positions:,} "
        f"positions: {said} + {rl.max_completion_length}) on the {where}; "
    )
    streamed = (
        f"{r['sweeps']:,} sweeps of {fmt_bytes(r['sweep_bytes'])} weights{' per rank' if world > 1 else ''} "
        f"at {link}: >= {_s(r['streamed_s'])} s"
    )
    tok = r["rows"] * rl.max_completion_length / r["rollout_s"]
    if r["engine"] == "streamed":
        body = f"engine streamed ({r['engine_why']}): on paper {streamed} a step, {tok:,.0f} tokens/s"
    else:
        body = (
            f"engine resident, {r['weights']} copy of {fmt_bytes(r['copy_bytes'])} ({r['engine_why']}); on paper "
            f"at {DEVICE_GBPS:g} GB/s and {DEVICE_TFLOPS:g} TFLOPs (H200, assumed): refresh over the link "
            f">= {_s(r['refresh_s'])} s, prefill >= {_s(r['prefill_s'])} s, decode >= "
            f"{r['decode_sweep_s'] * 1e3:.0f} ms a sweep: rollout >= {_s(r['rollout_s'])} s a step, "
            f"{tok:,.0f} tokens/s (streamed: {streamed})"
        )
    tail = (
        (f"; reference/old passes >= {_s(r['reference_s'])} s" if passes else "")
        + (f"; reward model passes >= {_s(r['reward_model_s'])} s" if r["reward_model_s"] else "")
        + (f"; training step >= {_s(r['train_s'])} s; whole step >= {_s(r['step_s'])} s")
    )
    return head + body + tail


def _scorer(path: str, world: int) -> tuple[int, int]:
    """A reward model's (bytes one rank moves over its link per pass, parameters): its store's."""
    from ...store import Store

    rm = Store.open(path)
    dtype = str(rm.dtype).replace("torch.", "")
    return -(-weights_per_sweep(rm.arch, dtype, rm.quant) // world), weights_per_sweep(
        rm.arch, dtype
    ) // ITEM[dtype]


def _s(x: float) -> str:
    return f"{x:.2g}" if x < 10 else f"{x:,.0f}"
