"""scripts/mutation_audit.py stays applicable: every mutation's `original` occurs exactly once in
its file (else the audit reports it `stale` and tests nothing), its mutant still parses, and every
test it names exists. Runs in well under a second; it fails as soon as a change moves mutated code
without updating the audit."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_audit():
    spec = importlib.util.spec_from_file_location("mutation_audit", ROOT / "scripts" / "mutation_audit.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being defined
    spec.loader.exec_module(mod)
    return mod


AUDIT = load_audit()


def problems(m) -> list[str]:
    """What makes mutation m inapplicable (empty: it is fine)."""
    path = ROOT / m.file
    if not path.is_file():
        return [f"{m.file} does not exist"]
    text = path.read_text()
    out = []
    n = text.count(m.original)
    if n != 1:
        out.append(f"original found {n} times in {m.file}")
    if m.mutated == m.original:
        out.append("mutated equals original")
    if n == 1 and m.file.endswith(".py"):
        try:
            ast.parse(text.replace(m.original, m.mutated))
        except SyntaxError as e:
            out.append(f"the mutant does not parse: {e}")
    if not m.tests:
        out.append("names no test")
    for t in m.tests:
        fname, _, func = t.partition("::")
        tf = ROOT / fname
        if not tf.is_file():
            out.append(f"test file {fname} does not exist")
        elif func and not re.search(rf"^def {re.escape(func)}\(", tf.read_text(), re.M):
            out.append(f"{fname} has no test {func}")
    if m.expect not in ("caught", "equivalent"):
        out.append(f"expect {m.expect!r}")
    elif m.expect == "equivalent" and not m.note:
        out.append("an equivalent mutant needs a note saying why")
    return out


def test_every_mutation_applies_to_todays_code():
    ids = [m.id for m in AUDIT.MUTATIONS]
    assert len(ids) == len(set(ids)), "duplicate mutation ids"
    bad = {m.id: p for m in AUDIT.MUTATIONS if (p := problems(m))}
    assert not bad, f"stale mutations in scripts/mutation_audit.py: {bad}"


@pytest.mark.parametrize(
    "change",
    [
        {"original": "this line is in no file of horizon"},
        {"tests": ["tests/test_no_such_file.py"]},
        {"tests": ["tests/test_engine_parity.py::test_no_such_test"]},
        {"mutated": "return (("},
    ],
)
def test_a_stale_mutation_is_reported(change):
    """The check itself can fail: a mutation whose line moved, or whose tests were renamed."""
    from dataclasses import replace

    m = next(m for m in AUDIT.MUTATIONS if m.id == "rmsnorm-eps")
    assert problems(m) == []
    assert problems(replace(m, **change))
