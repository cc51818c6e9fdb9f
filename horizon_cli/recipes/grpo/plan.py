"""The dry run's rollout plan of an `rl:` run, on paper: what one step's rollouts move and hold.

Decoding is link-bound (generate.budget): each of the max_completion_length decode sweeps moves
every layer's weights over the link once for all batch_size x G completions, so a step's rollout
takes at least  max_completion_length x (weights per sweep) / link  seconds, plus, when the KV
cache lives on the host, the cache in and out of each sweep. The KV cache of the batch is about
rows x (prompt + completion) positions x 2 x n_layers x kv_dim x the dtype's bytes (a model with
sliding windows or latent attention keeps less). The reference (beta > 0) and the old policy
(num_iterations > 1) add one forward-only sweep each over the batch's tokens.

Sharded (torchrun, `world` ranks): each rank decodes its part of the prompts (at most
ceil(batch_size / world) x G rows, its KV cache that many) and moves only its slice of each layer,
1 / world of the weights, over its own link per sweep (the all-gather between the devices is not
counted); the figures are one rank's.

The link: engine.link_gbps when set, else 50 GB/s, a PCIe 5.0 x16 host-to-device rate (stated).
"""

from __future__ import annotations

from ...arch import ArchSpec
from ...config import Config
from ...data import PreparedData
from ...fmt import fmt_bytes
from ...generate.budget import weights_per_sweep
from ...planning.memory import ITEM
from .prompts import prompt_data

ASSUMED_GBPS = 50.0


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
    kv = rows * positions * 2 * arch.n_layers * arch.kv_dim * ITEM[dtype]
    sweep = -(-weights_per_sweep(arch, dtype, quant) // world)  # one rank's slice over its link
    gbps = cfg.engine.link_gbps or ASSUMED_GBPS
    host_kv = cfg.engine.kv_cache == "host" or (
        cfg.engine.kv_cache == "auto" and device_free is not None and kv * 4 > device_free * 3
    )
    per_sweep = sweep + (2 * kv if host_kv else 0)
    sweeps = rl.max_completion_length
    rollout_s = sweeps * per_sweep / (gbps * 1e9)
    passes = (rl.beta > 0) + (rl.num_iterations > 1)
    ref_s = passes * sweep / (gbps * 1e9)
    where = "host (each sweep carries it in and out)" if host_kv else "device"
    text = (
        f"rollouts: {total:,} completions a step ({cfg.train.batch_size} prompts x G {rl.num_generations})"
        + (f", each of {world} ranks decoding at most {rows:,} of them" if world > 1 else "")
        + ", "
        f"{sweeps:,} decode sweeps of {fmt_bytes(sweep)} weights{' per rank' if world > 1 else ''}; "
        f"KV cache about {fmt_bytes(kv)} "
        f"({positions:,} positions: {said} + {rl.max_completion_length}) on the {where}; on paper at "
        f"{gbps:g} GB/s{'' if cfg.engine.link_gbps else ' (PCIe 5.0 x16, assumed)'}: rollout >= {_s(rollout_s)} s "
        f"a step, {total * rl.max_completion_length / rollout_s:,.0f} tokens/s"
        + (f"; reference/old passes >= {_s(ref_s)} s" if passes else "")
    )
    return {
        "rows": total,
        "rank_rows": rows,
        "world": world,
        "sweeps": sweeps,
        "sweep_bytes": sweep,
        "kv_bytes": kv,
        "kv_where": "host" if host_kv else "device",
        "link_gbps": gbps,
        "rollout_s": rollout_s,
        "reference_s": ref_s,
        "text": text,
    }


def _s(x: float) -> str:
    return f"{x:.2g}" if x < 10 else f"{x:,.0f}"
