"""`horizon inspect`: what a store holds, and what training it will cost in host memory."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .arch import ArchSpec
from .arch.calls import spec_sequence
from .arch.generic_arch import GenericArch
from .arch.names import param_split
from .arch.reward import reward_of
from .engine.dropout import model_dropout
from .fmt import fmt_bytes
from .planning.memory import memory_plan
from .planning.tiling import note as tiling_note
from .progress import byte_progress
from .store import Store


def inspect_store(path: Path, verify: bool = False, console: Console | None = None) -> dict:
    console = console or Console()
    store = Store.open(path)
    m, a = store.manifest, store.arch
    split = param_split(a)
    scorer = reward_of(m.extra)
    # a reward model: the classifier's score head too (one label, a bias if it has one); its
    # decoder's embedding is tied in the store only to stream it as a causal LM's
    head = a.hidden + (1 if any(n.endswith("bias") for n in scorer.get("head", ())) else 0) if scorer else 0
    params = m.params + head
    info = Table(title=f"store {path}", show_header=False, title_justify="left")
    rows = [
        ("architecture", f"{a.family} ({a.n_layers} layers, hidden {a.hidden}, mlp {a.intermediate})"),
        ("path", _path(a)),
        ("attention", f"{a.n_heads} heads, {a.n_kv_heads} kv heads, head_dim {a.head_dim}"),
        ("vocab", f"{a.vocab:,}" + (" (tied embeddings)" if a.tie_embeddings and not scorer else "")),
        ("flags", _flags(a)),
        ("rope", ", ".join(f"{k}={v}" for k, v in a.rope.items())),
        ("parameters", f"{params:,}" + (" (the score head's included)" if scorer else "")),
    ]
    if scorer is not None:
        rows.insert(
            0,
            (
                "reward model",
                escape(f"{scorer.get('class')}: scores as rl.rewards[i].model (not trained or sampled)"),
            ),
        )
    calls = spec_sequence(a)
    if calls != list(range(a.n_layers)):  # arch.calls
        rows.append(
            (
                "layers run in a loop",
                f"{len(calls)} calls: {' '.join(map(str, calls))} (2 loads each per step)",
            )
        )
    moe = a.kind.moe
    if moe:
        rows += [
            (
                "experts",
                f"{moe.n_experts} per routed layer, top-{moe.top_k}, {len(moe.layers)} of {a.n_layers} layers routed",
            ),
            ("  dense / experts", f"{split['dense']:,} / {split['experts']:,}"),
            ("  active per token", f"{split['active']:,}"),
            (
                "  aux loss",
                f"on (coef {moe.aux_coef})"
                if moe.aux_coef is not None
                else "off (config.json: output_router_logits)",
            ),
        ]
    if drop := model_dropout(a):  # engine.dropout
        said = ", ".join(f"{k} {v:g}" for k, v in drop)
        rows.append(("dropout", f"{said} (trained; model.dropout: 0 turns it off)"))
    rows += [("dtype", m.dtype)]
    if m.quant:
        n_q = sum(1 for p in store.packed.values() for s in p.slots if s.quant)
        rows += [
            (
                "quantized",
                f"{m.quant}: {n_q} linear weights of the decoder layers as NF4 ({_layout(store)}); "
                "norms, embedding, head in " + m.dtype,
            ),
            ("training", "LoRA only (a 4-bit base cannot be fully fine-tuned)"),
        ]
    rows += [("source", m.source or "-"), ("sequence tiles", tiling_note(a))]
    for k, v in rows:
        info.add_row(k, v)
    console.print(info)

    cats: dict[str, list[int]] = {"embedding": [0, 0], "decoder layers": [0, 0], "head": [0, 0]}
    for u in store.units:
        key = "embedding" if u.name == "embed" else "head" if u.name == "head" else "decoder layers"
        cats[key][0] += u.nbytes
        cats[key][1] += store.layout(u.name).params
    what = f"{m.dtype}, decoder layers packed NF4" if m.quant else m.dtype
    sizes = Table(title=f"bytes on disk ({what}, page-aligned units)", title_justify="left")
    for col in ("category", "parameters", "bytes", "B/param"):
        sizes.add_column(col, justify="left" if col == "category" else "right")
    for k, (nb, n) in cats.items():
        sizes.add_row(k, f"{n:,}", fmt_bytes(nb), f"{nb / max(n, 1):.2f}")
    total = sum(v[0] for v in cats.values())
    sizes.add_row("[bold]total", f"{m.params:,}", fmt_bytes(total), f"{total / m.params:.2f}")
    console.print(sizes)

    if m.quant:  # LoRA only: the frozen base's streaming bytes are the host state that scales
        base = sum(store.unit_bytes(u.name) for u in store.units)
        console.print(
            f"host memory to train (LoRA): base {fmt_bytes(base)} ({base / m.params:.2f} B/param) "
            "+ the adapters' state (`horizon train CONFIG --dry-run` shows it)"
        )
        scheme = next(iter({p.scheme for p in store.packed.values()}))
        return {
            "params": m.params,
            "path": a.path,
            "quant": m.quant,
            "quant_scheme": scheme,
            "bytes": total,
            "base_bytes": base,
        }
    if scorer is not None:  # never trained: its host memory is its streaming copy (the dry run's row)
        console.print(
            "a reward model is not trained: `horizon train CONFIG --dry-run` counts what it streams"
        )
        return {"params": params, "path": a.path, "bytes": total, "reward": scorer.get("class")}
    plans = {d: memory_plan(a, d, batch=0) for d in ("bfloat16", "float32")}
    host = Table(title="host memory to train (excluding activations)", title_justify="left")
    host.add_column("category")
    for d in plans:
        host.add_column(f"engine.dtype {d}", justify="right")
    # state that scales with the parameters (batch=0: no activations); "-": not kept in that mode
    cats_all = list(dict.fromkeys(k for p in plans.values() for k in p.host if p.host[k]))
    for k in cats_all:
        host.add_row(k, *(fmt_bytes(p.host[k]) if p.host.get(k) else "-" for p in plans.values()))
    host.add_row("[bold]B/param", *(f"{p.bytes_per_param:.2f}" for p in plans.values()))
    console.print(host)

    if verify:
        with byte_progress(console, "verify", total) as advance:
            store.verify(progress=advance)
        console.print(f"[green]verified[/] {sum(len(u.tensors) for u in store.units)} tensor checksums")
    return {
        "params": m.params,
        "path": a.path,
        "dense_params": split["dense"],
        "expert_params": split["experts"],
        "active_params": split["active"],
        "bytes": total,
        "bytes_per_param": {d: p.bytes_per_param for d, p in plans.items()},
    }


def _path(a: ArchSpec) -> str:
    return a.visit(lambda _: "native (horizon's functional layer)", _generic_path)


def _generic_path(g: GenericArch) -> str:
    return f"generic: transformers' {g.layer_class} ({g.family}, {g.attn} attention)"


def _flags(a: ArchSpec) -> str:
    return a.pick(_native_flags, _generic_flags)(a)


def _native_flags(a: ArchSpec) -> str:
    flags = [
        name
        for name, on in (
            ("qkv bias", a.qkv_bias),
            ("o bias", a.o_bias),
            ("mlp bias", a.mlp_bias),
            ("q/k norm", a.qk_norm),
        )
        if on
    ]
    windows = sorted({w for w in a.windows if w})
    if windows:
        flags.append(f"sliding window {windows[0]} on {sum(1 for w in a.windows if w)} layers")
    return ", ".join(flags) or "none"


def _kernels() -> str:
    """Which path transformers' recurrent layers take here: its optimised kernels when installed."""
    import importlib.util

    have = [m for m in ("fla", "causal_conv1d", "mamba_ssm") if importlib.util.find_spec(m) is not None]
    return (
        f"kernels: {', '.join(have)}"
        if have
        else "transformers' slow pure-torch path: no fla / causal-conv1d / mamba-ssm"
    )


def _generic_flags(a) -> str:
    g = a.generic
    flags = []
    s = g.model
    before = [p.rsplit(".", 1)[-1] for p in s.prefix if p != s.embed] if s is not None else []
    if before:
        flags.append("before the layers: " + ", ".join(before))
    if s is not None and s.logits == "forward":
        flags.append(f"logits by {g.cls or 'the CausalLM'}'s own forward")
    if g.embed_scale:  # stores written before the probe
        flags.append(f"embedding x {g.embed_scale:.4g}")
    if g.softcap:
        flags.append(f"logit soft-cap {g.softcap}")
    windows = sorted({w for w in a.windows if w})
    if windows:
        flags.append(f"sliding window {windows[0]} on {sum(1 for w in a.windows if w)} layers")
    if g.boundary:
        flags.append(f"residual streams between layers ({', '.join(map(str, g.boundary))})")
    kinds = len(g.kinds)
    if kinds > 1:
        flags.append(f"{kinds} layer kinds")
    frozen = sum(1 for k in g.layer_kinds for e in g.kinds[k] if not e.trainable)
    if frozen:
        flags.append(f"{frozen} frozen buffers")
    skipped = len(g.layer_kinds) - (len(s.calls) if s is not None else len(g.layer_kinds))
    if skipped:
        flags.append(f"{skipped} layers the text forward skips")
    if g.carried:
        flags.append(f"{len(g.carried)} tensors carried untouched (not the language model)")
    if g.recurrent:
        flags.append(f"recurrent layers ({', '.join(g.recurrent[:3])}; packing refused; {_kernels()})")
    return ", ".join(flags) or "none"


def _layout(store: Store) -> str:
    """How a quantized store's NF4 tensors are laid out (the scheme its version records)."""
    schemes = {p.scheme for p in store.packed.values()}
    if schemes == {"bnb"}:
        return "bitsandbytes' layout: blocks of 64, absmax double-quantized to 8 bits in groups of 256"
    return "horizon's layout before store version 5, torchao's arithmetic: convert again for bitsandbytes'"
