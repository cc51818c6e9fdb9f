"""The plan a generation shows before it starts (generate.budget): the batches' KV cache, where
it lives, the bytes one sweep moves and the link-bound decode speed.

The link speed: engine.link_gbps on the CPU (an emulated link; 0: none), on CUDA a 256 MiB pinned
host -> device copy timed once before loading.
"""

from __future__ import annotations

import time

import torch
from rich.table import Table

from ..errors import InputError
from ..fmt import fmt_bytes
from ..lora.targets import adapter_params
from ..model.template import make_template
from ..planning.fit import RESERVE
from ..planning.memory import frozen_stream
from ..runtime.device import cuda_index, has_link, resolve_device
from .budget import GenPlan, plan_generation
from .decoder import micro_batches
from .kvcache import kv_bytes
from .kvprobe import per_layer
from .model_source import Source


def plan_batches(
    source: Source,
    prompts: list[list[int]],
    max_new: int,
    batch_size: int,
    tower: dict[str, int] | None = None,
) -> GenPlan:
    """The plan of the largest batch (the one whose KV cache is largest) of these prompts; tower:
    the vision tower's device rows when prompts hold images (vision.plan.generation_bytes)."""
    spec, ecfg = source.store.arch, source.engine
    sizes = per_layer(make_template(spec, torch.device("cpu")))
    item = 4 if ecfg.dtype == "float32" else 2
    best: tuple[int, list[tuple[int, int, int]]] = (-1, [])
    for a in range(0, len(prompts), batch_size):
        groups = micro_batches(list(enumerate(prompts[a : a + batch_size])))
        rows = []
        for g in groups:
            P = max(len(ids) for _, ids in g)
            rows.append((len(g), P, P + max(min(max_new, spec.max_positions - len(ids)) for _, ids in g)))
        n = kv_bytes([(b, S) for b, _, S in rows], sizes, item)
        if n > best[0]:
            best = (n, rows)
    device = resolve_device(ecfg)
    free, link = None, ecfg.link_gbps
    if device.startswith("cuda"):
        free = torch.cuda.mem_get_info(cuda_index(device))[0]
        link = measure_h2d(device)
    adapters = adapter_params(source.lora.targets, source.lora.r) if source.lora else 0
    stored = str(source.store.dtype).replace("torch.", "")
    plan = plan_generation(
        spec,
        ecfg.dtype,
        best[1],
        best[0],
        quant=source.store.quant,
        prefetch=ecfg.prefetch,
        adapter_numel=adapters,
        link_gbps=link,
        device_free=free,
        kv=ecfg.kv_cache,
        stream=frozen_stream(stored, ecfg.dtype, has_link(ecfg)),
        tower=tower,
    )
    check_plan(plan)
    return plan


def check_plan(p: GenPlan) -> None:
    """Refuse (exit 2) a plan whose device part does not fit the CUDA device's free memory."""
    if p.device_free is None or p.device_total + RESERVE <= p.device_free:
        return
    what = "the KV cache on the device (engine.kv_cache: device)" if p.kv_where == "device" else "the batch"
    raise InputError(
        f"generation plan does not fit: {what} needs {fmt_bytes(p.device_total)} of the device plus "
        f"{fmt_bytes(RESERVE)} for CUDA's own use, {fmt_bytes(p.device_free)} are free; lower --batch-size"
    )


def measure_h2d(device: str, nbytes: int = 256 << 20) -> float:
    """GB/s of one pinned host -> device copy (after a warm-up copy)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return nbytes / (time.perf_counter() - t0) / 1e9


def plan_table(p: GenPlan) -> Table:
    t = Table(title=f"generation plan (batch of {p.rows} prompt(s))", title_justify="left")
    t.add_column("where")
    t.add_column("what")
    t.add_column("bytes", justify="right")
    for k, v in p.host.items():
        t.add_row("host", k, fmt_bytes(v))
    for k, v in p.device.items():
        t.add_row("device", k, fmt_bytes(v))
    t.add_row("device", "[bold]total", f"[bold]{fmt_bytes(p.device_total)}")
    if p.device_free is not None:
        t.add_row("device", "free", fmt_bytes(p.device_free))
    t.add_row(
        "link",
        "per decode sweep (weights" + (" + KV cache in and out)" if p.kv_where == "host" else ")"),
        fmt_bytes(p.link_bytes),
    )
    t.add_row("", f"KV cache on the {p.kv_where}: {p.why}", fmt_bytes(p.kv_bytes))
    if p.sweep_s:
        t.add_row(
            "",
            f"link bound at {p.link_gbps:.1f} GB/s: {p.sweep_s:.3g} s per sweep, "
            f"{p.bound_tokens_per_s:,.1f} tokens/s for the batch",
            "",
        )
    else:
        t.add_row("", "no link to bound the speed (the CPU's memory is shared)", "")
    return t
