"""The vision tower and projector on the device: transformers' own modules, weights from the store.

The checkpoint's class is built with every parameter on the meta device as it is registered (so
no initialiser runs on real memory) and its buffers real, as its own constructor makes them (CLIP's
position ids); the image owner's children other than its language model (vision.support: the tower,
the projector) get their parameters from the store's carried file (store.carried: the checkpoint's
tensors, placed by transformers' own renamings, arch.disk), in the compute dtype, resident on the
device. The language model's parameters stay on the meta device: nothing of them is built here.

Per micro-batch:

    features  owner.get_image_features(pixel_values, ...) with the processor's tensors that it takes
              (by its signature), the pooled output concatenated as the owner's forward does: (n, H)
              (Idefics3 / SmolVLM take each text row's images as one stack (1, n, C, H, W) with
              its pixel mask: the rows' images, kept one per dim-0 entry in the data, go as one
              stack (vision.encode.media_of), whose features are the same rows in the same order)
    embed     the language model's embedding module's own forward on the gathered rows (Gemma 3
              scales them there), the merge's input as in transformers; the streamed owner then
              takes the merged rows as its inputs_embeds (model.token_masks.owner_inputs)
    merge     owner.get_placeholder_mask(input_ids, inputs_embeds, image_features) and
              inputs_embeds.masked_scatter(mask, features), transformers' own code; or the owner's
              own inputs_merger(input_ids, inputs_embeds, image_hidden_states) (Idefics3)
    types     an owner whose masks read token types (Gemma 3): 1 on the image tokens, the
              processor's rule (ProcessorMixin.create_mm_token_type_ids), for model.token_masks
    positions an owner with multimodal rotary position ids (Qwen2-VL, Qwen2.5-VL): its own
              get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, attention_mask) ->
              (3, b, T), what its forward gives its language model in training; the token types
              are the processor's rule (the image token's places 1, the others 0), the mask the
              rows' real tokens
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..arch.disk import place
from ..errors import InputError
from ..store.carried import FILE, verify_carried
from .encode import stacked
from .support import HFModule, ImageOwner, generic_of, image_owner

if TYPE_CHECKING:
    from ..arch.generic_arch import GenericArch
    from ..store import Store


class VisionTower:
    def __init__(self, store: Store, device: torch.device, dtype: torch.dtype, trained: bool = False) -> None:
        g = generic_of(store.arch)
        where = f"model.path: {store.root}"
        model = build_model(g, dtype)
        self.spec = image_owner(store.arch, where, model)
        self.owner = model.get_submodule(self.spec.owner) if self.spec.owner else model
        mods = [self.owner.get_submodule(c) for c in self.spec.towers]
        for mod in mods:  # buffers: real, to the device (the parameters come from the store below)
            for sub in mod.modules():
                sub._buffers.update({k: b.to(device) for k, b in sub._buffers.items() if b is not None})
        self.emb = self.owner.get_input_embeddings()  # meta weight; its buffers (Gemma's scale) real
        self.emb._buffers.update({k: b.to(device) for k, b in self.emb._buffers.items() if b is not None})
        self.params, self.disk = _load(model, self.spec, mods, Path(store.root) / "hf", device, dtype, where)
        for p in self.params.values():
            p.requires_grad_(trained)
        self.device, self.dtype = device, dtype
        self.takes = set(inspect.signature(self.owner.get_image_features).parameters)

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def features(self, media: dict[str, torch.Tensor]) -> torch.Tensor:
        """(n, H) image features of a micro-batch's images, in the compute dtype."""
        kw = {k: v.to(self.device) for k, v in media.items() if k in self.takes}
        kw = stacked(kw)  # one stack of every image (module doc)
        if "pixel_values" in kw and kw["pixel_values"].is_floating_point():
            kw["pixel_values"] = kw["pixel_values"].to(self.dtype)
        out = self.owner.get_image_features(**kw, return_dict=True)
        feats = getattr(out, "pooler_output", out)
        if isinstance(feats, list | tuple):
            feats = torch.cat(list(feats), dim=0)
        return feats.to(self.dtype)

    def positions(
        self, input_ids: torch.Tensor, media: dict[str, torch.Tensor], mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The owner's own position ids (3, b, T) of a micro-batch with images and its rope deltas
        (b, 1), or None (the rows' own). mask: (b, T) the real tokens, or None (all)."""
        if not self.spec.rope:
            return None
        rope = self.owner.get_rope_index
        takes = inspect.signature(rope).parameters
        kw: dict[str, torch.Tensor] = {k: v.to(self.device) for k, v in media.items() if k in takes}
        ids = input_ids.to(self.device)
        if "mm_token_type_ids" in takes:
            kw["mm_token_type_ids"] = (ids == self.owner.config.image_token_id).int()
        if "attention_mask" in takes and mask is not None:
            kw["attention_mask"] = mask.to(self.device).long()
        pos, deltas = rope(ids, **kw)
        return pos, deltas

    def embed(self, input_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The embedding module's output for the gathered rows (b, T, H), by its own forward: what
        transformers merges the features into (Gemma 3's scaled rows; others' the rows as they are)."""
        from ..arch.capture import rows_embedding

        with rows_embedding(self.emb, rows):
            return self.emb(input_ids)

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """(b, T) int64 token types (1 on image tokens) when the owner's masks read them, else None."""
        if not self.spec.types:
            return None
        return (input_ids == self.owner.config.image_token_id).long()

    def merge(self, input_ids: torch.Tensor, rows: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """The rows with the image features in the placeholders' places (transformers' merge)."""
        if not hasattr(self.owner, "get_placeholder_mask"):  # its own merge (vision.support)
            return self.owner.inputs_merger(
                input_ids=input_ids, inputs_embeds=rows, image_hidden_states=feats
            )
        mask = self.owner.get_placeholder_mask(input_ids, inputs_embeds=rows, image_features=feats)
        if isinstance(mask, tuple):  # (image, video) masks: Qwen2-VL's forward takes the first
            mask = mask[0]
        return rows.masked_scatter(mask, feats)


_REGISTER = "register_parameter"  # the method _params_on_meta swaps (torch.nn.Module's)


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Inside: every parameter a module registers moves to the meta device at once (its
    initialiser then runs on nothing); buffers are made as the constructor makes them."""
    register = torch.nn.Module.register_parameter

    def on_meta(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    setattr(torch.nn.Module, _REGISTER, on_meta)
    try:
        yield
    finally:
        setattr(torch.nn.Module, _REGISTER, register)


def build_model(g: GenericArch, dtype: torch.dtype) -> HFModule:
    """The checkpoint's class, parameters on the meta device, buffers real (module doc)."""
    import transformers

    from ..arch.generic import hf_config

    assert g.cls is not None  # a multimodal store names its class
    cls = getattr(transformers, g.cls)
    with _params_on_meta():
        model = cls._from_config(hf_config(dict(g.config)), attn_implementation=g.attn, dtype=dtype)
    return model.eval()


def _load(
    model: torch.nn.Module,
    spec: ImageOwner,
    mods: list[torch.nn.Module],
    hf: Path,
    device: torch.device,
    dtype: torch.dtype,
    where: str,
) -> tuple[dict[str, torch.nn.Parameter], dict[str, str]]:
    """The towers' parameters from the carried file, in place of their meta tensors; and each
    one's carried tensor (memory name -> disk name) when it is one whole tensor."""
    from safetensors import safe_open

    verify_carried(hf)
    if not (hf / FILE).is_file():
        raise InputError(f"{where}: the store carries no vision tower ({hf / FILE} is missing)")
    base = spec.owner + "." if spec.owner else ""
    mem = {}
    for c, mod in zip(spec.towers, mods, strict=True):
        for n, p in mod.state_dict(keep_vars=True).items():  # parameters and persistent buffers
            mem[f"{base}{c}.{n}"] = tuple(p.shape)
    with safe_open(str(hf / FILE), framework="pt") as f:
        disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        lm = {k: s for k, s in disk.items() if _placed(model, k, mem)}
        parts, follows = place(model, mem, lm, where)
        if follows:
            raise InputError(f"{where}: the vision tower's tensors are split on load; not supported yet")
        out, names = {}, {}
        for name, ps in parts.items():
            if len(ps) == 1 and ps[0].at == 0:
                names[name] = ps[0].hf
            flat = torch.empty(math.prod(mem[name]), dtype=dtype)
            for part in ps:
                t = f.get_tensor(part.hf).reshape(-1)
                flat[part.at : part.at + t.numel()] = t.to(dtype)
            mod_path, _, leaf = name.rpartition(".")
            holder = model.get_submodule(mod_path)
            if leaf in holder._buffers:
                holder._buffers[leaf] = flat.view(mem[name]).to(device)
                continue
            param = torch.nn.Parameter(flat.view(mem[name]).to(device), requires_grad=False)
            holder._parameters[leaf] = param
            out[name] = param
    return out, names


def _placed(model: torch.nn.Module, disk_name: str, mem: dict) -> bool:
    """A carried tensor that fills one of the towers' parameters (not another carried module's)."""
    from transformers.core_model_loading import rename_source_key

    from ..arch.disk import transforms

    if disk_name in mem:
        return True
    renamings, converters = transforms(model)
    return rename_source_key(disk_name, renamings, converters)[0] in mem
