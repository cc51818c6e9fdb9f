"""Every repository path named in the package's comments and docstrings, the README and docs/*.md
exists: a file moved or removed leaves no reader looking for it. A path is read relative to the
repository root, or to horizon_cli/ (comments inside the package write `engine/step.py`)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "horizon_cli"

# folders at the top of the repository: a path starting with one names a file of this repository
TOP = ("horizon_cli", "scripts", "benchmarks", "docs", "tests", "configs", "kernels")
# the package's subpackages: `engine/step.py` in a comment names horizon_cli/engine/step.py
SUBPACKAGES = tuple(sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
EXTENSIONS = "py|md|yaml|yml|json|jsonl|sh|cpp|h|toml|svg|png|txt"

# `docs/data.md`, `horizon_cli/engine/`, `tests/test_pref_*.py`; for a subpackage, .py files and
# folders only (`data/sft.jsonl` in an example is the user's file, not the package's)
_SEG = r"[A-Za-z0-9_.*-]+"
TOP_PATH = re.compile(rf"(?<![\w/.<>-])(?:{'|'.join(TOP)})/(?:{_SEG}/)*(?:{_SEG}\.(?:{EXTENSIONS})\b)?")
SUB_PATH = re.compile(rf"(?<![\w/.<>-])(?:{'|'.join(SUBPACKAGES)})/(?:{_SEG}/)*{_SEG}\.py\b")

# paths in other projects' trees, named where the docs credit them (same first folder as ours)
OTHER_PROJECTS = {
    "optim/adam.py",  # torchao
    "utils/save_and_load.py",  # PEFT
    "models/convert_weights.py",  # torchtune
    "modules/peft/lora.py",  # torchtune
}


def _comment_lines(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings (every string token) of one module, with their first line."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return [(t.start[0], t.string) for t in tokens if t.type in (tokenize.COMMENT, tokenize.STRING)]


def _sources() -> dict[str, list[tuple[int, str]]]:
    """File (relative to the root) -> (line, text) pieces that may name paths."""
    texts = {str(p.relative_to(ROOT)): _comment_lines(p) for p in sorted(PACKAGE.rglob("*.py"))}
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "kernels" / "README.md"]
    docs += [ROOT / "pyproject.toml", *sorted((ROOT / "configs").glob("*.yaml"))]
    for doc in docs:
        lines = doc.read_text(encoding="utf-8").splitlines()
        texts[str(doc.relative_to(ROOT))] = list(enumerate(lines, 1))
    return texts


def _named_paths(text: str) -> list[tuple[int, str]]:
    """(line offset in text, path) for each repository path text names."""
    found = [*TOP_PATH.finditer(text), *SUB_PATH.finditer(text)]
    named = [(text.count("\n", 0, m.start()), m.group(0).rstrip(".")) for m in found]
    return sorted({(at, path) for at, path in named if path not in OTHER_PROJECTS})


def _missing() -> list[str]:
    """`file:line: path` for every named path that is not there."""
    return [
        f"{where}:{line + at}: {path}"
        for where, pieces in _sources().items()
        for line, text in pieces
        for at, path in _named_paths(text)
        if not _exists(path, where)
    ]


def _exists(path: str, named_in: str) -> bool:
    bases = [ROOT, PACKAGE, (ROOT / named_in).parent]
    if "*" in path:
        return any(any(base.glob(path)) for base in bases)
    return any((base / path).exists() for base in bases)


def test_the_scanner_finds_paths():
    """The patterns match what the docs write, and skip the user's own files."""
    text = "see `engine/step.py`, docs/data.md#formats, tests/test_pref_*.py and data/sft.jsonl."
    assert {p for _, p in _named_paths(text)} == {"engine/step.py", "docs/data.md", "tests/test_pref_*.py"}
    assert _named_paths("<output.dir>/checkpoints/step_N/ and runs/a/export") == []
    assert _named_paths("one\ntwo scripts/x.py") == [(1, "scripts/x.py")]
    assert len(_sources()) > 100


def test_every_named_path_exists():
    missing = _missing()
    assert not missing, f"{len(missing)} paths named that do not exist:\n" + "\n".join(missing)
