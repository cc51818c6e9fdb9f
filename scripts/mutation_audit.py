"""Mutation audit: does the test suite catch realistic one-line bugs in the core paths?

    make audit                     # = .venv/bin/python scripts/mutation_audit.py --json bench_out/audit.json
    .venv/bin/python scripts/mutation_audit.py [--only ID,...] [--area AREA] [--list] [--json FILE]

Each row of scripts/mutation_audit.yaml (the table; this file is the tool that reads and runs it)
is one line of production code replaced by a plausible bug (off-by-one,
wrong sign, dropped term, wrong buffer, swapped arguments, missing scale, wrong dtype), with the
tests that ought to catch it. For each in turn the script edits the file in place, runs those
tests (`pytest -x`, stopping at the first failure), restores the file (also on Ctrl-C), and
records `caught` (a test failed: the first one is named), `survived` (every selected test
passed) or `timeout`. Mutations of the native kernel rebuild it into a scratch
TORCH_EXTENSIONS_DIR, so the user's kernel cache is never touched.

A row is anchored on what it mutates, not on a file's text: `where` names a function (its
qualified name in a module, `horizon_cli.model.layer:rms_norm`, `...:Class.method`; a module-level
name such as a constant; or `kernels/adamw.cpp:make_coeffs`, a C++ function), and `pattern` is
text that occurs exactly once in that function's source, any run of whitespace matching any run
(so a reformatted line still matches). A refactor that keeps the code where the row says leaves the
row applicable; one that moves it to another function or module, or rewrites the line, makes the
row `stale`: it is listed as such (with the places the pattern now occurs, when the function moved
under its own name) and tests nothing, and the audit's exit status does not count it. Re-anchor a
stale row when convenient. tests/repo/test_mutation_audit.py (in `make test`) checks only the machinery:
every row well formed, the anchors resolved (stale ones reported as a warning), a mutant of a tiny
function caught, a stale anchor reported rather than raised.

`--without FILE,...` drops test files from every selection (a mutation left with none is skipped):
run with the files a change added, it shows what the suite caught before them.

An `expect` of "equivalent" marks a mutant that cannot change any result on this machine's code
paths (the reason is in its note); such mutants are run too and are expected to survive. The
results and their reading are recorded in docs/reliability.md ("Mutation audit").

The working tree must be clean in the files mutated (the script refuses otherwise), and nothing
else should edit them while it runs.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ROWS = Path(__file__).with_suffix(".yaml")  # the table: scripts/mutation_audit.yaml
NATIVE = (".c", ".cc", ".cpp", ".cu", ".h", ".hpp")
# a row's tests run in both tiers (`make test-full`'s markers): a test moved to the slow tier still counts
FULL_TIER = "not gpu and not smollm2 and not gemma3 and not census"


@dataclass
class Mutation:
    id: str
    area: str  # engine | optim | data | checkpoint | run
    where: str  # "package.module:qualname" (a function, method or module-level name) or "file.cpp:function"
    pattern: str  # occurs exactly once in that function's source (whitespace runs match any whitespace)
    mutated: str  # what replaces it
    tests: list[str]
    what: str  # the bug, in words
    expect: str = "caught"  # or "equivalent"
    note: str = ""


@dataclass(frozen=True)
class Site:
    """Where a row's pattern is today: file (relative to the root), its text, the span replaced."""

    file: str
    text: str
    start: int
    end: int

    def mutant(self, mutated: str) -> str:
        line_start = self.text.rfind("\n", 0, self.start) + 1
        indent = re.match(r"[ \t]*", self.text[line_start:]).group(0)
        body = mutated.strip().replace("\n", "\n" + indent)  # later lines at the matched line's indent
        return self.text[: self.start] + body + self.text[self.end :]


class Stale(Exception):
    """A row whose anchor no longer applies to the code (the reason is the message)."""


def regex(pattern: str) -> re.Pattern:
    return re.compile(r"\s+".join(re.escape(p) for p in pattern.split()))


def module_file(module: str, root: Path) -> Path:
    base = root.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    raise Stale(f"no module {module}")


def py_spans(tree: ast.Module) -> dict[str, ast.AST]:
    """Qualified name -> node: every function and class (nested: outer.inner), and the names that
    module-level assignments bind."""
    out: dict[str, ast.AST] = {}

    def walk(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out[prefix + node.name] = node
                walk(node.body, f"{prefix}{node.name}.")
            elif not prefix and isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node

    walk(tree.body, "")
    return out


def offsets(text: str, node: ast.AST) -> tuple[int, int]:
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return starts[first - 1], starts[node.end_lineno]


def native_span(text: str, name: str) -> tuple[int, int] | None:
    """The definition of C++ function `name`: from its name to its closing brace."""
    for m in re.finditer(rf"\b{re.escape(name)}\s*\(", text):
        head = re.match(r"[^;{]*", text[m.end() :]).group(0)
        at = m.end() + len(head)
        if at >= len(text) or text[at] != "{":
            continue  # a call or a declaration
        depth = 0
        for i in range(at, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text.rfind("\n", 0, m.start()) + 1, i + 1
    return None


def scope(where: str, root: Path) -> tuple[str, str, int, int]:
    """(file relative to root, its text, start, end) of the function `where` names."""
    mod, _, qual = where.partition(":")
    if not qual:
        raise Stale(f"anchor {where!r} is not module:function")
    if mod.endswith(NATIVE):
        path = root / mod
        if not path.is_file():
            raise Stale(f"no file {mod}")
        text = path.read_text()
        span = native_span(text, qual)
        if span is None:
            raise Stale(f"no function {qual} in {mod}")
        return mod, text, *span
    path = module_file(mod, root)
    text = path.read_text()
    node = py_spans(ast.parse(text, str(path))).get(qual)
    if node is None:
        raise Stale(f"no {qual} in {mod}")
    return str(path.relative_to(root)), text, *offsets(text, node)


def locate(m: Mutation, root: Path = ROOT) -> Site:
    """Where m's pattern is today; raises Stale (with the reason) when the row no longer applies."""
    try:
        file, text, a, b = scope(m.where, root)
    except Stale as e:
        raise Stale(f"{e}{moved_hint(m, root)}") from None
    found = list(regex(m.pattern).finditer(text, a, b))
    if len(found) != 1:
        raise Stale(
            f"pattern found {len(found)} times in {m.where}{moved_hint(m, root) if not found else ''}"
        )
    site = Site(file, text, found[0].start(), found[0].end())
    if file.endswith(".py"):
        try:
            ast.parse(site.mutant(m.mutated))
        except SyntaxError as e:
            raise Stale(f"the mutant does not parse: {e}") from None
    return site


def moved_hint(m: Mutation, root: Path) -> str:
    """Where the pattern occurs once in a function of the same name elsewhere in the package."""
    mod, _, qual = m.where.partition(":")
    if mod.endswith(NATIVE) or not qual:
        return ""
    pkg = mod.split(".")[0]
    name = qual.rpartition(".")[2]
    seen = []
    for f in sorted((root / pkg).rglob("*.py")):
        dotted = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        try:
            spans = py_spans(ast.parse(f.read_text()))
        except SyntaxError:
            continue
        text = f.read_text()
        for q, node in spans.items():
            if q.rpartition(".")[2] == name and f"{dotted}:{q}" != m.where:
                a, b = offsets(text, node)
                if len(list(regex(m.pattern).finditer(text, a, b))) == 1:
                    seen.append(f"{dotted}:{q}")
    return f" (the pattern is now in {', '.join(seen)})" if seen else ""


def problems(m: Mutation, root: Path = ROOT) -> list[str]:
    """Why row m tests nothing today (empty: it applies). Never raises."""
    out = []
    try:
        locate(m, root)
    except Stale as e:
        out.append(str(e))
    for t in m.tests:
        fname, _, func = t.partition("::")
        tf = root / fname
        if not tf.is_file():
            out.append(f"test file {fname} does not exist")
        elif func and not re.search(rf"^(async )?def {re.escape(func)}\(", tf.read_text(), re.M):
            out.append(f"{fname} has no test {func}")
    return out


def malformed(m: Mutation) -> list[str]:
    """What is wrong with the row itself, whatever the code (an audit edit fixes it)."""
    out = []
    if ":" not in m.where:
        out.append("where is not module:function")
    if " ".join(m.mutated.split()) == " ".join(m.pattern.split()):
        out.append("mutated equals pattern")
    if not m.tests:
        out.append("names no test")
    if m.expect not in ("caught", "equivalent"):
        out.append(f"expect {m.expect!r}")
    elif m.expect == "equivalent" and not m.note:
        out.append("an equivalent mutant needs a note saying why")
    return out


def load_rows(path: Path = ROWS) -> list[Mutation]:
    """The table's rows, each a Mutation (a key missing or unknown fails loudly)."""
    return [Mutation(**row) for row in yaml.safe_load(path.read_text())]


MUTATIONS: list[Mutation] = load_rows()


def run_one(m: Mutation, timeout: int, ext_dir: Path, py: str, root: Path = ROOT) -> dict:
    """Apply m, run its tests in `root`, restore the file: the row and its result."""
    why = problems(m, root)
    if why:
        return {**asdict(m), "result": "stale", "detail": "; ".join(why)}
    site = locate(m, root)
    path = root / site.file
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if site.file.endswith(NATIVE):
        env["TORCH_EXTENSIONS_DIR"] = str(ext_dir)  # a mutant kernel never lands in the user's cache
    cmd = [py, "-m", "pytest", "-x", "-p", "no:cacheprovider", "-m", FULL_TIER, *m.tests]
    t0 = time.time()
    path.write_text(site.mutant(m.mutated))
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        out = r.stdout + r.stderr
        if r.returncode == 0:
            result, detail = "survived", _summary(out)
        elif r.returncode == 1:
            failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
            result, detail = "caught", failed[0] if failed else _summary(out)
        else:
            result, detail = "error", f"pytest exit {r.returncode}: {_summary(out)}"
    except subprocess.TimeoutExpired:
        result, detail = "timeout", f"no verdict within {timeout} s"
    finally:
        path.write_text(site.text)
    return {
        **asdict(m),
        "file": site.file,
        "result": result,
        "detail": detail,
        "seconds": round(time.time() - t0, 1),
    }


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _summary(out: str) -> str:
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated mutation ids")
    ap.add_argument("--area", help="engine | optim | data | checkpoint | run")
    ap.add_argument("--list", action="store_true", help="list the mutations (stale ones marked) and exit")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutation")
    ap.add_argument(
        "--without",
        help="comma-separated test files left out of every selection (to see what the rest of the suite catches)",
    )
    args = ap.parse_args()
    todo = [m for m in MUTATIONS if (not args.area or m.area == args.area)]
    if args.without:
        drop = set(args.without.split(","))
        todo = [replace(m, tests=[t for t in m.tests if t.split("::")[0] not in drop]) for m in todo]
        todo = [m for m in todo if m.tests]
    if args.only:
        ids = set(args.only.split(","))
        unknown = ids - {m.id for m in MUTATIONS}
        if unknown:
            print(f"error: unknown mutation id(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        todo = [m for m in todo if m.id in ids]
    bad = {m.id: p for m in todo if (p := malformed(m))}
    if bad:
        print(f"error: malformed rows: {bad}", file=sys.stderr)
        return 2
    stale = {m.id: p for m in todo if (p := problems(m))}
    if args.list:
        for m in todo:
            flag = f"STALE: {'; '.join(stale[m.id])}  " if m.id in stale else ""
            print(f"{m.id:26s} {m.area:10s} {flag}{m.where}: {m.what}")
        print(f"{len(todo) - len(stale)} applicable, {len(stale)} stale")
        return 0
    files = sorted({locate(m).file for m in todo if m.id not in stale})
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", *files], cwd=ROOT, capture_output=True, text=True
    ).stdout
    if dirty.strip():
        print(f"error: uncommitted changes in files to mutate:\n{dirty}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # restore the file being mutated, as on Ctrl-C
    results = []
    with tempfile.TemporaryDirectory(prefix="horizon-mutants-") as ext:
        for i, m in enumerate(todo, 1):
            res = run_one(m, args.timeout, Path(ext), sys.executable)
            results.append(res)
            unexpected = res["result"] != "stale" and (res["result"] == "caught") != (m.expect == "caught")
            print(
                f"[{i:3d}/{len(todo)}] {m.id:26s} {res['result']:8s} {res.get('seconds', 0):6.1f}s  {res['detail']}"
                + ("   <-- unexpected" if unexpected else ""),
                flush=True,
            )
            if args.json:  # written as it goes: a long audit keeps what it has
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1))
    counts = {
        k: sum(r["result"] == k for r in results) for k in ("caught", "survived", "timeout", "error", "stale")
    }
    print("; ".join(f"{v} {k}" for k, v in counts.items() if v))
    if counts["stale"]:
        print(
            f"stale (re-anchor when convenient): {', '.join(r['id'] for r in results if r['result'] == 'stale')}"
        )
    unexpected = [
        r["id"]
        for r in results
        if r["result"] != "stale" and (r["result"] == "caught") != (r["expect"] == "caught")
    ]
    if unexpected:
        print(f"unexpected: {', '.join(unexpected)}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
