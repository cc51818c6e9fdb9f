"""Architecture census: every model type in transformers' causal-LM mapping, tiny and random.

For each type: build a tiny fp32 model from its config class's defaults (a few size overrides,
enough layers to hold every kind of layer the full-depth config has, dropout and noise off),
decide whether transformers itself trains it on the CPU (forward with labels, backward: finite
loss and gradients, nothing stochastic), then try horizon through its public entry points
(save_pretrained -> horizon_cli.convert.convert -> `horizon train`, 3 AdamW steps -> horizon_cli.export
.export) against a resident transformers + torch.optim.AdamW run on the same batches, twice (in
horizon's 2 micro-batches with gradient accumulation, and each batch at once): the three losses
and gradient norms, every step-1 gradient (read back from the step-1 checkpoint's first moment,
m1 = (1 - beta1) g1 with clipping off) and the logits after step 3 within 1e-5 of both; the
exported weights within 1e-5 of the micro-batched run, and of the other within 1e-5 plus the two
runs' own distance (`weight_noise`: Adam's division by sqrt(v) + eps turns fp32 summation order
into up to 3.2e-5 of weight, tests/support/census_horizon.py says where). It also records, from the model itself and transformers' source, the
structure issue 19 needs (decoder stack, norm, embeddings, rotary, mask functions, multipliers,
recurrent layers, multimodal prefixes).

Run from the checkout's root as a module (it imports tests.support):

    nice -n 10 python -m scripts.census run [--types a,b] [--json /tmp/census-full.json] [--timeout 240]
    python -m scripts.census compact /tmp/census-full.json docs/census.json   (the rows kept in git)
    python -m scripts.census table docs/census.json > table.md
    python -m scripts.census summary docs/census.json      (counts, needs, mechanisms ranked)
    python -m scripts.census stacks docs/census.json       (which generic rule finds each stack)
    python -m scripts.census one TYPE --json row.json        (the per-model child; run does this)
    python -m scripts.census horizon docs/census.json [--types a,b]   (re-run only horizon's stage
                          on each row's recorded depth, in place: after a horizon change, ~15 min)

Each type runs in a subprocess of its own (one at a time) with a timeout; `run` keeps the rows
already in the JSON file unless --redo.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the children run as `-m scripts.census` from here


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_child(mt: str, timeout: int, work: Path) -> dict:
    """One type in a subprocess; a crash or a hang becomes a row that says so."""
    out = work / f"{mt}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "scripts.census", "one", mt, "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        tail = (p.stdout + p.stderr)[-1500:]
        code = p.returncode
    except subprocess.TimeoutExpired as e:
        tail, code = f"timeout after {timeout} s", None
        del e
    row = json.loads(out.read_text()) if out.is_file() else {"type": mt}
    row["seconds"] = round(time.time() - t0, 1)
    if code != 0:  # the child died or hung: what it wrote last says in which stage
        row["crash"] = {"exit": code, "stage": row.get("stage"), "tail": tail}
    return row


def cmd_run(args) -> None:
    path = Path(args.json)
    rows = json.loads(path.read_text()) if path.is_file() and not args.redo else {}
    types = args.types.split(",") if args.types else all_types()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for i, mt in enumerate(types):
        if mt in rows and not args.types:
            continue
        row = run_child(mt, args.timeout, work)
        rows[mt] = row
        path.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        print(f"[{i + 1}/{len(types)}] {mt}: {verdict(row)} ({row['seconds']} s)", flush=True)


def verdict(row: dict) -> str:
    t = row.get("transformers", {})
    h = row.get("horizon", {})
    if "crash" in row:
        return f"crash in {row['crash']['stage']}"
    tr = "trains" if t.get("trains") else f"transformers cannot train ({t.get('why', '?')})"
    return f"{tr}; horizon {h.get('result', '-')}"


def cmd_horizon(args) -> None:
    """Re-run horizon's stage (convert -> 3 steps -> export against transformers) for the rows of
    a census JSON, each at its recorded depth in a subprocess of its own, and rewrite their
    `horizon` entries (compacted) in place."""
    path = Path(args.json)
    rows = json.loads(path.read_text())
    types = args.types.split(",") if args.types else sorted(rows)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for i, mt in enumerate(types):
        row = rows.setdefault(mt, {"type": mt})
        layers = str((row.get("depth") or {}).get("layers") or 0)
        out = Path(args.work) / f"{mt}.horizon.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "scripts.census", "horizon-one", mt, layers, "--json", str(out)]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
            tail = (p.stdout + p.stderr)[-600:]
        except subprocess.TimeoutExpired:
            tail = f"timeout after {args.timeout} s"
        h = json.loads(out.read_text()) if out.is_file() else {"result": "failed", "message": tail}
        row["horizon"] = compact_row({"horizon": h})["horizon"]
        path.write_text(dump_rows(rows))
        print(f"[{i + 1}/{len(types)}] {mt}: {horizon_cell(row)} ({time.time() - t0:.0f} s)", flush=True)


def cmd_horizon_one(args) -> None:
    import tempfile

    from tests.support.census_horizon import quiet, run_type

    quiet()
    layers = int(args.layers)
    if not layers:
        from tests.support.census_config import choose_depth

        layers = choose_depth(args.type)["layers"]
    with tempfile.TemporaryDirectory(prefix=f"census-{args.type}-") as tmp:
        res = run_type(args.type, layers, Path(tmp))
    Path(args.json).write_text(json.dumps(res, default=str))


def dump_rows(rows: dict) -> str:
    """One row a line: diffs between census runs stay readable."""
    lines = [
        f"{json.dumps(k)}:{json.dumps(r, sort_keys=True, separators=(',', ':'))}"
        for k, r in sorted(rows.items())
    ]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def cmd_one(args) -> None:
    from scripts.census_model import census_one  # scripts/census_model.py: the child's work

    census_one(args.type, Path(args.json))


# ---------------------------------------------------------------------------------------------
# the Markdown table (docs/architectures.md's table is generated from this)


def cell(s: str, n: int = 90) -> str:
    s = " ".join(str(s).split()).replace("|", "\\|")
    return s if len(s) <= n else s[: n - 1] + "…"


def horizon_cell(row: dict) -> str:
    h = row.get("horizon") or {}
    r = h.get("result", "-")
    if r == "exact":
        return f"exact ({h.get('path', '?')})"
    if r in ("refused", "failed"):
        return f"{r}: {cell(h.get('message', ''), 110)}"
    if r == "mismatch":
        return f"mismatch: {cell(h.get('worst', ''), 110)}"
    return r


def cmd_table(args) -> None:
    from scripts.census_summary import kind

    rows = json.loads(Path(args.json).read_text())
    print("| model_type | model class | kind | transformers trains | horizon |")
    print("|---|---|---|---|---|")
    for mt in sorted(rows):
        row = rows[mt]
        t = row.get("transformers") or {}
        if "crash" in row and not t:
            tr = f"crash ({row['crash'].get('stage')})"
        else:
            tr = "yes" if t.get("trains") else f"no: {cell(t.get('why', '?'), 70)}"
        print(f"| `{mt}` | {row.get('model_class', '?')} | {kind(row)} | {tr} | {horizon_cell(row)} |")


def cmd_counts(args) -> None:
    """The census counts for docs/benchmarks.md: over the target (text decoders and the language
    models of multimodal checkpoints that transformers trains) and over every type."""
    from scripts.census_summary import TARGET, kind

    rows = json.loads(Path(args.json).read_text())
    trains = {k: r for k, r in rows.items() if (r.get("transformers") or {}).get("trains")}
    target = {k: r for k, r in trains.items() if kind(r) in TARGET}

    def result(r):
        return (r.get("horizon") or {}).get("result", "-")

    print(
        f"tried: {len(rows)}; transformers trains: {len(trains)}; target (decoder, multimodal): {len(target)}"
    )
    for name, group in (("target", target), ("every type transformers trains", trains)):
        c = Counter(result(r) for r in group.values())
        pct = 100 * c["exact"] / max(len(group), 1)
        print(
            f"\n{name}: {len(group)} types, exact {c['exact']} ({pct:.1f} %), "
            + ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if k != "exact")
        )
    print("\n| target type | kind | result | reason |\n|---|---|---|---|")
    for k, r in sorted(target.items()):
        if result(r) != "exact":
            h = r.get("horizon") or {}
            print(
                f"| `{k}` | {kind(r)} | {result(r)} | {cell(h.get('message') or h.get('worst') or '', 140)} |"
            )


def cmd_stacks(args) -> None:
    from scripts.census_stacks import main as stacks

    stacks(args.json)


def compact_row(row: dict) -> dict:
    """What docs/census.json keeps of a full row: the verdicts, the numbers, the structure."""
    t = row.get("transformers") or {}
    h = row.get("horizon") or {}
    st = row.get("structure") or {}
    keep_t = ("trains", "why", "where", "stochastic", "train_eval_differ", "causal", "n_without_grad")
    keep_h = ("result", "stage", "message", "path", "loss_err", "grad_norm_err", "grad_err", "weight_err",
              "weight_err_full", "weight_noise", "logits_err", "worst", "problems")  # fmt: skip
    keep_s = ("text_config", "composite", "source", "owner", "layer_classes", "layer_forward", "layer_at",
              "final_norm", "embeddings", "rotary", "recurrent_modules", "config_scalars", "head",
              "mask_functions_in_file", "_no_split_modules", "_can_record_outputs", "checkpoint", "error")  # fmt: skip
    out = {k: row[k] for k in ("type", "config_class", "model_class", "built_class", "params", "attn_implementation",
                                "fixups", "seconds", "crash") if k in row}  # fmt: skip
    d = row.get("depth") or {}
    out["depth"] = {
        k: d[k] for k in ("default_layers", "stack", "kinds", "layers", "covered", "kinds_missing") if k in d
    }
    out["transformers"] = {k: t[k] for k in keep_t if k in t}
    out["horizon"] = {k: h[k] for k in keep_h if k in h}
    out["structure"] = {k: st[k] for k in keep_s if k in st}
    for k in ("owner_forward", "causal_lm_forward"):
        if k in st:
            f = st[k]
            out["structure"][k] = {
                "at": f.get("at"),
                "masks": f.get("masks"),
                "arith": (f.get("arith") or [])[:6],
            }
            if f.get("loop"):
                out["structure"][k]["loop"] = f["loop"][:3] + (
                    [f"... {len(f['loop']) - 3} more"] if len(f["loop"]) > 3 else []
                )
    ck = out["structure"].get("checkpoint")
    if ck:
        out["structure"]["checkpoint"] = {k: v for k, v in ck.items() if not k.startswith("only_")}
        out["structure"]["checkpoint"]["renamed_on_disk"] = bool(ck.get("only_on_disk"))
    rec = out["structure"].get("_can_record_outputs")
    if rec:
        out["structure"]["_can_record_outputs"] = {k: v for k, v in rec.items() if k == "hidden_states"}
    out["structure"].pop("layer_at", None)
    if "message" in out["horizon"]:  # the tmp path and today's list of supported families: noise here
        msg = out["horizon"]["message"].split("; supported:")[0]
        msg = re.sub(r"^/tmp/census-[^/]+/hf/", "", msg)
        if "not described for the generic path" in msg:
            msg = "not described for the generic path (horizon_cli/arch/families.py)"
        out["horizon"]["message"] = msg
    if "calls" in row:  # kwargs as "type" or "type x N distinct" (N > 1: differs between layers)
        out["calls"] = dict(row["calls"])
        kw = out["calls"].get("kwargs") or {}
        out["calls"]["kwargs"] = {
            k: v["type"] + (f" x{v['distinct']}" if v.get("distinct", 1) > 1 else "") for k, v in kw.items()
        }
    lf = out["structure"].get("layer_forward")
    if lf:
        out["structure"]["layer_forward"] = {k: ", ".join(v) for k, v in lf.items()}
    emb = out["structure"].get("embeddings")
    if emb:
        out["structure"]["embeddings"] = [e for e in emb if e.get("shape")]
    if "crash" in out:
        out["crash"] = {k: v for k, v in out["crash"].items() if k != "tail"}
    return out


def cmd_compact(args) -> None:
    rows = json.loads(Path(args.full).read_text())
    Path(args.out).write_text(dump_rows({k: compact_row(r) for k, r in rows.items()}))


def cmd_summary(args) -> None:
    from scripts.census_summary import main as summary

    summary(args.json)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--types", default="")
    r.add_argument("--json", default="/tmp/census-full.json")
    r.add_argument("--work", default="/tmp/census-work")
    r.add_argument("--timeout", type=int, default=240)
    r.add_argument("--redo", action="store_true")
    h = sub.add_parser("horizon")
    h.add_argument("json")
    h.add_argument("--types", default="")
    h.add_argument("--work", default="/tmp/census-work")
    h.add_argument("--timeout", type=int, default=240)
    h1 = sub.add_parser("horizon-one")
    h1.add_argument("type")
    h1.add_argument("layers")
    h1.add_argument("--json", required=True)
    o = sub.add_parser("one")
    o.add_argument("type")
    o.add_argument("--json", required=True)
    t = sub.add_parser("table")
    t.add_argument("json")
    n = sub.add_parser("counts")
    n.add_argument("json")
    s = sub.add_parser("summary")
    s.add_argument("json")
    k = sub.add_parser("stacks")
    k.add_argument("json")
    c = sub.add_parser("compact")
    c.add_argument("full")
    c.add_argument("out")
    args = ap.parse_args()
    cmds = {"run": cmd_run, "one": cmd_one, "table": cmd_table, "summary": cmd_summary, "stacks": cmd_stacks}
    cmds.update(
        counts=cmd_counts, compact=cmd_compact, horizon=cmd_horizon, **{"horizon-one": cmd_horizon_one}
    )
    cmds[args.cmd](args)


if __name__ == "__main__":
    main()
