"""The benchmark runner: one benchmark of benchmarks/ by name, in a process of its own.

    .venv/bin/python scripts/bench.py                      # `make bench`: benchmarks/bench_peers.py
    .venv/bin/python scripts/bench.py --repeat 2 ...       # the same, with its options
    .venv/bin/python scripts/bench.py --list               # every benchmark and the section it feeds
    .venv/bin/python scripts/bench.py NAME [ARGS...]       # benchmarks/NAME.py (or bench_NAME.py) ARGS

NAME is a file of benchmarks/ without `.py`, the `bench_` prefix optional (`convert`, `bench_keep`,
`census_noise`). benchmarks/README.md is the index: which section of docs/benchmarks.md each
benchmark produces, and the command behind its figures.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
DEFAULT = "bench_peers"


def index() -> list[tuple[str, str]]:
    """(script, docs/benchmarks.md section) rows of benchmarks/README.md's first table."""
    first = (BENCH / "README.md").read_text().split("\n## ")[0]  # the harness's table follows
    rows = re.findall(r"^\| `(\w+)\.py` \| ([^|]+) \|", first, re.M)
    return [(name, section.strip()) for name, section in rows]


def resolve(name: str) -> Path | None:
    for stem in (name, f"bench_{name}"):
        if (BENCH / f"{stem}.py").is_file():
            return BENCH / f"{stem}.py"
    return None


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
    return subprocess.call([sys.executable, str(path), *rest], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
