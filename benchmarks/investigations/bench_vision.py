"""Step time of vision-language fine-tuning on the CPU, split tower / language model (issue 31).

A random LLaVA (CLIP tower at 224 px / patch 16: 196 image tokens an image; a Llama language
model), its processor, 8 images made here; the store converted in fp32, then `train.vision`
frozen and all, each 6 steps of batch 8 in micro-batches of 4 (one image a row). The tower's
share is the wall time of its forward (vision.tower's features and merge) and of the image stage's
backward less the text rows' (engine.embed's), timed around those methods; the rest of the step is the streamed language model and
the optimizer. Writes bench_out/vision.json.

    .venv/bin/python -m benchmarks.investigations.bench_vision
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def model(root: Path):
    import transformers

    from tests.support.census_config import tiny_config
    from tests.support.vision import tiny_processor

    cfg = tiny_config("llava", 4)
    proc = tiny_processor()
    proc.image_processor.size = {"shortest_edge": 224}
    proc.image_processor.crop_size = {"height": 224, "width": 224}
    cfg.text_config.vocab_size = len(proc.tokenizer)
    cfg.text_config.hidden_size, cfg.text_config.intermediate_size = 512, 1536
    cfg.text_config.num_attention_heads = cfg.text_config.num_key_value_heads = 8
    cfg.text_config.head_dim = 64
    cfg.vision_config.image_size, cfg.vision_config.patch_size = 224, 16
    cfg.vision_config.hidden_size, cfg.vision_config.intermediate_size = 384, 1536
    cfg.vision_config.num_attention_heads, cfg.vision_config.num_hidden_layers = 6, 6
    cfg.image_token_index = proc.tokenizer.convert_tokens_to_ids("<image>")
    torch.manual_seed(0)
    m = transformers.LlavaForConditionalGeneration(cfg)
    m.save_pretrained(root)
    proc.patch_size = 16
    proc.save_pretrained(root)
    tower = sum(
        p.numel() for n, p in m.named_parameters() if not n.startswith(("model.language_model", "lm_head"))
    )
    return sum(p.numel() for p in m.parameters()) - tower, tower


def run(store: Path, data: Path, vision: str) -> dict:
    from horizon_cli.config.schema import DataConfig, EngineConfig, OptimConfig
    from horizon_cli.data import collate, prepare_data
    from horizon_cli.engine import Engine
    from horizon_cli.store import Store
    from horizon_cli.vision import embed
    from horizon_cli.vision.run import image_data, vision_stage

    s = Store.open(store)
    ts = prepare_data(DataConfig(path=str(data), max_seq_len=512), None, vocab_size=s.arch.vocab,
                      log=lambda x: None, images=image_data(s)).train  # fmt: skip
    from horizon_cli.engine.embed import HostEmbedding
    from horizon_cli.vision.tower import VisionTower

    spent: dict[str, float] = {}

    def timer(cls, name: str, key: str) -> None:
        f = getattr(cls, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0

        setattr(cls, name, timed)

    timer(VisionTower, "features", "features")
    timer(VisionTower, "merge", "merge")
    timer(embed.VisionEmbedding, "backward", "backward")
    timer(HostEmbedding, "backward", "text_backward")
    eng = Engine(s, EngineConfig(device="cpu", dtype="float32", keep_activations=0), OptimConfig(lr=1e-4),
                 stage=vision_stage(s, vision))  # fmt: skip
    steps, tower = [], []
    try:
        for k in range(7):
            mbs = collate(ts.rows(range(8)), 4, 0)
            spent.clear()
            t0 = time.perf_counter()
            eng.step(mbs, 1e-4)
            eng.wait()
            if k:  # the first is warm-up
                steps.append(time.perf_counter() - t0)
                tower.append(spent["features"] + spent["merge"] + spent["backward"] - spent["text_backward"])
    finally:
        eng.close()
    step, tw = statistics.median(steps), statistics.median(tower)
    return {
        "vision": vision,
        "step_s": step,
        "tower_s": tw,
        "lm_and_optimizer_s": step - tw,
        "tower_share": tw / step,
    }


def main() -> None:
    from horizon_cli.convert import convert
    from tests.support.vision import make_images

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        lm, tower = model(root / "hf")
        convert(root / "hf", root / "store", dtype="float32")
        imgs = make_images(root / "imgs", n=8)
        rows = [{"images": [str(p)], "conversations": [{"from": "human", "value": "<image>describe it"},
                                                       {"from": "gpt", "value": "a noisy colour " * 8}]}
                for p in imgs]  # fmt: skip
        (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = {"lm_params": lm, "tower_params": tower, "image_tokens": 196, "batch": 8, "micro_batch": 4,
               "runs": [run(root / "store", root / "d.jsonl", v) for v in ("frozen", "all")]}  # fmt: skip
    (REPO / "bench_out").mkdir(exist_ok=True)
    (REPO / "bench_out" / "vision.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
