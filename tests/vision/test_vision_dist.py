"""Vision-language training under torchrun (2 gloo ranks on the CPU): each rank holds the tiny
LLaVA's tower and projector whole and runs them for its own micro-batches; a trained part's
gradients are all-reduced (vision.embed), so losses, grad norms and the exported weights, tower and
projector included, equal one rank's (fp32, 1e-5): frozen, projector, all, and LoRA with the tower
frozen; the projector across a 2-rank checkpoint and resume, and that checkpoint resumed on one
process. One torchrun serves every 2-rank run (tests/parallel/dist_train.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from horizon_cli.convert import convert
from horizon_cli.train.metrics import read_metrics
from tests.conftest import horizon, write_config
from tests.parallel.test_dist import torchrun
from tests.preference.test_pref_train import quiet
from tests.support.vision import make_images, tiny_llava

LORA = {"r": 4, "alpha": 8, "targets": r".*language_model.*\.(q_proj|v_proj)"}  # not the tower's linears
TOWER = ("vision_tower.", "multi_modal_projector.")  # the checkpoint's names on disk


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    tiny_llava(root / "hf")
    convert(root / "hf", root / "store", dtype="float32")
    return root


def sharegpt(imgs: list[Path], n: int) -> list[dict]:
    return [
        {"images": [f"imgs/{imgs[i % len(imgs)].name}"], "conversations": [
            {"from": "human", "value": f"<image>what is {i}?"}, {"from": "gpt", "value": f"colour {i} here"}]}
        for i in range(n)
    ]  # fmt: skip


def cfg(tmp_path: Path, store: Path, name: str, out: str, vision: str, steps: int, **more) -> Path:
    return write_config(
        tmp_path / f"{name}.yaml", store, tmp_path / "data" / "d.jsonl", tmp_path / out, data={"shuffle": False},
        train={"steps": steps, "batch_size": 4, "micro_batch_size": 1, "vision": vision},
        optim={"lr": 2e-3, "grad_clip": 0.5, "weight_decay": 0.1},
        schedule={"kind": "constant", "warmup_steps": 0}, engine={"compute_threads": 1},
        output={"save_every": 2, "keep_last": 3, "export": True}, **more,
    )  # fmt: skip


def tensors(hf: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint dir (an export: the language model's and the carried tower's)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(hf.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.slow  # ~45 s on 2 loaded cores: one torchrun, 3 runs; the cheap check is the next test
def test_two_ranks_train_what_one_trains(vlm, tmp_path):
    imgs = make_images(tmp_path / "data" / "imgs")
    data = tmp_path / "data" / "d.jsonl"
    # in file order, the 2nd rank's two micro-batches of each odd step are text only: it sends
    # zeros for the projector, and still updates it as the other rank does
    text = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    img = sharegpt(imgs, 6)
    rows = img[:2] + [text, text] + img[2:]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = vlm / "store"
    quiet(cfg(tmp_path, store, "frozen-1", "frozen-1", "frozen", 3))
    quiet(cfg(tmp_path, store, "proj-1", "proj-1", "projector", 4))
    quiet(cfg(tmp_path, store, "all-1", "all-1", "all", 2))
    quiet(cfg(tmp_path, store, "lora-1", "lora-1", "frozen", 2, lora=LORA))
    two = [
        cfg(tmp_path, store, "frozen-2", "frozen-2", "frozen", 3),
        cfg(tmp_path, store, "all-2", "all-2", "all", 2),  # the tower too (CLIP's last layer unreached)
        cfg(tmp_path, store, "lora-2", "lora-2", "frozen", 2, lora=LORA),  # adapters replicated, tower frozen
        cfg(tmp_path, store, "proj-2a", "proj-2", "projector", 2),  # then resumed to 4 steps
        cfg(tmp_path, store, "proj-2b", "proj-2", "projector", 4),
    ]
    r = torchrun(2, *two, cli=False)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = tmp_path / "proj-2" / "checkpoints" / "step_2"  # the tower's trained state, once, by rank 0
    assert sorted(p.name for p in (ck / "state").glob("vision.*")), "no vision state in the checkpoint"
    # the 2-rank checkpoint of step 2 resumed on one process (N ranks -> M): steps 3 and 4 again
    shutil.copytree(
        tmp_path / "proj-2", tmp_path / "proj-21", ignore=shutil.ignore_patterns("step_4", "export")
    )
    quiet(cfg(tmp_path, store, "proj-21", "proj-21", "projector", 4))
    kept = [read_metrics(tmp_path / r / "metrics.jsonl")[:2] for r in ("proj-2", "proj-21")]
    assert kept[0] == kept[1]  # resumed: the 2-rank lines of steps 1-2 kept as they were (timings too)
    pairs = {m: (f"{m}-1", f"{m}-2") for m in ("frozen", "all", "lora", "proj")}
    pairs["2 -> 1"] = ("proj-1", "proj-21")
    for mode, runs in pairs.items():
        one, two = (tmp_path / r for r in runs)
        a, b = (read_metrics(run / "metrics.jsonl") for run in (one, two))
        assert [m["step"] for m in a] == [m["step"] for m in b]
        for x, y in zip(a, b, strict=True):
            for k in ("loss", "grad_norm", "tokens"):
                assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), (mode, x["step"], k)
        ea, eb = (tensors(run / "export") for run in (one, two))
        assert ea.keys() == eb.keys() and any(k.startswith(TOWER) for k in ea)
        for k in ea:
            assert torch.allclose(ea[k], eb[k], rtol=1e-5, atol=1e-6), (mode, k)
    orig, frozen, proj = tensors(vlm / "hf"), tensors(tmp_path / "frozen-1" / "export"), ea
    fc1 = "vision_tower.encoder.layers.0.mlp.fc1.weight"
    assert not torch.equal(orig[fc1], tensors(tmp_path / "all-1" / "export")[fc1])  # all: the tower trained
    tower = [k for k in orig if k.startswith(TOWER)]
    assert all(torch.equal(orig[k], frozen[k]) for k in tower)  # frozen: the tower as it was
    moved = [k for k in tower if k.startswith(TOWER[1])]
    assert moved and all(not torch.equal(orig[k], proj[k]) for k in moved)  # the projector trained


class PeerRank:
    """The other rank of a 2-rank group, in process: its flat gradient sums and flags added in."""

    def __init__(self, theirs: torch.Tensor):
        self.theirs, self.sq = theirs, None

    def sum_replicated(self, flat: torch.Tensor, sq) -> None:
        flat += self.theirs
        self.sq = sq(flat)


def test_tower_gradients_summed_over_ranks_with_their_reach():
    """The all-reduce of a trained tower's gradient sums (vision.embed): every rank's sums added,
    a parameter reached on any rank updated on all, its squared norm the sum's (one count)."""
    from horizon_cli.vision.embed import VisionEmbedding
    from horizon_cli.vision.trained import TowerState

    params = {"a": torch.nn.Parameter(torch.zeros(3)), "b": torch.nn.Parameter(torch.zeros(2))}
    tr = TowerState(params, ["a", "b"], {})
    tr.begin()
    tr.add([torch.tensor([1.0, 2.0, 3.0]), None])  # this rank's images reach a only
    peer = PeerRank(torch.tensor([0.5, 0.0, 0.0, 4.0, 5.0, 0.0, 1.0]))  # a's, b's sums; flags a: 0, b: 1
    VisionEmbedding._sum_over_ranks(tr, peer)  # type: ignore[arg-type]
    assert torch.equal(tr.acc["a"], torch.tensor([1.5, 2.0, 3.0])) and torch.equal(
        tr.acc["b"], torch.tensor([4.0, 5.0])
    )
    assert tr.used == {"a", "b"}
    assert peer.sq == pytest.approx(1.5**2 + 4 + 9 + 16 + 25)
    assert tr.finish() == pytest.approx(peer.sq)


def test_dry_run_world_size_counts_the_tower_on_each_rank(vlm, tmp_path):
    imgs = make_images(tmp_path / "data" / "imgs")
    data = tmp_path / "data" / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sharegpt(imgs, 4)))
    plans = {}
    for world in (1, 2):
        path = cfg(tmp_path, vlm / "store", "dry", "dry", "projector", 1)
        out = tmp_path / f"plan-{world}.json"
        r = horizon("train", path, "--dry-run", "--world-size", str(world), "--json", out)
        assert r.exit_code == 0, r.output
        plans[world] = json.loads(out.read_text())
    one, two = plans[1], plans[2]
    for key in ("vision tower", "vision activations", "vision gradient sums"):
        assert two["device"][key] == one["device"][key] > 0, key  # whole on each rank's device
    assert two["host"]["vision state"] == one["host"]["vision state"] > 0  # whole in each rank's host
