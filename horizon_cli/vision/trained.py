"""The trained part of a vision tower (`train.vision: projector | all`): fp32 masters and AdamW
moments on the host, like every other unit's, the device copy in the compute dtype.

    projector  the owner's children named like a projector (projector, merger, connector, adapter),
               else such a child of a tower (Qwen2-VL's visual.merger)
    all        every tower child (the vision encoder too)

Per step: the gradient of every micro-batch is summed in fp32 on the device (`add`), then sent to
the host once (`finish`: its squared norm joins the global one, so clipping sees it); the update
is optim.adamw's exact arithmetic on the host masters with the step's hyper-parameters (the clip
scale included), and the device copy is refreshed from the masters. A parameter the step's
backward never reached (LLaVA's encoder layers past `vision_feature_layer`, or a step without
images) is not updated, as torch.optim.AdamW skips a parameter whose grad is None.

A checkpoint holds the weights in the checkpoint store's carried file (the checkpoint's
`hf/carried.safetensors`, rewritten: trained tensors from their masters in their own dtype, every
other tensor as it was, byte for byte), so export writes the trained tower and a resumed run builds
its tower from it; the fp32 masters and moments are `state/vision.<tensor>.{master,m,v}.bin`.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import InputError
from ..optim.adamw import AdamWHyper, adamw_fp32_
from ..store.carried import FILE, write_carried
from ..store.ckpt import CheckpointDamaged

PROJECTOR = re.compile(r"projector|merger|connector|adapter|projection", re.IGNORECASE)
BUFS = ("master", "m", "v")


def trained_names(
    towers: tuple[str, ...], params: dict[str, torch.nn.Parameter], base: str, mode: str
) -> list[str]:
    """The tower parameters `mode` trains (names as in `params`)."""
    kids = towers if mode == "all" else tuple(c for c in towers if PROJECTOR.search(c))
    if kids:
        return [n for n in params if any(n.startswith(f"{base}{c}.") for c in kids)]
    # the projector inside the tower (Qwen2-VL's visual.merger): a tower child's child named so
    inner = [
        n
        for n in params
        if any(n.startswith(f"{base}{c}.") for c in towers) and PROJECTOR.search(n[len(base) :].split(".")[1])
    ]
    if not inner:
        raise InputError(f"train.vision: {mode}: the model has no projector module among {list(towers)}")
    return inner


class TowerState:
    def __init__(self, params: dict[str, torch.nn.Parameter], names: list[str], disk: dict[str, str]):
        """params: the tower's device parameters; names: those trained; disk: memory name -> the
        carried file's name of its tensor."""
        self.params = {n: params[n] for n in names}
        self.disk = disk
        self.master = {n: p.detach().float().cpu().clone() for n, p in self.params.items()}
        self.m = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.v = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.grad = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.acc: dict[str, torch.Tensor] = {}
        self.used: set[str] = set()  # reached by this step's backward (torch.optim skips the others)
        for p in self.params.values():
            p.requires_grad_(True)

    def nbytes(self) -> int:
        """Host bytes: master, two moments and the gradient, fp32."""
        return 4 * 4 * sum(t.numel() for t in self.master.values())

    def begin(self) -> None:
        self.used = set()
        self.acc = {
            n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in self.params.items()
        }

    def add(self, grads: Sequence[torch.Tensor | None]) -> None:
        for (n, a), g in zip(self.acc.items(), grads, strict=True):
            if g is not None:
                a.add_(g.float())
                self.used.add(n)

    def finish(self) -> float:
        """The step's gradient to the host; returns its squared norm."""
        sq = 0.0
        for n, a in self.acc.items():
            self.grad[n].copy_(a.cpu())
            sq += float(self.grad[n].double().pow(2).sum())
        self.acc = {}
        return sq

    def update(self, h: AdamWHyper) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                if n not in self.used:  # no gradient at all (a layer past vision_feature_layer, no image)
                    continue
                adamw_fp32_(
                    self.master[n].view(-1), self.grad[n].view(-1), self.m[n].view(-1), self.v[n].view(-1), h
                )
                p.copy_(self.master[n].to(p.dtype))

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, ck: Path) -> dict[str, int]:
        """The trained tensors into the checkpoint store's carried file; masters and moments as
        state files. Returns the state files' CRC32s."""
        from safetensors import safe_open

        hf = ck / "hf"
        by_disk = {self.disk[n]: n for n in self.params}
        with safe_open(str(hf / FILE), framework="pt") as f:
            names = list(f.keys())
            tensors = {}
            for k in names:
                t = f.get_tensor(k)
                tensors[k] = self.master[by_disk[k]].to(t.dtype).view(t.shape) if k in by_disk else t
        (hf / FILE).unlink()
        infos = [(k, tuple(t.shape), t.dtype, t.numel() * t.element_size()) for k, t in tensors.items()]
        write_carried(hf, infos, ((k, [t.reshape(-1)]) for k, t in tensors.items()))
        return self.save_state(ck)

    def save_state(self, ck: Path) -> dict[str, int]:
        """The fp32 masters and moments as state files; returns their CRC32s."""
        sums = {}
        for n in self.params:
            for key, src in zip(BUFS, (self.master, self.m, self.v), strict=True):
                rel = f"state/vision.{n}.{key}.bin"
                data = src[n].contiguous().view(torch.uint8).numpy().tobytes()
                (ck / rel).write_bytes(data)
                sums[rel] = zlib.crc32(data)
        return sums

    def load(self, ck: Path, sums: dict) -> None:
        for n, p in self.params.items():
            for key, dst in zip(BUFS, (self.master, self.m, self.v), strict=True):
                rel = f"state/vision.{n}.{key}.bin"
                if rel not in sums or not (ck / rel).is_file():
                    raise CheckpointDamaged(f"{ck}: checkpoint lacks {rel} (train.vision changed?)")
                data = (ck / rel).read_bytes()
                if len(data) != dst[n].numel() * 4 or zlib.crc32(data) != sums[rel][1]:
                    raise CheckpointDamaged(f"{ck}: {rel} does not match its checksum")
                dst[n].view(-1).copy_(torch.frombuffer(bytearray(data), dtype=torch.float32))
            with torch.no_grad():
                p.copy_(self.master[n].to(p.dtype))
