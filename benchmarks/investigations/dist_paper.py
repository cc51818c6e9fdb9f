"""The on-paper multi-GPU benchmark (issue 12): a sharded horizon run of Llama-3.1-70B and -405B on
8xH100 nodes, modelled, not measured.

    .venv/bin/python -m benchmarks.investigations.dist_paper [--json bench_out/dist_paper.json]

Per GPU and step: the bytes on its host link (PCIe), on NVLink and on the network for the
all-gathers and reduce-scatters, the host memory traffic of its node, the tokens per GPU a step
needs for compute to hide all of them, and the predicted step time at two global batches against
one GPU, with host RAM per node and device bytes per rank from horizon's own memory plan
(engine/plan.py, the same as `horizon train --dry-run --world-size N`). Assumptions are the
constants below; the formulas are the functions' bodies and docs/benchmarks.md writes them out.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import LlamaConfig

from horizon_cli.arch import spec_from_hf
from horizon_cli.config.schema import EngineConfig
from horizon_cli.parallel.shard import check_world
from horizon_cli.planning.fit import RESERVE
from horizon_cli.planning.memory import memory_plan
from horizon_cli.store import layouts

# -- assumptions (effective, not peak) -------------------------------------------------------------
PCIE = 55e9  # B/s per GPU per direction: PCIe 5 x16 (64 GB/s raw); H2D and D2H run at once
NVLINK = 450e9  # B/s per GPU for NCCL collectives inside a node (NVLink 4, 900 GB/s bidirectional)
NET = 40e9  # B/s per GPU between nodes: one 400 Gb/s InfiniBand NIC per GPU (50 GB/s raw)
FLOPS = 700e12  # FLOP/s per H100: ~989 TFLOP/s dense bf16 at 70 % MFU
HOST_MEM = 400e9  # B/s host memory bandwidth of one node (2 sockets x 8 channels DDR5-4800, ~65 %)
GPUS_PER_NODE = 8
ADAMW_BYTES = 28  # host bytes moved per parameter by the exact CPU AdamW (docs/benchmarks.md, E.2)
SEQ = 4096
LOSS_CHUNK = EngineConfig().loss_chunk  # engine defaults: prefetch 2, bf16, micro-batch 1 here
DEVICE = 80e9  # bytes of an H100 SXM; a plan fits when it leaves RESERVE (engine/fit.py) free
WORLDS = (1, 8, 16, 64)
BATCHES = (64, 256)  # global batch in sequences of SEQ tokens: 262k and 1M tokens (64 ranks: 1 and 4 each)

LLAMA_31 = {  # the published sizes (no hub: the config is written out)
    "Llama-3.1-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8),
    "Llama-3.1-405B": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                           num_attention_heads=128, num_key_value_heads=8),
}  # fmt: skip
COMMON = dict(
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)  # fmt: skip


@dataclass
class Row:
    model: str
    gpus: int
    nodes: int
    pcie_gb: float  # per GPU per step, H2D + D2H
    nvlink_gb: float  # per GPU per step, all-gather + reduce-scatter received over NVLink
    net_gb: float  # per GPU per step, over its NIC
    host_mem_gb: float  # per node per step: DMA + AdamW
    t_pcie: float
    t_coll: float
    t_host: float
    hide_tokens: int  # per GPU per step for compute to hide the slowest of the three
    host_node_gib: dict  # global batch -> host bytes per node (GiB), exact
    lean_node_gib: dict
    device_rank_gib: dict  # global batch -> device bytes per rank (GiB)
    step_s: dict  # global batch -> predicted step time
    speedup: dict  # global batch -> against one GPU


def spec_of(name: str):
    cfg = LlamaConfig(**LLAMA_31[name], **COMMON).to_dict()
    return spec_from_hf(cfg, where=name)


def flops_per_token(spec, matmul_params: int) -> float:
    """8 P: forward 2P, the backward's recompute of the layer 2P, backward 4P; plus causal
    attention, 4 forward-equivalents of 2 * S * d per layer (QK^T and PV over S/2 keys on average)."""
    return 8 * matmul_params + 4 * 2 * SEQ * spec.hidden * spec.n_layers


def one(name: str, spec, gpus: int, P: int, mm: int) -> Row:
    nodes = -(-gpus // GPUS_PER_NODE)
    per_node = min(gpus, GPUS_PER_NODE)
    share = (gpus - 1) / gpus
    h2d = 2 * 2 * P / gpus  # bf16 slice of every unit, twice (forward, backward recompute)
    d2h = 2 * P / gpus  # bf16 gradient slice, once (embedding: fp32, ignored: < 1 %)
    gathered = 2 * 2 * P * share  # all-gather: (N-1)/N of every unit, twice
    scattered = 2 * P * share  # reduce-scatter of the bf16 gradient: (N-1)/N of every unit
    nvlink = gathered + scattered if gpus > 1 else 0.0
    net = (gathered + scattered) / GPUS_PER_NODE if nodes > 1 else 0.0  # 8 rings, one NIC each
    host_mem = (6 + ADAMW_BYTES) * P / nodes  # the node's ranks' DMA (6 B/param) + AdamW on its slices
    t_pcie = max(h2d, d2h) / PCIE
    t_coll = max(nvlink / NVLINK, net / NET)
    t_host = host_mem / HOST_MEM
    fpt = flops_per_token(spec, mm)
    hide = int(max(t_pcie, t_coll, t_host) * FLOPS / fpt) + 1
    step: dict = {}
    host: dict = {}
    lean: dict = {}
    dev: dict = {}
    for b in BATCHES:
        check_world(b, 1, gpus)
        tokens = b * SEQ / gpus
        step[b] = max(tokens * fpt / FLOPS, t_pcie, t_coll, t_host)
        for memory, out in (("exact", host), ("lean", lean)):
            p = memory_plan(spec, "bfloat16", batch=b, micro_batch=1, seq=SEQ, loss_chunk=LOSS_CHUNK,
                            memory=memory, world=gpus, per_node=per_node)  # fmt: skip
            out[b] = p.node_host_total / 2**30
            dev[b] = p.device_total / 2**30  # the whole batch's boundary activations: not per micro-batch
    return Row(name, gpus, nodes, (h2d + d2h) / 1e9, nvlink / 1e9, net / 1e9, host_mem / 1e9,
               t_pcie, t_coll, t_host, hide, host, lean, dev, step, {})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for name in LLAMA_31:
        spec = spec_of(name)
        lays = layouts(spec)
        P = sum(lay.params for lay in lays)
        mm = P - spec.vocab * spec.hidden  # the embedding is a lookup, not a matmul
        print(f"\n{name}: {P / 1e9:.1f}B parameters ({mm / 1e9:.1f}B in matmuls), "
              f"{flops_per_token(spec, mm) / 1e9:.0f} GFLOP per token at seq {SEQ}\n")  # fmt: skip
        mine = [one(name, spec, g, P, mm) for g in WORLDS]
        for r in mine:
            r.speedup = {b: mine[0].step_s[b] / r.step_s[b] for b in BATCHES}
        rows += mine
        print("| GPUs (nodes) | PCIe GB/GPU | NVLink GB/GPU | network GB/GPU | host mem GB/node | "
              "t PCIe / coll / host (s) | tokens/GPU to hide | "
              + " | ".join(f"step, batch {b}×{SEQ} (× 1 GPU)" for b in BATCHES)
              + f" | host RAM/node, exact (lean), batch {' / '.join(map(str, BATCHES))} "
              + f"| device GiB/rank, batch {' / '.join(map(str, BATCHES))} |")  # fmt: skip
        print("|" + "---|" * 11)
        for r in mine:
            steps = " | ".join(f"{r.step_s[b]:.2f} s ({r.speedup[b]:.1f}×)" for b in BATCHES)
            dev = " / ".join(
                f"{r.device_rank_gib[b]:.0f}{'' if r.device_rank_gib[b] * 2**30 + RESERVE <= DEVICE else ' (no)'}"
                for b in BATCHES
            )
            ram = " / ".join(f"{r.host_node_gib[b]:,.0f} ({r.lean_node_gib[b]:,.0f}) GiB" for b in BATCHES)
            print(f"| {r.gpus} ({r.nodes}) | {r.pcie_gb:.1f} | {r.nvlink_gb:.0f} | {r.net_gb:.1f} | "
                  f"{r.host_mem_gb:,.0f} | {r.t_pcie:.2f} / {r.t_coll:.2f} / {r.t_host:.2f} | "
                  f"{r.hide_tokens:,} | {steps} | {ram} | {dev} |")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
