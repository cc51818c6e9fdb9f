"""Build a random Llama checkpoint and its horizon store, in a process of its own.

    python benchmarks/prepare.py JOB.json

JOB: {"shape": {...}, "seq": 256, "hf_dir": ..., "store": ..., "store_dtype": "float32",
      "hf_dtype": "float32", "how": "init" | "stream", "seed": 0}

how=init    LlamaForCausalLM(config) with transformers' own init, save_pretrained (the benchmark
            sizes: every peer starts from exactly these weights).
how=stream  tensor by tensor into safetensors shards (normal(0, 0.02), norms 1), never the whole
            model in memory: the scale study's multi-GB models.
Then `horizon_cli.convert.convert(hf_dir, store, dtype=store_dtype)`, the code `horizon convert` runs.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from common import llama_config

SHARD = 1 << 30  # bytes per safetensors shard


def save_init(job: dict, dst: Path) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(job.get("seed", 0))
    model = LlamaForCausalLM(llama_config(job["shape"], job["seq"]))
    model.to(getattr(torch, job.get("hf_dtype", "float32"))).save_pretrained(dst)


def save_tokenizer(vocab: int, dst: Path) -> None:
    """A word-level tokenizer t0..t{V-1} beside the weights. The token rows never go through it,
    but `horizon train` with data.format tokens crashes without one (data/cache.py
    tokenizer_fingerprint(None)), so the benchmark ships one to measure the CLI path."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0").save_pretrained(dst)


def save_stream(job: dict, dst: Path) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    cfg = llama_config(job["shape"], job["seq"])
    dtype = getattr(torch, job.get("hf_dtype", "bfloat16"))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(job.get("seed", 0))
    dst.mkdir(parents=True, exist_ok=True)
    index, shard, size, n = {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(dst / name), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, name))
            shard, size, n = {}, 0, n + 1

    for k, shp in shapes.items():
        t = torch.ones(shp, dtype=dtype) if k.endswith("norm.weight") else torch.empty(shp, dtype=dtype)
        if not k.endswith("norm.weight"):
            t.normal_(0.0, 0.02, generator=g)
        shard[k] = t
        size += t.numel() * t.element_size()
        if size >= SHARD:
            flush()
    flush()
    total = sum(torch.Size(s).numel() for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
    )
    cfg.torch_dtype = dtype
    cfg.save_pretrained(dst)


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    from horizon_cli.convert import convert

    hf, store = Path(job["hf_dir"]), Path(job["store"])
    for p in (hf, store):
        shutil.rmtree(p, ignore_errors=True)
    (save_init if job.get("how", "init") == "init" else save_stream)(job, hf)
    if job.get("tokenizer"):
        save_tokenizer(job["shape"]["vocab"], hf)
    convert(hf, store, dtype=job.get("store_dtype", "float32"), force=True, quantize=job.get("quantize", ""))
    if job.get("drop_hf"):  # only the store is needed (horizon alone): keep the disk for bigger models
        shutil.rmtree(hf)
    (store.parent / (store.name + ".ok")).write_text(json.dumps(job, sort_keys=True))


if __name__ == "__main__":
    main()
