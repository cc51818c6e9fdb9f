"""Memory modes and architecture kinds are types (issue 38): a mode answers for itself, so another
mode value runs through the plan and the host state with no branch added; nothing in the package
compares a mode's name, and native specs are told from generic ones in one place (arch.kind)."""

from __future__ import annotations

import ast
import dataclasses
import io
import tokenize
from pathlib import Path

import torch

from horizon_cli.arch.kind import NATIVE
from horizon_cli.optim.modes import EXACT, LEAN, MODES, memory_mode
from horizon_cli.planning.memory import RUNGS, memory_plan
from horizon_cli.state.host import HostState
from tests.support.oracle import make_store

PKG = Path(__file__).resolve().parents[2] / "horizon_cli"


def sources() -> list[Path]:
    """The package's modules, its test support (tests/support) left out."""
    return [f for f in sorted(PKG.rglob("*.py")) if "testing" not in f.relative_to(PKG).parts]


def test_no_mode_is_named_outside_where_modes_are_defined():
    """The words "exact" and "lean" are string literals only in the modes and the state kinds."""
    allowed = {"optim/modes.py", "state/layout.py"}
    found = []
    for f in sources():
        rel = f.relative_to(PKG).as_posix()
        for tok in tokenize.generate_tokens(io.StringIO(f.read_text()).readline):
            if (
                tok.type == tokenize.STRING
                and tok.string.strip("\"'") in ("exact", "lean")
                and rel not in allowed
            ):
                found.append(f"{rel}:{tok.start[0]}")
    assert found == []


def test_native_and_generic_are_told_apart_in_one_place():
    """`<x>.generic is [not] None` appears once: ArchSpec.kind."""
    sites = []
    for f in sources():
        for node in ast.walk(ast.parse(f.read_text())):
            if (
                isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Attribute)
                and node.left.attr == "generic"
                and any(isinstance(op, ast.Is | ast.IsNot) for op in node.ops)
            ):
                sites.append(f.relative_to(PKG).as_posix())
    assert sites == ["arch/spec.py"]


def test_the_config_word_names_the_mode_and_the_ladder_lists_every_mode():
    assert memory_mode("lean") is LEAN and memory_mode(EXACT) is EXACT
    assert tuple(MODES) == ("exact", "lean")  # optim.memory's words; the ladder has each with release
    assert RUNGS[:4] == ("exact", "exact+release", "lean", "lean+release")
    assert (
        LEAN.grad_dtype("auto", "float32") == "bfloat16" and EXACT.grad_dtype("auto", "float32") == "float32"
    )
    assert LEAN.stream_dtype("float32") == "bfloat16" and EXACT.stream_dtype("float32") == "float32"


def test_another_mode_value_runs_through_plan_and_host_state_by_its_answers(tmp_path):
    """A copy of lean under another name is planned and held exactly as lean: nothing asks a
    mode's name; its checkpoint form is its own."""
    _, store = make_store(tmp_path)
    twin = dataclasses.replace(LEAN, name="lean-twin", form="lean-twin")
    assert store.arch.kind is NATIVE
    want, got = (
        memory_plan(store.arch, "float32", memory=LEAN),
        memory_plan(store.arch, "float32", memory=twin),
    )
    assert (got.host, got.device) == (want.host, want.device)

    def alloc(n: int, dt: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dt)

    a = HostState(store, torch.float32, alloc, memory=LEAN)
    b = HostState(store, torch.float32, alloc, memory=twin, shard=(1, 0))
    assert a.dtype == b.dtype == torch.bfloat16
    for name, ua in a.units.items():
        ub = b[name]
        assert ua.segments == ub.segments and ua.ranges == ub.ranges
        assert {k: (t.dtype, t.numel()) for k, t in ua.buffers().items()} == {
            k: (t.dtype, t.numel()) for k, t in ub.buffers().items()
        }
        assert torch.equal(ua.master(), ub.master())
    assert twin.reads("lean-twin") and not twin.reads(LEAN.form)
