"""The package's import graph: cycles, upward imports, long files — and a drawing of the layers.

    python scripts/import_graph.py            # check: exit 1 with the problems, if any
    python scripts/import_graph.py --mermaid  # the package-level graph as a Mermaid flowchart

Every `import` counts, at module level or inside a function (a deferred import that hides a cycle
is still a cycle). The layers below are the architecture: a package may import its own modules and
those of lower layers, never a higher one; docs/engine.md draws them. tests/repo/test_structure.py runs
the same checks.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "horizon_cli"
MAX_LINES = 400

# lowest first; a name is a subpackage or a top-level module of horizon_cli, or a module of a
# subpackage that sits on a floor of its own (planning.ladder: the plans of every rung, LoRA's
# included, above lora, while the rest of planning/ is below it; planning.frozen_models, an rl
# run's forward-only models, streamed as a LoRA base is)
LAYERS: list[tuple[str, ...]] = [
    ("__init__", "quiet", "errors", "faults", "utf8", "fsutil", "owner", "fmt"),
    ("config", "quant", "optim", "parallel", "progress"),
    ("arch",),
    ("store",),
    ("data", "convert"),
    ("model", "runtime"),
    ("state",),
    ("planning",),
    ("lora",),  # LoRA/QLoRA in one place: targets, layer arithmetic, adapter state, plan, PEFT, export
    ("export", "planning.ladder", "planning.frozen_models"),
    ("engine",),
    ("vision",),  # images: the processor's data, the tower on the device, the merge before layer 0
    ("preflight", "inspect"),
    ("profile", "generate"),
    ("recipes",),  # training methods: one folder each (sft, preference, kto, grpo), one registry
    ("train",),
    ("api",),
    ("cli", "__main__"),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for f in sorted((root / PKG).rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports, anywhere in the file."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[: len(base) - node.level + 1]
                mod = ".".join(stem + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule; `from pkg import name` the package
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            targets = subs if len(subs) == len(node.names) else [mod, *subs]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, Path]]:
    mods = modules(root)
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}, mods


def part(mod: str) -> str:
    """The layer unit of a module: a module named in LAYERS, else its subpackage, or the top-level
    module's own name."""
    bits = mod.split(".")
    if ".".join(bits[1:3]) in RANK:
        return ".".join(bits[1:3])
    return bits[1] if len(bits) > 1 else "__init__"


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def problems(root: Path = ROOT) -> list[str]:
    g, mods = graph(root)
    out = []
    for comp in cycles(g):
        out.append("import cycle: " + " -> ".join(comp))
    pg: dict[str, set[str]] = defaultdict(set)
    for m, deps in g.items():
        for d in deps:
            if part(d) != part(m):
                pg[part(m)].add(part(d))
    for comp in cycles(pg):
        out.append("package cycle: " + " -> ".join(comp))
    for m, deps in sorted(g.items()):
        if part(m) not in RANK:
            out.append(f"{m}: {part(m)} is in no layer of scripts/import_graph.py")
            continue
        for d in sorted(deps):
            if part(d) in RANK and RANK[part(d)] > RANK[part(m)]:
                out.append(f"upward import: {m} ({part(m)}) imports {d} ({part(d)})")
    for _, f in sorted(mods.items()):
        n = len(f.read_text().splitlines())
        if n > MAX_LINES:
            out.append(f"{f.relative_to(root)}: {n} lines (more than {MAX_LINES})")
    return out


def node(name: str) -> str:
    """A layer unit as a Mermaid node: planning.ladder is drawn `planning_ladder["planning/ladder"]`."""
    return f'{name.replace(".", "_")}["{name.replace(".", "/")}"]' if "." in name else name


def mermaid(root: Path = ROOT) -> str:
    """The package-level graph, one subgraph per layer (highest first), edges to direct deps."""
    g, _ = graph(root)
    pg: dict[str, set[str]] = defaultdict(set)
    for m, deps in g.items():
        for d in deps:
            if part(d) != part(m):
                pg[part(m)].add(part(d))
    present = {part(m) for m in g}
    lines = ["flowchart TD"]
    for i in reversed(range(len(LAYERS))):
        names = [n for n in LAYERS[i] if n in present and n not in ("__init__", "__main__")]
        if names:
            lines.append(f"  subgraph L{i}[ ]")
            lines += [f"    {node(n)}" for n in names]
            lines.append("  end")
    for a in sorted(pg):
        for b in sorted(pg[a]):
            if "__init__" not in (a, b) and "__main__" not in (a, b):
                lines.append(f"  {node(a)} --> {node(b)}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mermaid", action="store_true", help="print the package graph as Mermaid")
    args = ap.parse_args()
    if args.mermaid:
        print(mermaid())
        return 0
    found = problems()
    for p in found:
        print(p)
    if not found:
        print(f"{len(modules())} modules: no cycles, no upward imports, none over {MAX_LINES} lines")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
