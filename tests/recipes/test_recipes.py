"""Training methods as recipes (horizon_cli/recipes): the registry picks one from the config and
checks the data against it with the lines the train loop gave before; train/ and engine/ name no
method; a recipe added to the registry alone (its own objective, metrics and payload) trains
through `horizon train` with no branch anywhere else; each payload's eval filler."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from horizon_cli.config import Config
from horizon_cli.config.schema import DataConfig, PreferenceConfig, RewardConfig, RLConfig
from horizon_cli.data import PreparedData
from horizon_cli.data.batch import IGNORE, MicroBatch
from horizon_cli.data.pairs import PairPayload
from horizon_cli.engine.objective import SequenceObjective, Targets
from horizon_cli.errors import InputError
from horizon_cli.recipes import registry
from horizon_cli.recipes.grpo.loss import GRPOPayload
from horizon_cli.recipes.sft.batches import SftBatches
from horizon_cli.recipes.sft.recipe import Sft
from tests.conftest import chat_rows, write_config, write_jsonl

PKG = Path(__file__).resolve().parents[2] / "horizon_cli"


def _cfg(preference: str | None = None, rl: bool = False) -> Config:
    return Config(
        data=DataConfig(path="data.jsonl"),
        preference=PreferenceConfig(loss=preference) if preference else None,
        rl=RLConfig(rewards=[RewardConfig(function="length", target=2)]) if rl else None,
    )


def _data(fmt: str) -> PreparedData:
    return PreparedData(None, None, fmt, 0)  # the checks read its format only


def test_the_registry_picks_the_configs_method():
    cfgs = {"rl": _cfg(rl=True), "kto": _cfg("kto"), "dpo": _cfg("dpo"), "orpo": _cfg("orpo"), "none": _cfg()}
    names = {k: registry.recipe_for(c).name for k, c in cfgs.items()}
    assert names == {"rl": "grpo", "kto": "kto", "dpo": "preference", "orpo": "preference", "none": "sft"}


KTO_HINT = "holds unpaired preference examples (label or kto_tag); train them with preference: {loss: kto}"
PAIRS_HINT = "holds preference pairs (format preference); add a preference: section to train on them"
KTO_REFUSAL = (
    "preference.loss: kto trains on unpaired preference examples (label or kto_tag); "
    "data.path data.jsonl is format preference"
)
IPO_REFUSAL = (
    "preference.loss: ipo trains on preference pairs (chosen, rejected); data.path data.jsonl "
    "is format chat (data.format: preference reads pairs)"
)


@pytest.mark.parametrize(
    "cfg,fmt,line",
    [
        (_cfg(), "unpaired", KTO_HINT),
        (_cfg("dpo"), "unpaired", KTO_HINT),
        (_cfg(), "preference", PAIRS_HINT),
        (_cfg("kto"), "preference", KTO_REFUSAL),
        (_cfg("ipo"), "chat", IPO_REFUSAL),
    ],
)
def test_data_of_another_method_is_refused_with_the_loops_old_lines(cfg, fmt, line):
    with pytest.raises(InputError) as e:
        registry.checked(cfg, _data(fmt))
    assert line in str(e.value)


@pytest.mark.parametrize(
    "cfg,fmt", [(_cfg(), "chat"), (_cfg("dpo"), "preference"), (_cfg("kto"), "unpaired")]
)
def test_data_of_the_methods_own_form_passes(cfg, fmt):
    assert registry.checked(cfg, _data(fmt)) is registry.recipe_for(cfg)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add("." * node.level + node.module)
    return out


def test_train_and_engine_name_no_method():
    """engine/ imports no recipe; train/ only the registry and the seam, never a method's folder."""
    for f in (PKG / "engine").glob("*.py"):
        assert not [m for m in _imports(f) if "recipes" in m], f.name
    for f in (PKG / "train").glob("*.py"):
        bad = [
            m for m in _imports(f) if "recipes" in m and m not in ("..recipes.registry", "..recipes.recipe")
        ]
        assert bad == [], f.name


def test_each_payloads_eval_filler():
    """MicroBatch.unlabelled: no labels; an rl micro-batch's rows (its loss's divisor) 0, a pair
    payload's global counts kept (its pairs are invalid, so they add nothing)."""
    mb = MicroBatch.from_rows([([1, 2, 3], [IGNORE, 2, 3]), ([4, 5], [IGNORE, 5])], 0)
    mb.payload = GRPOPayload(torch.tensor([0.5, -0.5]), 2, torch.zeros(3))
    out = mb.unlabelled()
    assert (out.labels == IGNORE).all() and out.label_tokens == 0
    assert isinstance(out.payload, GRPOPayload) and out.payload.rows == 0 and mb.payload.rows == 2
    assert torch.equal(out.payload.adv, mb.payload.adv) and torch.equal(out.input_ids, mb.input_ids)
    pairs = PairPayload(pairs=3, chosen_tokens=7, chosen_seq_tokens=9)
    assert pairs.unlabelled() == pairs


class _TwoPassCE(SequenceObjective):
    """Cross-entropy through the two-pass sequence path, with a stat of its own."""

    name = "two-pass-ce"

    def loss(
        self, logps: list[torch.Tensor], targets: list[Targets]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        total = -torch.cat(logps).sum()
        return total, {"nll_sum": total.detach()}


class _TwoPassBatches(SftBatches):
    def __init__(self, cfg: Config, data: PreparedData):
        super().__init__(cfg, data)
        self.objective = _TwoPassCE()

    def metrics(self, stats: dict[str, float], n: int, prefix: str = "") -> dict[str, float | None]:
        return {prefix + "nll_mean": stats["nll_sum"] / n if n else None}


class _TwoPass(Sft):
    name = "two-pass"

    def batches(self, cfg: Config, data: PreparedData) -> SftBatches:
        return _TwoPassBatches(cfg, data)


def test_a_recipe_added_to_the_registry_alone_trains(tmp_path, tiny_store, monkeypatch):
    """A method that is one object and one registry entry: `horizon train` runs its objective and
    logs its metrics; its losses are SFT's (the same cross-entropy by the two-pass path)."""
    from rich.console import Console

    from horizon_cli.train import run_training
    from horizon_cli.train.metrics import read_metrics

    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(16))
    runs = {}
    for name, recipes in (("sft", registry.RECIPES), ("two", (_TwoPass(), *registry.RECIPES))):
        monkeypatch.setattr(registry, "RECIPES", recipes)
        cfg = write_config(tmp_path / f"{name}.yaml", tiny_store, data, tmp_path / name, train={"steps": 3})
        run_training(cfg, [], console=Console(quiet=True))
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    sft, two = runs["sft"], runs["two"]
    assert len(sft) == len(two) == 3
    for a, b in zip(sft, two, strict=True):
        assert "nll_mean" not in a and b["nll_mean"] == pytest.approx(b["loss"], rel=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_a_dry_run_builds_the_methods_batches(tmp_path, tiny_store):
    """The dry run checks what the start builds: an rl run's reward functions are loaded (one line, exit 2)."""
    from tests.conftest import horizon

    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"say {w}"} for w in "abcd"])
    (tmp_path / "rw.py").write_text("def g(completions, **kw):\n    return [0.0] * len(completions)\n")
    rl = {
        "num_generations": 2,
        "max_completion_length": 4,
        "rewards": [{"function": f"{tmp_path / 'rw.py'}:f"}],
    }
    cfg = write_config(
        tmp_path / "c.yaml", tiny_store, data, tmp_path / "run", rl=rl, train={"batch_size": 2}
    )
    r = horizon("train", cfg, "--dry-run")
    assert r.exit_code == 2, r.output
    assert "error: rl.rewards[0].function: " in r.output and "rw.py has no function 'f'" in r.output
