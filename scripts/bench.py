"""The benchmark runner: one benchmark of benchmarks/ by name, in a process of its own.

    .venv/bin/python scripts/bench.py                      # `make bench`: benchmarks/bench_peers.py
    .venv/bin/python scripts/bench.py --repeat 2 ...       # the same, with its options
    .venv/bin/python scripts/bench.py --list               # every benchmark and the section it feeds
    .venv/bin/python scripts/bench.py NAME [ARGS...]       # benchmarks/[investigations/]NAME.py ARGS

NAME is a file of benchmarks/ or benchmarks/investigations/ without `.py`, the `bench_` prefix
optional (`convert`, `bench_keep`, `census_noise`). A harness runs by its path, with the checkout's
root on its PYTHONPATH (as benchmarks/runner.py gives its peers); an investigation runs as
`-m benchmarks.investigations.NAME` from the root. benchmarks/README.md is the index: which section
of docs/benchmarks.md each benchmark produces, and the command behind its figures.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
STUDIES = BENCH / "investigations"
DEFAULT = "bench_peers"


def index() -> list[tuple[str, str]]:
    """(script, docs/benchmarks.md section) rows of benchmarks/README.md's tables of harnesses
    (script first) and of investigations (the figure first)."""
    text = (BENCH / "README.md").read_text()
    harnesses = re.findall(r"^\| `(\w+)\.py` \| ([^|]+) \|", text.split("\n## The peer harness")[0], re.M)
    rows = re.findall(r"^\| ([^|]+) \| `(\w+)\.py` \|", text, re.M)
    studies = [(name, figure) for figure, name in rows if not re.fullmatch(r"`\w+\.py`", figure)]
    return [(name, section.strip()) for name, section in harnesses + studies]


def resolve(name: str) -> Path | None:
    for stem in (name, f"bench_{name}"):
        for folder in (BENCH, STUDIES):
            if (folder / f"{stem}.py").is_file():
                return folder / f"{stem}.py"
    return None


def command(path: Path) -> tuple[list[str], dict[str, str]]:
    """How to start a benchmark: an investigation as a module, a harness by its path."""
    if path.parent == STUDIES:
        return [sys.executable, "-m", f"benchmarks.investigations.{path.stem}"], dict(os.environ)
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    return [sys.executable, str(path)], {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if argv[:1] == ["--list"]:
        for name, section in index():
            print(f"{name:20s} {section}")
        return 0
    name, rest = (DEFAULT, argv) if not argv or argv[0].startswith("-") else (argv[0], argv[1:])
    path = resolve(name)
    if path is None:
        names = ", ".join(n for n, _ in index())
        print(f"error: no benchmark {name!r} in benchmarks/ (one of: {names})", file=sys.stderr)
        return 2
    cmd, env = command(path)
    return subprocess.call([*cmd, *rest], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
