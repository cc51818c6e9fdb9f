"""The README's examples run, and each docs page's first example is checked, so what a reader
copies works. The README's run (convert -> dry run -> train -> generate -> export, with its
sft.yaml) and its Python example run for real on a tiny model; a page's first example (the first
```bash / ```yaml / ```python / ```json block) is run where it can be offline in seconds, and
otherwise checked: a config block loads with horizon's config loader, a `horizon` command parses
with the CLI's own parser and the configs it names load, `make X` names a Makefile target, a
script named exists, Python compiles, JSON parses."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import click
import pytest
import typer
import yaml
from typer.testing import CliRunner

from horizon_cli.cli import app
from horizon_cli.config import load_config
from tests.conftest import chat_rows, store_with_tokenizer, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
EXAMPLE_LANGS = ("bash", "yaml", "python", "json")
NO_EXAMPLE = {"engine.md"}  # pictures of the engine only: no command or config to copy
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text(encoding="utf-8"))]


def first_example(path: Path) -> tuple[str, str] | None:
    return next(((lang, text) for lang, text in blocks(path) if lang in EXAMPLE_LANGS), None)


def commands(text: str) -> list[list[str]]:
    """A shell block -> one argv per command (continuation lines joined, `#` comments dropped)."""
    argvs = [shlex.split(line, comments=True) for line in text.replace("\\\n", " ").splitlines()]
    return [argv for argv in argvs if argv]


def horizon_args(argv: list[str]) -> list[str] | None:
    """The arguments after `horizon` (or `torchrun ... -m horizon_cli`); None for other commands."""
    if argv and Path(argv[0]).name == "horizon":
        return argv[1:]
    if argv and argv[0] == "torchrun" and "horizon_cli" in argv:
        return argv[argv.index("horizon_cli") + 1 :]
    return None


def cli(args: list[str]):
    return CliRunner().invoke(app, args, env={"COLUMNS": "200"})


def parse(args: list[str]) -> None:
    """Parse `horizon ARGS` with the CLI's own parser (options, types, arity), running nothing."""
    group = typer.main.get_command(app)
    name, *rest = [a for a in args if a != "--debug"]  # --debug: the one option before the command
    ctx = click.Context(group, info_name="horizon")
    command = group.get_command(ctx, name)
    assert command is not None, f"horizon {name}: no such command"
    command.make_context(name, rest, parent=ctx).close()


def check_command(argv: list[str]) -> None:
    """A command of a docs block: parses, and what it names is there."""
    args = horizon_args(argv)
    if args is not None:
        parse(args)
        for config in (a for a in args if a.startswith("configs/") and a.endswith(".yaml")):
            load_config(ROOT / config, [a for a in args if "=" in a and not a.startswith("-")])
    elif argv[0] == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
        assert set(argv[1:]) <= targets, f"{argv}: no such Makefile target"
    else:
        scripts = [a for a in argv if a.startswith("scripts/") or a.startswith("benchmarks/")]
        modules = [
            m
            for a, m in zip(argv, argv[1:], strict=False)
            if a == "-m" and m.split(".")[0] in ("scripts", "benchmarks")
        ]
        scripts += [m.replace(".", "/") + ".py" for m in modules]  # `python -m benchmarks.investigations.x`
        assert scripts, f"{argv}: not a command this test knows how to check"
        assert all((ROOT / s).exists() for s in scripts), argv


SECTIONS = {"model", "data", "train", "optim", "schedule", "engine", "lora", "preference", "rl", "output", "log"}  # fmt: skip
BASE = {"model": {"path": "stores/a"}, "data": {"path": "sft.jsonl"}, "output": {"dir": "runs/a"}}


def check_config_block(text: str) -> None:
    """A config (or a part of one: its sections over a minimal config) loads and validates."""
    raw = yaml.safe_load(text)
    assert set(raw) <= SECTIONS, f"not a config block: {sorted(raw)}"
    merged = {k: dict(v) for k, v in BASE.items()}
    for section, values in raw.items():
        merged.setdefault(section, {}).update(values or {})
    load_config(None, base=merged)


def check_example(lang: str, text: str) -> None:
    if lang == "bash":
        for argv in commands(text):
            check_command(argv)
    elif lang == "yaml":
        check_config_block(text)
    elif lang == "python":
        compile(text, "<example>", "exec")
    else:
        json.loads(text)


# --- the README ------------------------------------------------------------------------------


def _readme_block(lang: str, containing: str) -> str:
    return next(text for kind, text in blocks(README) if kind == lang and containing in text)


@pytest.fixture
def smollm2_stand_in(tmp_path, monkeypatch) -> Path:
    """A tiny Llama where `make demo` leaves SmolLM2 (.cache/smollm2/hf) and where the Python
    example reads it (hf/SmolLM2-135M-Instruct), the demo's facts and a chat file beside them,
    and the working directory there: the README's paths, unchanged."""
    store_with_tokenizer(tmp_path / ".cache" / "smollm2", max_position_embeddings=2048)
    shutil.copytree(tmp_path / ".cache" / "smollm2" / "hf", tmp_path / "hf" / "SmolLM2-135M-Instruct")
    facts = tmp_path / "horizon_cli" / "demo" / "facts.jsonl"
    facts.parent.mkdir(parents=True)
    shutil.copy(ROOT / "horizon_cli" / "demo" / "facts.jsonl", facts)
    write_jsonl(tmp_path / "sft.jsonl", chat_rows(16))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_run_end_to_end(smollm2_stand_in):
    """The README's run, command by command, with its sft.yaml as written (3 of its 24 steps)."""
    (smollm2_stand_in / "sft.yaml").write_text(_readme_block("yaml", "horizon_cli/demo/facts.jsonl"))
    run = commands(_readme_block("bash", "horizon convert"))
    assert [horizon_args(a)[0] for a in run] == ["convert", "train", "train", "generate", "export"]
    for argv in run:
        args = horizon_args(argv)
        r = cli(args + ["train.steps=3"] if args[0] == "train" else args)  # 3 of its 24 steps: seconds
        assert r.exit_code == 0, f"{shlex.join(argv)}:\n{r.output}"
    metrics = [json.loads(line) for line in Path("runs/sft/metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 3
    for hf in (Path("runs/sft/export"), Path("hf/sft")):
        assert (hf / "config.json").is_file() and any(hf.glob("*.safetensors"))


def test_readme_python_example_runs(smollm2_stand_in):
    example = _readme_block("python", "import horizon_cli.api")
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)
    assert scope["run"].final_loss > 0 and scope["plan"].host_bytes > 0
    assert (smollm2_stand_in / "hf" / "a" / "config.json").is_file()


def test_readme_other_blocks_are_checked():
    """Set-up and development commands name real targets and scripts; the CLI's table names
    every command the CLI has."""
    for lang, text in blocks(README):
        if lang == "bash" and "horizon convert" not in text:
            check_example(lang, text)
    listed = set(re.findall(r"^\| `horizon (\w+)", README.read_text(), re.M))
    assert listed == set(typer.main.get_command(app).list_commands(None))


def test_readme_links_one_page_per_topic():
    """Five minutes to read: the set-up commands early, one page per topic linked."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    setup = next(i for i, line in enumerate(text.splitlines()) if line.startswith("make demo"))
    assert setup < 30 and "make test" in text.splitlines()[setup + 1]
    for page in ("configs", "data", "alignment", "generation", "parallel", "memory", "architectures"):
        assert f"(docs/{page}.md" in text, page
    for page in ("reliability", "benchmarks", "engine", "store-format", "profile"):
        assert f"(docs/{page}.md" in text, page


# --- docs/*.md: each page's first example ------------------------------------------------------


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_first_example(page):
    example = first_example(page)
    if page.name in NO_EXAMPLE:
        assert example is None, f"{page.name} has an example now: take it out of NO_EXAMPLE"
        return
    assert example is not None, f"{page.name}: no ```bash, ```yaml, ```python or ```json example"
    check_example(*example)


def test_memory_page_dry_runs_run(tmp_path, monkeypatch):
    """docs/memory.md's first example, run: the demo config's dry runs on a tiny store (its
    model.path and output.dir moved to the test's)."""
    store = store_with_tokenizer(tmp_path)
    monkeypatch.chdir(ROOT)  # the demo config's data path is relative to the checkout
    for argv in commands(first_example(ROOT / "docs" / "memory.md")[1]):
        args = [*horizon_args(argv), f"model.path={store}", f"output.dir={tmp_path / 'run'}"]
        r = CliRunner().invoke(app, args, env={"COLUMNS": "200"}, catch_exceptions=False)
        assert r.exit_code == 0, f"{shlex.join(argv)}:\n{r.output}"
        assert "lean" in r.output


# --- links between the pages -------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_links_reach_their_page_and_heading():
    """Every relative markdown link of the README and docs/ names a file that exists and, with a
    #fragment, a heading of that file."""
    broken = []
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text(encoding="utf-8"))):
            if re.match(r"\w+:", target):
                continue  # http:, mailto:
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
