"""The typing ratchet (issue 38): mypy's disallow_untyped_defs stays on for the engine, the recipes
and vision; `# type: ignore` stays at 10 or fewer in the package; no `Any` in the seams between
engine parts. Read from the sources (no mypy run), so a change that slides back fails here."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "horizon_cli"
STRICT = ("engine", "recipes", "vision")  # packages every def of which is annotated
MAX_IGNORES = 10
# the modules that implement engine/seams.py's Protocols (its docstring names them)
IMPLEMENTERS = (
    "engine/*.py",
    "model/template.py",
    "model/generic.py",
    "runtime/transport.py",
    "runtime/cuda.py",
    "runtime/loader.py",
    "vision/embed.py",
    "recipes/*/loss.py",
    "generate/decode.py",
)


def _comments(path: Path) -> list[str]:
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [t.string for t in toks if t.type == tokenize.COMMENT]


def test_type_ignores_stay_few():
    found = [
        f"{f.relative_to(ROOT)}: {c}"
        for f in sorted(PKG.rglob("*.py"))
        for c in _comments(f)
        if "type: ignore" in c
    ]
    assert len(found) <= MAX_IGNORES, "\n".join(found)


def test_pyproject_keeps_disallow_untyped_defs_on_the_strict_packages():
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    strict = {
        m
        for o in mypy.get("overrides", [])
        if o.get("disallow_untyped_defs") is True
        for m in ([o["module"]] if isinstance(o["module"], str) else o["module"])
    }
    if mypy.get("disallow_untyped_defs") is True:
        strict.add("horizon_cli.*")
    for name in STRICT:
        assert {f"horizon_cli.{name}.*", "horizon_cli.*"} & strict, f"horizon_cli.{name}.* is not strict"


def _unannotated(path: Path) -> list[str]:
    """Defs with a parameter (beyond a method's self / cls) or a return without an annotation
    (an __init__ may leave its return out when it annotates a parameter, as mypy allows)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
        bare = [p.arg for p in params if p.annotation is None and p.arg not in ("self", "cls")]
        init_ok = node.name == "__init__" and len(params) > 1
        if bare or (node.returns is None and not init_ok):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {bare or '-> ?'}")
    return out


def test_every_def_in_the_strict_packages_is_annotated():
    files = [f for name in STRICT for f in sorted((PKG / name).rglob("*.py"))]
    assert files
    assert [u for f in files for u in _unannotated(f)] == []


def _names_any(node: ast.AST | None) -> bool:
    return node is not None and any(
        (isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any")
        for n in ast.walk(node)
    )


def _seam_methods() -> set[str]:
    tree = ast.parse((PKG / "engine" / "seams.py").read_text())
    protocols = [
        c
        for c in tree.body
        if isinstance(c, ast.ClassDef) and any("Protocol" in ast.unparse(b) for b in c.bases)
    ]
    assert len(protocols) >= 8
    return {f.name for c in protocols for f in c.body if isinstance(f, ast.FunctionDef)}


def test_no_any_in_the_seams_between_engine_parts():
    seams = (PKG / "engine" / "seams.py").read_text()
    assert not _names_any(ast.parse(seams))
    methods = _seam_methods() - {"__call__"}
    found = []
    for pattern in IMPLEMENTERS:
        for f in sorted(PKG.glob(pattern)):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.FunctionDef) and node.name in methods:
                    a = node.args
                    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
                    if any(_names_any(p.annotation) for p in params) or _names_any(node.returns):
                        found.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert found == []
