"""What a training run asks of the vision package: the image data of a store (data.images'
ImageData seam) and the engine's embedding stage for it (engine.parts' Stage seam)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..data.prompt_only import PromptSet
from ..data.unpaired import unpaired_form
from ..errors import InputError
from .adapters import ProjectorAdapters, projector_targets
from .imageset import ImageSet, Log, build_image_set, images_key
from .pairs import build_image_pairs, holds_pairs, image_pair
from .prompts import encode_prompt, prompt_record
from .records import image_example
from .support import image_owner, is_multimodal
from .unpaired import build_image_unpaired, unpaired_prompt

if TYPE_CHECKING:
    import torch
    from datasets import Dataset

    from ..config.schema import DataConfig
    from ..data.prompt_only import PromptImages
    from ..data.tokset import TokenSet
    from ..engine.parts import Stage
    from ..engine.seams import Embedding, EmbeddingTable, Transport
    from ..lora.setup import LoraSetup
    from ..store import Store
    from ..store.files import ModelFiles
    from .encode import Processor


class VisionData:
    """data.images.ImageData for a multimodal store: its processor, loaded on first use."""

    def __init__(self, store: ModelFiles, where: str) -> None:
        self.store, self.where = store, where
        self._proc: Processor | None = None

    def processor(self, data_cfg: DataConfig) -> Processor:
        """The processor, with the `data:` section's chat template and template kwargs (as the
        tokenizer of a text run: data.templates.configure; one data section a run)."""
        from ..data.templates import configure
        from .encode import load_processor

        if self._proc is None:
            image_owner(self.store.arch, self.where)  # a model that cannot take images: refused first
            self._proc = configure(load_processor(Path(self.store.root) / "hf", self.where), data_cfg)
        return self._proc

    def build(self, ds: Dataset, data_cfg: DataConfig, name: str, log: Log, base: Path) -> ImageSet:
        form = _kind(ds, data_cfg, name)
        if form == "pairs":  # preference pairs with images (vision.pairs)
            return build_image_pairs(ds, self.processor(data_cfg), data_cfg, name, log, base)
        if form is not None:  # unpaired preference (KTO) examples with images (vision.unpaired)
            return build_image_unpaired(ds, self.processor(data_cfg), data_cfg, name, log, base)
        return build_image_set(ds, self.processor(data_cfg), data_cfg, name, log, base)

    def key(self, ds: Dataset, data_cfg: DataConfig, base: Path) -> str | None:
        form = _kind(ds, data_cfg, "data.path")
        if form == "pairs":
            return images_key(
                ds, self.processor(data_cfg), data_cfg, base, lambda r, w, b: image_pair(r, w, b).prompt
            )
        if form is not None:
            return images_key(ds, self.processor(data_cfg), data_cfg, base, unpaired_prompt(form))
        return images_key(ds, self.processor(data_cfg), data_cfg, base)

    def prompt(self, record: dict, where: str, base: Path, data_cfg: DataConfig) -> tuple[list[int], dict]:
        """A prompt-only record with images (GRPO) -> its ids and image tensors (vision.prompts)."""
        if record.get("prompt_input_ids") is not None:
            raise InputError(f"{where}: prompt_input_ids with images: give the prompt as messages")
        ex = image_example(prompt_record(record), where, base)
        return encode_prompt(self.processor(data_cfg), ex, where, data_cfg.max_pixels, data_cfg.min_pixels)

    def wrap(self, ts: TokenSet, media: dict, offsets: dict) -> ImageSet:
        return ImageSet(
            ts.tokens, ts.labels, ts.offsets, ts.doc_ids, ts.format, ts.stats, None, media, offsets
        )


def _kind(ds: Dataset, data_cfg: DataConfig, name: str) -> str | None:
    """The records' kind: "pairs" (preference pairs), an unpaired form (data.unpaired: KTO examples, label or kto_tag
    not in data.ignore_fields), or None (SFT records). KTO (data.format unpaired) on pairs with
    images is refused, as TRL's KTOTrainer refuses paired vision data; unpaired examples under
    another data.format are refused rather than read without their labels."""
    ignored = {"kto_tag", "label"} & set(data_cfg.ignore_fields)  # declared metadata (data.build)
    cols = [c for c in ds.column_names if c not in ignored]
    if holds_pairs(cols):
        if data_cfg.format == "unpaired":
            raise InputError(
                f"{name}: KTO with images reads unpaired examples (prompt, completion, label; or kto_tag), "
                "not chosen/rejected pairs (TRL's KTOTrainer refuses paired vision data too): unpair them "
                "first (trl.data_utils.unpair_preference_dataset)"
            )
        return "pairs"
    form = unpaired_form(cols)
    if form is not None and data_cfg.format not in ("auto", "unpaired"):
        raise InputError(
            f"data.format: {data_cfg.format}: {name} holds unpaired preference (KTO) examples (label or "
            "kto_tag) with images; read them with format unpaired (or auto)"
        )
    return form


def image_data(store: ModelFiles) -> VisionData | None:
    """The store's image data, or None for a text-only model (image records then refused)."""
    if getattr(store, "hf_dir", None) is not None or not is_multimodal(store.arch):
        return None  # a dry run's config-only plan reads no images
    return VisionData(store, f"model.path: {store.root}")


def prompt_images(store: ModelFiles) -> PromptImages:
    """data.prompt_only.PromptImages of a store: its image data, or why it reads no images."""
    from ..data.prompt_only import PromptImages

    if not is_multimodal(store.arch):
        return PromptImages(None, f"{store.root} takes text only (no vision tower)")
    data = image_data(store)
    if data is None:
        return PromptImages(None, "a dry run from a config reads no images (plan from a converted store)")
    return PromptImages(data)


def has_images(rows: object) -> bool:
    """Training rows with image tensors (an ImageSet, a mixture holding one, or the pairs of one;
    prompts (data.prompt_only) of which one has images)."""
    if isinstance(rows, PromptSet):
        return any(r.media for r in rows.rows)
    parts = getattr(rows, "parts", None)
    if parts is not None:
        return any(has_images(p) for p in parts)
    return isinstance(getattr(rows, "ts", rows), ImageSet)  # data.pairs.PairSet: its rows


def vision_stage(store: Store, vision: str, lora: LoraSetup | bool | None = None) -> Stage:
    """The engine's Stage: the run's embedding wrapped with the tower's image merge; `vision`:
    train.vision (projector | all: the tower's trained part, vision.trained). lora: the run's
    LoraSetup (or True: a LoRA run): with train.vision: projector the projector gets adapters
    (vision.adapters, the setup's `tower` targets), train.vision: all is refused."""
    if vision == "all" and lora:
        projector_targets(store.arch, vision)  # refused there, in one line
    if vision == "projector" and lora and not getattr(lora, "tower", None):
        raise InputError(
            "train.vision: projector: this LoRA setup has no projector adapters (lora_for without tower targets)"
        )

    def stage(inner: EmbeddingTable, t: Transport, dtype: torch.dtype) -> Embedding:
        from .embed import VisionEmbedding
        from .tower import VisionTower
        from .trained import TowerState, trained_names

        tower = VisionTower(store, t.device, dtype)
        t.memory.set("vision tower", tower.nbytes())
        if vision == "frozen":
            return VisionEmbedding(inner, tower)
        if lora:  # adapters on the projector's linear layers, the tower's weights frozen
            assert not isinstance(lora, bool)  # a bare True: frozen (above) or all (refused above)
            return VisionEmbedding(inner, tower, ProjectorAdapters(tower, lora))
        base = tower.spec.owner + "." if tower.spec.owner else ""
        names = trained_names(tower.spec.towers, tower.params, base, vision)
        split = [n for n in names if n not in tower.disk]
        if split:
            raise InputError(
                f"train.vision: {vision}: {split[0]} is not one tensor on disk; training it is not built"
            )
        return VisionEmbedding(inner, tower, TowerState(tower.params, names, tower.disk))

    return stage
