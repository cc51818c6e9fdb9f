"""Benchmark `horizon convert`: throughput against a plain `cp -r` of the same files, peak RSS.

    .venv/bin/python benchmarks/bench_convert.py --json bench_out/convert.json

1. Builds (once, cached under --work) a synthetic Llama-shaped checkpoint of about --size-gb GB
   with transformers: random bf16 weights, saved as sharded safetensors.
2. Times `cp -r SRC DST`, `cp -r` followed by an fsync of every copied file (convert fsyncs its
   store before the final rename, so this is the like-for-like figure), and `horizon convert SRC
   DST` (the console script, a new process: the time includes starting Python and importing
   torch, reported separately as `startup_s`). Each runs --repeat times cold (the source's pages
   evicted from the page cache with fsync + posix_fadvise(DONTNEED) first; the resident fraction
   is measured with mincore and reported) and --repeat times warm (right after reading it). The
   medians are reported. A VM's host may still cache the disk: "cold" is cold for this kernel.
3. Peak RSS (ru_maxrss of the child via wait4) of `horizon convert` on the synthetic checkpoint and
   on SmolLM2-135M (`make smollm2`; safetensors, and a .bin copy of it), in bf16 and fp32 stores,
   beside the RSS of a process that only imports what convert imports (the constant part), and
   `Store.open` time of the converted stores.
4. With --memory-limit-mb N (root, a cgroup v1 or v2 memory controller): converts the synthetic
   checkpoint inside a memory cgroup of N MiB, page cache included, smaller than the checkpoint,
   and verifies the store; as a control, a process holding every tensor at once in the same
   cgroup, which the OOM killer should stop.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HORIZON = [sys.executable, "-c", "from horizon_cli.cli import main; main()"]
SMOLLM2 = Path(os.environ.get("HORIZON_SMOLLM2_DIR") or REPO / ".cache" / "smollm2" / "hf")
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- page cache ---------------------------------------------------------------------------------


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def evict(root: Path) -> None:
    """Drop root's clean pages from the page cache (fsync first so every page is clean)."""
    for p in files(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(root: Path) -> float:
    """Fraction of root's pages in the page cache (mincore over a fresh read-only mapping)."""
    page, total, res = mmap.PAGESIZE, 0, 0
    for p in files(root):
        size = p.stat().st_size
        if not size:
            continue
        n = (size + page - 1) // page
        vec = (ctypes.c_ubyte * n)()
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _LIBC.mmap(
                None, ctypes.c_size_t(size), mmap.PROT_READ, mmap.MAP_SHARED, fd, ctypes.c_long(0)
            )
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            try:
                if _LIBC.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                    return float("nan")
            finally:
                _LIBC.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
        finally:
            os.close(fd)
        res += sum(v & 1 for v in vec)
        total += n
    return res / max(total, 1)


def fsync_files(root: Path) -> None:
    for p in files(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --- child processes ----------------------------------------------------------------------------


# A small launcher between this (large) process and the measured command: a child's ru_maxrss
# starts from the memory image it was forked from, so forking the command from here would report
# this process's RSS; from the launcher it reports the command's own peak.
LAUNCHER = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
wall = time.perf_counter() - t
print("@@" + json.dumps([rc, wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]), file=sys.stderr)
"""


def run(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one command, measured by the launcher."""
    p = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], capture_output=True, text=True, env=env)
    tail = [ln for ln in p.stderr.splitlines() if ln.startswith("@@")]
    if not tail:
        raise SystemExit(f"{' '.join(cmd)}: launcher failed:\n{p.stderr}")
    rc, wall, maxrss_kib = json.loads(tail[-1][2:])
    if rc:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}):\n{p.stderr}")
    return wall, maxrss_kib * 1024


def child_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "dumb", "COLUMNS": "100"}


# --- the synthetic checkpoint -------------------------------------------------------------------


def synthetic(work: Path, size_gb: float) -> Path:
    """A Llama-shaped random bf16 checkpoint of about size_gb GB (hidden 2048, GQA 16/4, untied)."""
    import torch
    import transformers

    per_layer = (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 5632 + 2 * 2048) * 2
    embeds = 2 * 32000 * 2048 * 2
    layers = max(1, round((size_gb * 1e9 - embeds) / per_layer))
    src = work / f"llama-synthetic-{layers}L"
    if (src / "model.safetensors.index.json").is_file():
        return src
    log(f"building {src.name}: {layers} layers, random bf16 weights (once)")
    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    tmp = work / f".{src.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="400MB")
    os.replace(tmp, src)
    return src


# --- measurements -------------------------------------------------------------------------------


def du(root: Path) -> int:
    return sum(p.stat().st_size for p in files(root))


def timed(kind: str, src: Path, dst: Path, cold: bool) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    if cold:
        evict(src)
    before = resident(src)
    if kind == "cp":
        wall, rss = run(["cp", "-r", str(src), str(dst)])
        t = time.perf_counter()
        fsync_files(dst)
        out = {"s": wall, "s_with_fsync": wall + time.perf_counter() - t}
    else:
        wall, rss = run([*HORIZON, "convert", str(src), str(dst), "--dtype", "bfloat16"], child_env())
        out = {"s": wall, "peak_rss": rss}
    shutil.rmtree(dst, ignore_errors=True)
    return {**out, "resident_before": round(before, 3)}


def throughput(src: Path, dst: Path, repeat: int) -> dict:
    nbytes = du(src)
    startup, _ = run([sys.executable, "-c", "import horizon_cli.convert.convert"], child_env())
    res: dict = {"source": str(src), "bytes": nbytes, "startup_s": round(startup, 3)}
    for kind in ("cp", "convert"):
        for cold in (True, False):
            runs = []
            for i in range(repeat):
                log(f"  {kind} {'cold' if cold else 'warm'} {i + 1}/{repeat}")
                runs.append(timed(kind, src, dst, cold))
            key = f"{kind}_{'cold' if cold else 'warm'}"
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            med["min_s"] = min(r["s"] for r in runs)
            med["gb_per_s"] = nbytes / med["s"] / 1e9
            if "s_with_fsync" in med:
                med["gb_per_s_with_fsync"] = nbytes / med["s_with_fsync"] / 1e9
            res[key] = {k: round(v, 4) if isinstance(v, float) else v for k, v in med.items()}
    return res


def open_ms(store: Path) -> float:
    code = (
        "import time, sys; from horizon_cli.store import Store; "
        "t = time.perf_counter(); Store.open(sys.argv[1]); print((time.perf_counter() - t) * 1e3)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(store)], capture_output=True, text=True, check=True)
    return round(float(out.stdout.strip()), 2)


def bin_copy(src: Path, work: Path) -> Path:
    """SmolLM2 as one pytorch_model.bin (zip format), for the .bin path's RSS."""
    import torch
    from safetensors.torch import load_file

    dst = work / "smollm2-bin"
    if (dst / "pytorch_model.bin").is_file():
        return dst
    tmp = work / ".smollm2-bin.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(src / "model.safetensors"), tmp / "pytorch_model.bin")
    os.replace(tmp, dst)
    return dst


def peak_rss(sources: dict[str, Path], work: Path) -> dict:
    base_code = "import horizon_cli.cli, horizon_cli.convert.convert, torch, rich.progress"
    _, base = run([sys.executable, "-c", base_code], child_env())
    out: dict = {"imports_only": base}
    for label, src in sources.items():
        for dtype in ("bfloat16", "float32"):
            dst = work / "rss-store"
            shutil.rmtree(dst, ignore_errors=True)
            log(f"  peak RSS: convert {label} --dtype {dtype}")
            wall, rss = run([*HORIZON, "convert", str(src), str(dst), "--dtype", dtype], child_env())
            out[f"{label}:{dtype}"] = {
                "peak_rss": rss,
                "s": round(wall, 3),
                "open_ms": open_ms(dst),
                "source_bytes": du(src),
            }
            shutil.rmtree(dst, ignore_errors=True)
    return out


# --- larger than its memory: a memory cgroup ----------------------------------------------------

HOLD_ALL = """
import glob, sys
from safetensors.torch import load_file
sd = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    sd.update({k: v.clone() for k, v in load_file(f).items()})
"""


def cgroup(limit: int) -> tuple[Path, Path, Path | None] | None:
    """A fresh memory cgroup limited to `limit` bytes (page cache included, as the kernel charges
    it): (dir, procs file, peak file), or None where none can be made (needs root; v1 or v2)."""
    name = f"horizon-bench-{os.getpid()}"
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    try:
        if (v1 / "memory.limit_in_bytes").is_file():
            d = v1 / name
            d.mkdir()
            (d / "memory.limit_in_bytes").write_text(str(limit))
            return d, d / "cgroup.procs", d / "memory.max_usage_in_bytes"
        if "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            d = v2 / name
            d.mkdir()
            (d / "memory.max").write_text(str(limit))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            return d, d / "cgroup.procs", (d / "memory.peak") if (d / "memory.peak").exists() else None
    except OSError as e:
        log(f"  no memory cgroup ({e}); skipping the memory-limit run")
    return None


def limited(cmd: list[str], limit: int) -> dict:
    """Run cmd inside a new memory cgroup of `limit` bytes: exit status and peak charged bytes."""
    cg = cgroup(limit)
    if cg is None:
        return {"skipped": True}
    d, procs, peak = cg
    try:
        wrapped = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *cmd]
        t = time.perf_counter()
        rc = subprocess.call(wrapped, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
        out = {"rc": rc, "s": round(time.perf_counter() - t, 2), "limit": limit}
        if peak is not None:
            out["peak_charged"] = int(peak.read_text())
        return out
    finally:
        for _ in range(50):  # the cgroup empties once its last task is reaped
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def memory_limit(src: Path, work: Path, limit_mb: int) -> dict:
    """Convert src inside a memory cgroup smaller than src (a checkpoint larger than the memory
    it may use), verify the store; as a control, hold every tensor of src at once in the same
    limit (expected: killed by the OOM killer)."""
    from horizon_cli.store import Store

    limit = limit_mb << 20
    dst = work / "limited-store"
    shutil.rmtree(dst, ignore_errors=True)
    log(f"  convert {src.name} ({du(src) >> 20} MiB) inside a {limit_mb} MiB memory cgroup")
    conv = limited([*HORIZON, "convert", str(src), str(dst)], limit)
    if conv.get("rc") == 0:
        Store.open(dst).verify()
        conv["verified"] = True
    shutil.rmtree(dst, ignore_errors=True)
    log("  control: hold every tensor at once inside the same cgroup")
    control = limited([sys.executable, "-c", HOLD_ALL, str(src)], limit)
    return {"source_bytes": du(src), "limit_mb": limit_mb, "convert": conv, "hold_all_tensors": control}


def table(res: dict) -> None:
    t = res["throughput"]
    gb = t["bytes"] / 1e9
    print(f"\nconvert throughput: {t['source']} ({gb:.2f} GB, sharded bf16 safetensors -> bf16 store)")
    print(f"  {'':18s} {'cold s':>8s} {'cold GB/s':>10s} {'warm s':>8s} {'warm GB/s':>10s}")
    up = t["startup_s"]
    rows = [("cp -r", "cp", "s", 0.0), ("cp -r + fsync", "cp", "s_with_fsync", 0.0)]
    rows += [("horizon convert", "convert", "s", 0.0), ("  less start-up", "convert", "s", up)]
    for name, key, s_key, minus in rows:
        c, w = t[f"{key}_cold"][s_key] - minus, t[f"{key}_warm"][s_key] - minus
        print(f"  {name:18s} {c:8.2f} {gb / c:10.2f} {w:8.2f} {gb / w:10.2f}")
    print(f"  (medians; convert fsyncs its output; its start-up, Python + imports, is {up:.2f} s)")
    h = res["host"]
    print(
        f"  host: {h['cpus']} CPUs, load average {h['loadavg_1m_at_start']:.1f} at start, {h['loadavg_1m_at_end']:.1f} at end"
    )
    r = res["peak_rss"]
    print(f"\npeak RSS (MiB); a process that only imports convert's modules: {r['imports_only'] / 2**20:.0f}")
    for k, v in r.items():
        if k != "imports_only":
            print(
                f"  {k:28s} {v['peak_rss'] / 2**20:7.0f} MiB  (source {v['source_bytes'] / 2**20:.0f} MiB, "
                f"{v['s']:.1f} s, Store.open {v['open_ms']:.1f} ms)"
            )
    m = res.get("memory_limit")
    if m and not m["convert"].get("skipped"):
        c, h = m["convert"], m["hold_all_tensors"]
        print(f"\ninside a {m['limit_mb']} MiB memory cgroup, source {m['source_bytes'] / 2**20:.0f} MiB:")
        print(
            f"  horizon convert: exit {c['rc']}{', store verified' if c.get('verified') else ''}, {c['s']} s"
        )
        print(f"  control, holding every tensor at once: exit {h['rc']} (negative: killed by signal)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=REPO / "bench_out" / "convert", help="scratch dir (kept)")
    ap.add_argument("--size-gb", type=float, default=1.5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write results here")
    ap.add_argument("--smollm2", type=Path, default=SMOLLM2, help="SmolLM2 checkpoint (make smollm2)")
    ap.add_argument(
        "--memory-limit-mb",
        type=int,
        default=0,
        help="also convert the synthetic checkpoint inside a memory cgroup of this size (root; 0: skip)",
    )
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    src = synthetic(args.work, args.size_gb)
    log(f"throughput on {src}")
    res: dict = {"host": host_info(args.work), "throughput": throughput(src, args.work / "dst", args.repeat)}
    sources = {"synthetic": src}
    if (args.smollm2 / "model.safetensors").is_file():
        sources["smollm2"] = args.smollm2
        sources["smollm2.bin"] = bin_copy(args.smollm2, args.work)
    else:
        log(f"no SmolLM2 checkpoint at {args.smollm2} (run `make smollm2`): its RSS is skipped")
    res["peak_rss"] = peak_rss(sources, args.work)
    if args.memory_limit_mb:
        res["memory_limit"] = memory_limit(src, args.work, args.memory_limit_mb)
    res["host"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    table(res)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
        print(f"\nwrote {args.json}")


def host_info(work: Path) -> dict:
    import psutil

    return {
        "cpus": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "python": sys.version.split()[0],
        "fs": subprocess.run(["df", "-T", str(work)], capture_output=True, text=True).stdout.splitlines()[-1],
        "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0],
        "loadavg_1m_at_start": os.getloadavg()[0],
    }


if __name__ == "__main__":
    main()
