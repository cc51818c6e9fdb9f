"""The machinery of scripts/mutation_audit.py (the audit itself runs as `make audit`): its rows are
well formed and resolve against today's code, a mutant of a tiny function is caught, and an anchor
that no longer applies (the function moved, the line was rewritten) is reported `stale`, never
raised. A row going stale is a warning here, not a failure: a refactor that keeps behaviour keeps
`make test` green, and `make audit` lists what to re-anchor."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

from tests.support import script

AUDIT = script("mutation_audit")


def test_the_anchors_resolve_against_todays_code():
    ids = [m.id for m in AUDIT.MUTATIONS]
    assert len(ids) == len(set(ids)), "duplicate mutation ids"
    assert {m.id: p for m in AUDIT.MUTATIONS if (p := AUDIT.malformed(m))} == {}
    stale = {m.id: p for m in AUDIT.MUTATIONS if (p := AUDIT.problems(m))}
    if stale:
        warnings.warn(
            f"{len(stale)} stale rows in scripts/mutation_audit.yaml (make audit skips them): {stale}",
            stacklevel=1,
        )
    assert len(stale) < len(ids)  # the resolver finds the package's code at all


def tiny_project(root: Path) -> Path:
    """A package of two tiny functions and a test of one, laid out as the repository is."""
    (root / "tinypkg").mkdir(parents=True)
    (root / "tinypkg" / "__init__.py").write_text("")
    (root / "tinypkg" / "calc.py").write_text(
        "def add(a, b):\n    return a + b\n\n\ndef four(x):\n    return x + x + x + x\n"
    )
    (root / "tests").mkdir()
    (root / "tests" / "test_calc.py").write_text(
        "from tinypkg.calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    return root


def row(**over):
    fields = dict(
        id="add-sign", area="run", where="tinypkg.calc:add", pattern="a + b", mutated="a - b",
        tests=["tests/test_calc.py"], what="add subtracts",
    )  # fmt: skip
    return AUDIT.Mutation(**{**fields, **over})


def test_a_mutant_of_a_tiny_function_is_caught(tmp_path):
    root = tiny_project(tmp_path / "repo")
    before = (root / "tinypkg" / "calc.py").read_text()
    res = AUDIT.run_one(row(), timeout=300, ext_dir=tmp_path / "ext", py=sys.executable, root=root)
    assert res["result"] == "caught", res
    assert "test_add" in res["detail"]
    assert (root / "tinypkg" / "calc.py").read_text() == before  # restored


@pytest.mark.parametrize(
    "over, reason",
    [
        ({"where": "tinypkg.old:add"}, "no module tinypkg.old (the pattern is now in tinypkg.calc:add)"),
        ({"pattern": "a * b"}, "pattern found 0 times in tinypkg.calc:add"),
        ({"where": "tinypkg.calc:four", "pattern": "x + x"}, "pattern found 2 times in tinypkg.calc:four"),
    ],
    ids=["moved-to-another-module", "line-rewritten", "pattern-ambiguous"],
)
def test_a_stale_anchor_is_reported_not_raised(tmp_path, over, reason):
    root = tiny_project(tmp_path / "repo")
    m = row(**over)
    assert AUDIT.malformed(m) == []
    assert AUDIT.problems(m, root) == [reason]
    res = AUDIT.run_one(m, timeout=300, ext_dir=tmp_path / "ext", py=sys.executable, root=root)
    assert (res["result"], res["detail"]) == ("stale", reason)
