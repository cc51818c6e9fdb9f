"""GRPO with images under torchrun: 2 ranks train what 1 trains on a tiny LLaVA (the projector
trained): each rank's prompts carry their image tensors into its rollouts' prefill and its share
of the log-prob passes, the rollouts (with their tensors) are gathered, so the rollout files, TRL's
metrics (train and eval), the losses and the exported weights equal one process's (fp32)."""

from __future__ import annotations

import pytest

from horizon_cli.convert import convert
from tests.conftest import write_config, write_jsonl
from tests.parallel.test_dist import torchrun
from tests.preference.test_pref_train import quiet
from tests.rl.test_grpo_dist import _same_runs
from tests.support.vision import make_images, tiny_llava
from tests.vision.test_vision_grpo import REWARD, records


@pytest.mark.slow
def test_two_ranks_train_what_one_trains_with_images(tmp_path):
    root = tmp_path / "vlm"
    tiny_llava(root / "hf")
    convert(root / "hf", root / "store", dtype="float32")
    make_images(root / "data" / "imgs")
    data = write_jsonl(root / "data" / "p.jsonl", records(10))
    (tmp_path / "rw.py").write_text(REWARD)
    rl = {"num_generations": 3, "max_completion_length": 6, "beta": 0.04, "num_iterations": 2,
          "rewards": [{"function": f"{tmp_path / 'rw.py'}:low_ids"}, {"function": "length", "target": 3, "weight": 0.5}]}  # fmt: skip
    sections = dict(
        train={
            "steps": 3,
            "batch_size": 4,
            "micro_batch_size": 3,
            "seed": 3,
            "eval_every": 3,
            "vision": "projector",
        },
        data={"eval_fraction": 0.3, "max_seq_len": 128},  # 3 held out: split 1 / 2 over the ranks
        engine={"compute_threads": 1},
        schedule={"kind": "constant", "warmup_steps": 0},
        output={"save_every": 0, "export": True},
        rl=rl,
    )
    cfgs = {
        n: write_config(tmp_path / f"{n}.yaml", root / "store", data, tmp_path / n, **sections)
        for n in ("one", "two")
    }
    quiet(cfgs["one"])
    r = torchrun(2, cfgs["two"])
    assert r.returncode == 0, r.stderr
    _same_runs(tmp_path, 3)
