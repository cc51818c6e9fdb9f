"""The test tiers (docs/benchmarks.md, "The test tiers"): `make test` runs the fast tier (pyproject's
addopts), `make test-slow` the slow tier, `make test-full` both, and .ci/run runs `make test` then
`make test-slow`. Every test is in exactly one tier unless it carries an opt-in marker (gpu, smollm2,
gemma3, census: the README says how to run those), so CI runs the whole suite, each test once, and nothing
falls through; the mutation audit runs its rows' tests in both tiers."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from _pytest.mark.expression import Expression

from tests.support import script

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
MAKEFILE = (ROOT / "Makefile").read_text()


def fast_expr() -> str:
    """The -m of pyproject's addopts: what a bare `pytest` (and `make test`) selects."""
    opts = shlex.split(PYPROJECT["addopts"])
    return opts[len(opts) - 1 - opts[::-1].index("-m") + 1]


def make_var(name: str) -> str:
    return re.search(rf"^{name}\s*:=\s*(.+)$", MAKEFILE, re.M).group(1).strip()


def recipe_expr(target: str) -> str:
    """The -m of a Makefile target's pytest line, with $(OPT_IN) expanded."""
    recipe = re.search(rf"^{target}:.*\n\t(.+)$", MAKEFILE, re.M).group(1)
    args = shlex.split(recipe.replace("$(OPT_IN)", make_var("OPT_IN")))
    assert args[0] == "$(PYTEST)", recipe  # the same pytest flags as `make test`
    return args[args.index("-m") + 1]


def selects(expr: str, marks: set[str]) -> bool:
    return Expression.compile(expr).evaluate(lambda name, **_: name in marks)


def opt_in() -> set[str]:
    names = set(re.findall(r"not (\w+)", make_var("OPT_IN")))
    assert names == {"gpu", "smollm2", "gemma3", "census"}, names  # the README's opt-in runs
    return names


def tier(marks: set[str]) -> str:
    """Where a test with these markers runs: opt-in (no tier), else slow or fast."""
    return "opt-in" if marks & opt_in() else "slow" if "slow" in marks else "fast"


def check(marks: set[str]) -> None:
    fast, slow, full = (
        selects(e, marks) for e in (fast_expr(), recipe_expr("test-slow"), recipe_expr("test-full"))
    )
    want = tier(marks)
    assert (fast, slow) == (want == "fast", want == "slow"), (sorted(marks), fast, slow)
    assert full == (fast or slow), sorted(marks)


def test_every_marker_combination_is_in_one_tier_or_opt_in():
    registered = {line.split(":")[0] for line in PYPROJECT["markers"]}
    names = sorted(registered | {"parametrize"})  # and a marker that is no tier's business
    for n in range(len(names) + 1):
        for combo in itertools.combinations(names, n):
            check(set(combo))


def test_ci_runs_both_tiers_and_the_audit_both():
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    makes = [ln for ln in lines if ln.startswith("make ")]
    assert makes == ["make test", "make test-slow"]
    assert recipe_expr("test-full") == script("mutation_audit").FULL_TIER
    assert "make test-full" in (ROOT / "README.md").read_text()


DUMP = """
import json, os

def pytest_collection_modifyitems(config, items):
    rows = [[i.nodeid, sorted({m.name for m in i.iter_markers()})] for i in items]
    with open(os.environ["TIERS_OUT"], "w") as f:
        json.dump(rows, f)
"""


@pytest.mark.slow  # collects the whole suite in a subprocess (~12 s of CPU): CI's slow tier runs it
def test_the_collection_splits_into_the_tiers_and_the_audit_tests_run(tmp_path):
    (tmp_path / "tiers_dump.py").write_text(DUMP)
    out = tmp_path / "items.json"
    env = {**os.environ, "TIERS_OUT": str(out), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "tiers_dump",
        "-m",
        "",
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    items = {nodeid: set(marks) for nodeid, marks in json.loads(out.read_text())}
    assert len(items) > 1000
    for marks in {frozenset(m) for m in items.values()}:
        check(set(marks))
    from tests.conftest import in_slow_tier, slow_tier_ids

    for line in slow_tier_ids():  # the measured slow tier: each line still names a test, marked slow
        named = [i for i in items if in_slow_tier(i, line)]
        assert named, f"tests/slow_tier.txt: {line} names no test"
        assert all("slow" in items[i] for i in named), line
    in_a_tier = {i for i, m in items.items() if tier(m) != "opt-in"}
    for row in script("mutation_audit").MUTATIONS:
        for test in row.tests:
            ran = [i for i in in_a_tier if i == test or i.startswith((test + "::", test + "[", test + "/"))]
            assert ran, f"mutation audit row {row.id}: {test} runs in no tier"
