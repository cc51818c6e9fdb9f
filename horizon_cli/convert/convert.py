"""`horizon convert`: HF checkpoint directory (or hub id, convert/hub.py) -> host parameter store.

Stage one of the data flow. Everything is checked against config.json before a byte is written
(names, shapes, missing and extra tensors); then tensors stream one at a time into a temp store
that is renamed into place only when complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..arch import ArchSpec, hf_table, read_hf_config, spec_from_hf, unit_names
from ..arch.names import is_ignorable, native_disk_names
from ..arch.reward import KEY, as_causal_lm, classifier, head_names
from ..errors import InputError
from ..fsutil import atomic_dir, check_not_inside, io_failures
from ..progress import byte_progress
from ..store.carried import write_carried
from ..store.layout import unit_layout
from ..store.manifest import DTYPES, QUANTS
from ..store.writer import StoreWriter
from .hf_files import HF_FILES, Checkpoint
from .hub import fetch_checkpoint, hub_id, looks_like_bare_id


def convert(
    src: str | Path,
    dst: str | Path,
    dtype: str = "bfloat16",
    force: bool = False,
    console=None,
    path: str = "auto",
    quantize: str = "",
    revision: str | None = None,
) -> dict:
    """src: an HF checkpoint directory, or a hub id (`owner/name`, convert/hub.py: fetched into
    the Hugging Face cache at `revision`, default main; an existing directory of that name wins).
    path: auto (native layer where there is one, else the generic path) | native | generic
    (e.g. Llama through transformers' own layer, to compare the two).
    quantize: "" or "nf4": the decoder layers' linear weights as NF4 blocks (store/packed.py); the
    scales, norms, embedding and head stay in `dtype`."""
    dst = Path(dst)
    if dtype not in DTYPES:
        raise InputError(f"--dtype: {dtype!r} is not a store dtype ({', '.join(DTYPES)})")
    if quantize not in QUANTS:
        raise InputError(f"--quantize: {quantize!r} is not allowed (nf4)")
    repo = hub_id(src)
    if repo is not None:
        if os.path.lexists(dst) and not force:  # before a download, not after it
            raise InputError(f"{dst}: already exists (use --force to replace it)")
        try:
            src, _ = fetch_checkpoint(repo, revision, show=console is None or not console.quiet)
        except InputError as e:  # a mistyped local path reads as an id: say there is none
            raise InputError(f"{e} (there is no local directory {repo})") from None
        label, source = repo, repo  # the store's source: the id (a LoRA adapter's base model)
    else:
        src = local_source(Path(src), revision)
        label, source = src.name, str(src.resolve())
    check_not_inside(src, dst)
    hf_cfg = read_hf_config(src)
    where = str(src / "config.json")
    scorer = classifier(hf_cfg)  # a reward model (arch.reward): its decoder as the causal LM's
    if scorer is not None:
        hf_cfg = as_causal_lm(hf_cfg, where)
    spec = spec_from_hf(hf_cfg, where=where, path=path)  # refuses an unsupported model before reading weights
    ckpt = Checkpoint(src)
    disk = {n: tuple(i.shape) for n, i in ckpt.infos.items()}
    head = head_names(disk, str(ckpt.src)) if scorer is not None else []
    disk = {n: s for n, s in disk.items() if n not in head}
    spec = spec.pick(_native_disk, _generic_disk)(spec, hf_cfg, disk, where)
    plan = check_tensors(ckpt, spec, skip=frozenset(head))
    carried = [ckpt.infos[n] for n in (*spec.kind.carried, *head)]
    total = sum(ckpt.infos[n].nbytes for n in plan) + sum(i.nbytes for i in carried)
    with io_failures(dst), atomic_dir(dst, force=force) as tmp:
        writer = StoreWriter(tmp, spec, dtype, source=source, quant=quantize)
        try:
            with byte_progress(console, f"convert {label}", total) as advance:
                for name, pieces in ckpt.tensors(set(plan)):
                    unit, tensor = plan[name]
                    writer.write_stream(unit, tensor.name, pieces, on_piece=advance, wait=False)
                if carried:  # a multimodal checkpoint's tower, projector, ...: as they are
                    infos = [(i.name, i.shape, i.dtype, i.nbytes) for i in carried]
                    advance(write_carried(tmp / "hf", infos, ckpt.tensors({i.name for i in carried})))
            manifest = writer.finish({KEY: {"class": scorer, "head": head}} if scorer else None)
        finally:
            writer.close()
        for f in HF_FILES:
            if (src / f).is_file():
                copy_file(src / f, tmp / "hf" / f)
    return {
        "params": manifest.params,
        "units": len(manifest.units),
        "bytes_in": total,
        "dtype": dtype,
        "quant": quantize,
        "reward": scorer or "",
    }


def _generic_disk(spec: ArchSpec, cfg: dict, disk: dict[str, tuple[int, ...]], where: str) -> ArchSpec:
    """The generic description again, mapping the checkpoint's own names (per-expert or fused) onto memory."""
    return spec_from_hf(cfg, where=where, disk=disk, path="generic")


def _native_disk(spec: ArchSpec, cfg: dict, disk: dict[str, tuple[int, ...]], where: str) -> ArchSpec:
    """The native spec, with the checkpoint's own names where a native class saved under them (EXAONE)."""
    if spec.family != cfg.get("model_type"):
        spec.hf_names = native_disk_names(spec, cfg, disk, where) or None
    return spec


def local_source(src: Path, revision: str | None) -> Path:
    """A local checkpoint directory, or the line saying why it is not one."""
    if revision:
        raise InputError(f"--revision {revision}: only for a hub id (owner/name); {src} is a local path")
    if not src.exists():
        hint = " (a hub id is owner/name, e.g. openai-community/gpt2)" if looks_like_bare_id(src) else ""
        raise InputError(f"{src}: not found{hint}")
    if not src.is_dir():
        raise InputError(f"{src}: not a directory (expected an HF checkpoint directory)")
    return src


def copy_file(a: Path, b: Path) -> None:
    b.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(a, b)


def check_tensors(ckpt: Checkpoint, spec, skip: frozenset[str] = frozenset()) -> dict:
    """Match checkpoint names to the architecture: {hf_name: (unit, TensorName)}; InputError naming
    the first missing, extra or misshapen tensor. skip: tensors carried apart (a reward model's head)."""
    table = hf_table(spec)
    ints = {s.hf: s.dtype for u in unit_names(spec) for s in unit_layout(spec, u).slots if s.dtype}
    for name, info in ckpt.infos.items():
        if name in skip:
            continue
        if name in table:
            want = table[name][1].shape
            if tuple(info.shape) != tuple(want):
                raise InputError(
                    f"{info.file}: tensor {name} has shape {tuple(info.shape)}, config.json implies {tuple(want)}"
                )
            if ints.get(name) is not None and str(info.dtype).removeprefix("torch.") == ints[name]:
                pass  # an integer buffer of a layer (arch.generic._mark_integers)
            elif not info.dtype.is_floating_point:
                raise InputError(
                    f"{info.file}: tensor {name} is {info.dtype}, expected a floating-point tensor"
                )
        elif not is_ignorable(name, spec):
            raise InputError(
                f"{info.file}: unexpected tensor {name} for a {spec.family} model per config.json"
            )
    missing = [n for n in table if n not in ckpt.infos]
    if missing:
        raise InputError(
            f"{ckpt.src}: tensor {missing[0]} is missing from the checkpoint ({len(missing)} missing)"
        )
    return table
