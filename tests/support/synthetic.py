"""Random-weight stores written directly (no HF model in memory): for benchmarks and GPU checks.

Matrices are N(0, 0.02), vectors (norms, biases) ones. Minutes faster than building a
transformers model on the CPU and converting it, and the store is a normal one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from horizon_cli.arch import spec_from_hf
from horizon_cli.store import Store, StoreWriter, layouts


def random_store(root: Path, hf_config: dict, dtype: str = "bfloat16", seed: int = 0) -> Store:
    spec = spec_from_hf(hf_config)
    w = StoreWriter(root, spec, dtype, source="random")
    g = torch.Generator().manual_seed(seed)
    try:
        for lay in layouts(spec):
            for s in lay.slots:
                t = torch.randn(s.shape, generator=g) * 0.02 if len(s.shape) > 1 else torch.ones(s.shape)
                w.write(lay.name, s.name, t)
        w.finish()
    finally:
        w.close()
    (root / "hf").mkdir(exist_ok=True)
    (root / "hf" / "config.json").write_text(json.dumps(hf_config))
    return Store.open(root)
