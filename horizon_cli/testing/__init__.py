"""What tests, scripts/ and benchmarks/ share (not part of training): tiny random models of every
family (`tiny`), a tiny byte-level tokenizer (`tokenizer`), random-weight stores written directly
(`synthetic`), the census's tiny configs and its check against transformers (`census_config`,
`census_horizon`), and a real checkpoint's greedy continuation (`continuation`, below).

    from horizon_cli.testing import make_model, make_tokenizer, random_store, save

Imported only by those callers: the package's own modules never import it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from horizon_cli.testing.synthetic import random_store
from horizon_cli.testing.tiny import make_model, save
from horizon_cli.testing.tokenizer import make_tokenizer

PARIS = "The Eiffel Tower is in the city of"  # a prompt every real checkpoint here continues with Paris

__all__ = ["PARIS", "continuation", "make_model", "make_tokenizer", "random_store", "save", "script"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout (scripts/ is not installed)


def script(name: str) -> ModuleType:
    """scripts/<name>.py of the checkout as a module, for a test of that tool (scripts/ is a folder of
    programs, not a package: loaded by its path, under its own name)."""
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
