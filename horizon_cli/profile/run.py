"""`horizon profile`: link bandwidth, per-layer times, and the overlap the pipeline achieves.

Runs a few optimizer steps of the configured model (or a built-in tiny one) on random tokens of
the configured shape, with every transfer, compute stretch and update on a timeline.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import preflight
from ..config import Config, load_config
from ..config.schema import DataConfig, OptimConfig, TrainConfig
from ..data.batch import MicroBatch
from ..engine import Engine
from ..engine.build import build_engine, plan_run, with_release
from ..errors import InputError
from ..fmt import fmt_bytes
from ..lora.setup import lora_for
from ..parallel.topology import world_for
from ..planning.fit import check_device_fit
from ..runtime.device import check_device
from ..runtime.dtype import with_dtype
from ..runtime.trace import Tracer
from ..store import Store
from . import bandwidth
from .chrome import write_trace
from .plot import plot_timeline
from .timeline import median_step, step_times

WARMUP, MEASURE = 1, 3


def run_profile(
    config: Path | None, json_out=None, trace=None, plot=None, console: Console | None = None
) -> dict:
    console = console or Console()
    if world_for(None, None).size > 1:  # each rank would profile alone and write the same files
        raise InputError(
            "horizon profile measures one process: run it without torchrun "
            "(a sharded run's steps are in its metrics.jsonl)"
        )
    for path, opt in ((json_out, "--json"), (trace, "--trace"), (plot, "--plot")):
        preflight.check_output_file(path, opt)  # before minutes of measuring, not after
    with tempfile.TemporaryDirectory(prefix="horizon-profile-") as tmp:
        cfg, store, lora = _setup(config, Path(tmp), console)
        where = preflight.local_machine(cfg)
        # K: auto fits it here; optim.grad_release: auto decided as `train` decides it
        planned, release = with_release(plan_run(cfg, store, lora, where=where), where)
        cfg, plan = planned.cfg, planned.plan
        if release and cfg.optim.grad_release == "true":
            console.print(escape(release), highlight=False)
        check_device_fit(plan, cfg.engine)
        tracer = Tracer(enabled=True)
        engine = build_engine(cfg, store, lora=lora, tracer=tracer, keep=plan.kept)
        batch, micro = cfg.train.batch_size, cfg.train.micro_batch_size
        seq = min(cfg.data.max_seq_len, store.arch.max_positions)
        try:
            link = bandwidth.measure(engine.t, sizes=_sizes(store))
            mbs = _batches(store.arch.vocab, batch, micro, seq)
            results = []
            with console.status("profiling steps") as status:
                for s in range(WARMUP + MEASURE):
                    status.update(f"profiling: step {s + 1}/{WARMUP + MEASURE}")
                    results.append(engine.step(mbs, cfg.optim.lr))
                engine.wait()
        finally:
            engine.close()
    spans = tracer.spans
    times = step_times(spans)[WARMUP:]
    med = median_step(times)
    out = _summary(store, engine, link, med, results[-1], spans, batch * seq)
    _show(out, console)
    measured = _measured_spans(spans)
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))
    if trace:
        write_trace(measured, Path(trace))
        console.print(f"trace: {trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if plot:
        title = f"{out['model']}: step {med.step_s * 1e3:.0f} ms, overlap {med.overlap:.2f}"
        plot_timeline(measured, Path(plot), title)
        console.print(f"plot: {plot}")
    return out


def _setup(config: Path | None, tmp: Path, console: Console):
    """(config, store, LoRA setup): the given config's, or a built-in tiny model's."""
    if config is not None:
        cfg, _ = with_dtype(load_config(config))  # engine.dtype: auto decided for this machine
        store = Store.open(cfg.model.path)
        lora = lora_for(cfg.lora, store, cfg.train.seed)
        check_device(cfg.engine)
        return cfg, store, lora
    console.print("no config given: profiling a built-in tiny Llama (8 layers, hidden 512) on random weights")
    cfg = Config(
        data=DataConfig(max_seq_len=256),
        train=TrainConfig(batch_size=8, micro_batch_size=4),
        optim=OptimConfig(lr=1e-5),
    )
    return with_dtype(cfg)[0], _tiny_store(tmp), None


def _tiny_store(tmp: Path) -> Store:
    import transformers

    from ..convert import convert

    cfg = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()  # its "Writing model shards" bar is not ours
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp / "hf")
    convert(tmp / "hf", tmp / "store", dtype="bfloat16")
    return Store.open(tmp / "store")


def _sizes(store: Store) -> tuple[int, ...]:
    layer = max(u.nbytes for u in store.units if u.name.startswith("layer."))
    return tuple(sorted({1 << 20, 16 << 20, min(layer, 1 << 30)}))


def _batches(vocab: int, batch: int, micro: int, seq: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    rows = [(r.tolist(), r.tolist()) for r in ids]
    return [MicroBatch.from_rows(rows[i : i + micro], 0) for i in range(0, batch, micro)]


def _measured_spans(spans):
    steps = sorted((s for s in spans if s.lane == "step"), key=lambda s: s.t0)
    start = steps[WARMUP].t0 if len(steps) > WARMUP else 0.0
    return [s for s in spans if s.t1 >= start]


def _per_layer(spans, prefix: str, kept: bool = False) -> float:
    """Median compute span of the layers' `prefix` (fwd, bwd), of the kept layers or the others."""
    vals = [
        s.t1 - s.t0
        for s in spans
        if s.lane == "compute" and s.name.startswith(prefix) and s.name.endswith(" kept") == kept
    ]
    return statistics.median(vals) if vals else 0.0


def _summary(store: Store, engine: Engine, link: list[dict], med, last, spans, tokens: int) -> dict:
    a = store.arch
    h2d, d2h = bandwidth.best(link, "h2d"), bandwidth.best(link, "d2h")
    opt = [s.t1 - s.t0 for s in spans if s.lane == "optimizer" and s.name.startswith(("layer.", "lora."))]
    # the link's fixed cost per step: every layer's weights twice (as they stream: the compute
    # dtype, or NF4 bytes), a kept layer's once, with its adapters in LoRA runs; compute grows with tokens
    layer = {u: _nbytes(engine.units[u].stream) for u in engine.layers}
    adapters = {u: _nbytes(st.stream) for u, st in engine.host.units.items() if u.startswith("lora.")}
    per_layer = [layer[u] + adapters.get(f"lora.{i}", 0) for i, u in enumerate(engine.layers)]
    per_layer = [per_layer[i] for i in engine.tmpl.calls]  # a loop (arch.calls): every call's load
    kept = engine.kept_layers
    passes = engine.passes  # norm-first: two whole passes
    weights = passes * (2 * sum(per_layer) - sum(per_layer[len(per_layer) - kept :] if kept else []))
    per_token = med.compute_s / max(1, tokens)
    hide = (weights / (h2d * 1e9)) / per_token if h2d and per_token else None
    return {
        "model": f"{a.family} {a.n_layers}x{a.hidden}",
        "device": str(engine.t.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "h2d_gbps": h2d,
        "d2h_gbps": d2h,
        "h2d_pageable_gbps": bandwidth.best(link, "h2d", pinned=False),
        "d2h_pageable_gbps": bandwidth.best(link, "d2h", pinned=False),
        "link": link,
        "tokens_per_step": tokens,
        **asdict(med),
        "overlap": med.overlap,
        "layer_forward_s": _per_layer(spans, "fwd"),
        "layer_backward_s": _per_layer(spans, "bwd"),
        "kept_layers": kept,
        "kept_layer_forward_s": _per_layer(spans, "fwd", kept=True),
        "kept_layer_backward_s": _per_layer(spans, "bwd", kept=True),
        "layer_optimizer_s": statistics.median(opt) if opt else 0.0,
        "head_s": _per_layer(spans, "head"),
        "tokens_to_hide_link": hide,
        "h2d_bytes": last.h2d_bytes,
        "d2h_bytes": last.d2h_bytes,
        "weight_loads": last.weight_loads,
        "passes": passes,
        "device_peak_bytes": last.device_peak_bytes,
        "layer_bytes": max(layer.values()),  # one load of the largest layer (NF4: packed bytes)
        "base": store.quant or str(store.dtype).replace("torch.", ""),
        "lora": engine.lora is not None,
        "layers": a.n_layers,
    }


def _loads_rule(passes: int) -> str:
    rule = "2 per recomputed layer, 1 per kept layer"
    return rule + (", in each of 2 passes: norm-first" if passes > 1 else "")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _show(out: dict, console: Console) -> None:
    bw = Table(title="link bandwidth (GB/s, largest size)", title_justify="left")
    for col in ("direction", "pinned", "pageable"):
        bw.add_column(col, justify="right")
    bw.add_row("host → device", f"{out['h2d_gbps']:.1f}", f"{out['h2d_pageable_gbps']:.1f}")
    bw.add_row("device → host", f"{out['d2h_gbps']:.1f}", f"{out['d2h_pageable_gbps']:.1f}")
    console.print(bw)
    t = Table(
        title=f"{out['model']} on {out['device']} ({out['dtype']}), {out['tokens_per_step']:,} tokens/step, median step",
        title_justify="left",
    )
    t.add_column("measure")
    t.add_column("value", justify="right")
    ms = lambda x: f"{x * 1e3:.1f} ms"  # noqa: E731
    rows = [
        ("step", ms(out["step_s"])),
        ("device compute (busy)", ms(out["compute_s"])),
        ("link (busier direction)", ms(out["transfer_s"])),
        ("  host → device", ms(out["h2d_s"])),
        ("  device → host", ms(out["d2h_s"])),
        ("CPU AdamW", ms(out["optimizer_s"])),
        ("overlap = max(compute, link) / step", f"{out['overlap']:.2f}"),
        ("layer forward", ms(out["layer_forward_s"])),
        ("layer recompute + backward", ms(out["layer_backward_s"])),
        ("kept layers (no recompute, loaded once)", f"{out['kept_layers']} of {out['layers']}"),
        ("  kept layer forward (under autograd)", ms(out["kept_layer_forward_s"])),
        ("  kept layer backward (its forward's graph)", ms(out["kept_layer_backward_s"])),
        ("layer AdamW", ms(out["layer_optimizer_s"])),
        ("loss head (fwd + bwd)", ms(out["head_s"])),
        ("weight transfers per step", f"{out['weight_loads']} ({_loads_rule(out['passes'])})"),
        ("bytes per layer load", f"{fmt_bytes(out['layer_bytes'])} ({out['base']} layer weights)"),
        (
            "bytes host → device / device → host",
            f"{fmt_bytes(out['h2d_bytes'])} / {fmt_bytes(out['d2h_bytes'])}",
        ),
        ("device peak", fmt_bytes(out["device_peak_bytes"])),
    ]
    if out["tokens_to_hide_link"]:
        rows.append(("tokens per step to hide the link", f"{out['tokens_to_hide_link']:,.0f}"))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
