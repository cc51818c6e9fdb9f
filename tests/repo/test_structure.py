"""The package's shape: the import graph has no cycles and no upward imports (scripts/import_graph.py
names the layers), no module is over its length, and every folder of the package is a package that
an install includes and `make lint` checks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support import script

ROOT = Path(__file__).resolve().parents[2]
import_graph = script("import_graph")


def test_no_cycles_no_upward_imports_no_long_files():
    assert import_graph.problems() == []


def test_every_module_is_in_a_layer():
    parts = {import_graph.part(m) for m in import_graph.modules()}
    assert parts <= set(import_graph.RANK), parts - set(import_graph.RANK)


def test_every_package_folder_is_installed_and_linted():
    pkg = ROOT / "horizon_cli"
    folders = [d for d in pkg.rglob("*") if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))]
    assert folders
    missing = [str(d.relative_to(ROOT)) for d in folders if not (d / "__init__.py").is_file()]
    assert missing == []  # setuptools' find (pyproject) installs only folders with an __init__.py
    line = re.search(r"^exclude = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert line, "pyproject.toml names ruff's exclusions explicitly"
    exclude = set(ast.literal_eval(line.group(1)))
    assert not [d for d in folders if d.name in exclude]
