"""Parent side of a peer run: one subprocess per attempt, watched for memory, timed.

Peak RSS is the kernel's high-water mark of the child (ru_maxrss from os.wait4, exact, whole
process). A watcher thread samples the child's RSS every `poll` s and kills its process group
when it passes `limit_bytes`, or when the machine's available memory falls below `floor_bytes`
(other work shares this machine): a run that would not fit is stopped before the machine suffers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

PEERS_DIR = Path(__file__).resolve().parent
ROOT = PEERS_DIR.parent
GiB = 1 << 30


@dataclass
class ChildRun:
    rc: int
    peak_rss: int  # bytes, ru_maxrss of the child
    sampled_peak: int  # bytes, the watcher's highest reading
    wall_s: float
    killed: str = ""  # why the watcher killed it ("" if it did not)
    cpu_s: float = 0.0  # the child's user + system CPU time
    others: float = 0.0  # share of the machine's CPU time used by other processes meanwhile


def _busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so run_child's cleanup kills the running child."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        DS_ACCELERATOR="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(PEERS_DIR), env.get("PYTHONPATH", "")]).strip(
        os.pathsep
    )
    return env


def run_child(
    cmd: list[str],
    log: Path,
    env: dict,
    limit_bytes: int = 20 * GiB,
    floor_bytes: int = 1 * GiB,
    timeout_s: float = 3600,
    poll: float = 0.05,
) -> ChildRun:
    log.parent.mkdir(parents=True, exist_ok=True)
    t0, busy0, t0_wall = time.perf_counter(), _busy_s(), time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    state = {"peak": 0, "killed": ""}
    done = threading.Event()

    def kill(why: str) -> None:
        state["killed"] = why
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)

    def watch() -> None:
        try:
            proc = psutil.Process(p.pid)
        except psutil.NoSuchProcess:
            return
        while not done.is_set():
            try:
                r = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
            except psutil.Error:
                r = 0
            state["peak"] = max(state["peak"], r)
            if r > limit_bytes:
                kill(f"RSS {r / GiB:.1f} GiB > limit {limit_bytes / GiB:.1f} GiB")
            elif psutil.virtual_memory().available < floor_bytes:
                kill(f"machine's available memory < {floor_bytes / GiB:.1f} GiB")
            elif time.perf_counter() - t0 > timeout_s:
                kill(f"timeout {timeout_s:.0f} s")
            if state["killed"]:
                return
            time.sleep(poll)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    try:
        _, status, usage = os.wait4(p.pid, 0)
    except BaseException:  # interrupted: never leave the child running
        kill("interrupted")
        os.wait4(p.pid, 0)
        raise
    finally:
        done.set()
        _sweep_shm(t0_wall)
    w.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    wall, cpu = time.perf_counter() - t0, usage.ru_utime + usage.ru_stime
    others = max(0.0, _busy_s() - busy0 - cpu) / (wall * (psutil.cpu_count() or 1))
    return ChildRun(p.returncode, usage.ru_maxrss * 1024, state["peak"], wall, state["killed"], cpu, others)


def _sweep_shm(since: float) -> None:
    """DeepSpeed leaves a 66 MiB /dev/shm allreduce buffer behind per process: remove the ones the
    child created, or every run quietly eats RAM (tmpfs) until the memory study cannot start."""
    for f in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"):
        with contextlib.suppress(OSError):
            if f.stat().st_mtime >= since - 1:
                f.unlink()


def run_peer(peer: str, job: dict, work: Path, python: str = sys.executable, **kw) -> dict:
    """Run benchmarks/<peer>_peer.py on `job` in a fresh process (`python`: another environment's
    interpreter, e.g. one with DeepSpeed); its result dict plus the parent's measurements
    (peak_rss, sampled_peak, child_wall_s, killed, rc)."""
    work.mkdir(parents=True, exist_ok=True)
    tag = job.get("tag", peer)
    job = {**job, "peer": peer, "out": str(work / f"{tag}.result.json"), "work": str(work)}
    jpath = work / f"{tag}.job.json"
    jpath.write_text(json.dumps(job, indent=1))
    Path(job["out"]).unlink(missing_ok=True)
    cmd = [python, str(PEERS_DIR / f"{peer}_peer.py"), str(jpath)]
    c = run_child(cmd, work / f"{tag}.log", child_env(job["threads"]), **kw)
    out = Path(job["out"])
    res = json.loads(out.read_text()) if out.is_file() else {"peer": peer, "dtype": job["dtype"], "ok": False}
    if not res.get("ok") and "error" not in res:
        res["error"] = c.killed or f"exit status {c.rc} (see {work / (tag + '.log')})"
    res.update(
        peak_rss=c.peak_rss, sampled_peak=c.sampled_peak, child_wall_s=c.wall_s, killed=c.killed, rc=c.rc
    )
    res.update(child_cpu_s=c.cpu_s, other_cpu_share=c.others, log=str(work / f"{tag}.log"))
    return res
