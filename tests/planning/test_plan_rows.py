"""The dry run's plan table says what is measured (issue 43): the "untiled it would be" row only
for a tiled plan, with a hint when the tiles plan more than untiled (a tile's own buffers outweigh
what it saves), and the KTO reference's progress counts examples, not pairs."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console

from horizon_cli.config import load_config
from horizon_cli.planning.ladder import plan_ladder
from horizon_cli.planning.tiling import WORK
from horizon_cli.store import Store
from horizon_cli.train.report import plan_table
from tests.conftest import write_config, write_jsonl


def _text(plan) -> str:
    c = Console(width=300, record=True)
    c.print(plan_table(plan))
    return c.export_text()


def test_the_untiled_row_and_its_hint(tmp_path, tiny_store):
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [3, 4, 5]}] * 4)
    plan = plan_ladder(load_config(write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "r")),
                       Store.open(tiny_store).arch)["exact"]  # fmt: skip
    work = plan.device[WORK]
    assert "untiled" not in _text(
        replace(plan, seq_tile=0, untiled_work=work)
    )  # was "(untiled; untiled it would be)"
    less = _text(replace(plan, seq_tile=512, untiled_work=2 * work))
    assert "(tiles of 512 tokens; untiled it would be)" in less
    more = _text(replace(plan, seq_tile=512, untiled_work=work // 2))
    assert "untiled it would be, less: a smaller engine.seq_tile or auto plans below it" in more


def test_the_kto_reference_counts_examples(tmp_path, tiny_store):
    from tests.conftest import horizon

    rows = [{"prompt": f"q {i}", "completion": f"a {i}", "label": i % 2 == 0} for i in range(4)]
    data = write_jsonl(tmp_path / "k.jsonl", rows)
    cfg = write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "run", preference={"loss": "kto"},
                       train={"steps": 1, "batch_size": 2, "micro_batch_size": 2})  # fmt: skip
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    bar = [ln for ln in r.output.splitlines() if ln.startswith("reference")]
    assert bar and all("examples" in ln and "pairs" not in ln for ln in bar), bar


def test_generate_and_export_of_a_hub_id_say_convert_it_first(tmp_path, monkeypatch):
    from tests.conftest import horizon

    monkeypatch.chdir(tmp_path)
    for args in (
        ("generate", "someorg/somemodel", "--prompt", "hi"),
        ("export", "someorg/somemodel", tmp_path / "out"),
    ):
        r = horizon(*args)
        lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert r.exit_code == 2 and len(lines) == 1, r.output
        assert "convert it first (horizon convert someorg/somemodel STORE)" in lines[0]
    r = horizon("generate", "no/such/path", "--prompt", "hi")
    assert r.exit_code == 2 and "no/such/path: not found" in r.output
