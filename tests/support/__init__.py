"""What tests, scripts/ and benchmarks/ share (not part of training): tiny random models of every
family (`tiny`), a tiny byte-level tokenizer (`tokenizer`), random-weight stores written directly
(`synthetic`), the census's tiny configs and its check against transformers (`census_config`,
`census_horizon`), the oracles of the engine tests (`oracle`), a fake CUDA (`fake_cuda`), and a
real checkpoint's greedy continuation (`continuation`, below).

    from tests.support import make_model, make_tokenizer, random_store, save

Imported only by those callers: the package's own modules never import it, and the wheel does not
ship it. The checkout's root must be on the path: pytest puts it there (pyproject's `pythonpath`);
a script or benchmark that imports this runs as a module from the root (`python -m scripts.NAME`).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from tests.support.synthetic import random_store
from tests.support.tiny import make_model, save
from tests.support.tokenizer import make_tokenizer

PARIS = "The Eiffel Tower is in the city of"  # a prompt every real checkpoint here continues with Paris

__all__ = ["PARIS", "continuation", "make_model", "make_tokenizer", "random_store", "save", "script"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/support/ -> the root


def script(name: str) -> ModuleType:
    """scripts/<name>.py of the checkout as a module, for a test of that tool (loaded by its path,
    under its own name)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # a dataclass looks its module up while it is being defined
    spec.loader.exec_module(mod)
    return mod


def continuation(model_dir: Path, prompt: str = PARIS, n: int = 8) -> str:
    """Greedy continuation of `prompt` by transformers' own model of the checkpoint in model_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return str(tok.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)).strip()
