"""GRPO with images (vision): what the loop's strategy needs beyond the prompts' tensors, which
ride with each prompt (data.prompt_only.PromptRow.media) into its rollouts' prefill
(rl.rollouts.sample) and every log-prob pass (each micro-batch's media: the policy's, the
rollout policy's and the reference's, through the engine's vision stage).

    reference   the reference engine (beta > 0, full fine-tuning) gets the tower too, frozen: the
                store's own tower and projector are the initial model's
    sampling    a completion never samples the image token (the placeholder the processor
                expands each image into): its logit is masked as a sampling filter is; a sampled
                one would be taken for an image with no pixels by every later pass (transformers'
                merge refuses the count, and Qwen2-VL's positions would count it)
    refused     a reference with projector adapters (LoRA with train.vision: projector: the
                base is the policy with every adapter off, the projector's not built); held-out
                prompts with images when the training prompts have none: data.prompt_only
"""

from __future__ import annotations

import torch

from ...config import Config
from ...config.schema import DataConfig
from ...engine.parts import Stage
from ...errors import InputError
from ...model.sample import Sampler
from ...store import Store
from ...vision.encode import image_token_id
from ...vision.run import has_images, image_data, vision_stage
from .prompts import PromptData


def check_images(cfg: Config, data: PromptData) -> None:
    assert cfg.rl is not None  # an rl run's
    if has_images(data.train) and cfg.rl.beta > 0 and cfg.lora is not None and cfg.train.vision != "frozen":
        raise InputError(
            f"rl.beta: a reference for LoRA with train.vision: {cfg.train.vision} and images is not built yet "
            "(beta: 0, or train.vision: frozen)"
        )


def reference_stage(cfg: Config, data: PromptData, store: Store) -> Stage | None:
    """The reference engine's embedding stage: the frozen tower when the prompts have images."""
    return vision_stage(store, "frozen") if has_images(data.train) else None


def image_tokens(data: PromptData, store: Store, data_cfg: DataConfig) -> tuple[int, ...]:
    """The token ids a rollout must not sample: the image token of a run with image prompts."""
    got = image_data(store) if has_images(data.train) else None
    return (image_token_id(got.processor(data_cfg)),) if got is not None else ()


class ImageSafeSampler(Sampler):
    """model.sample.Sampler with the image token's logit masked (-inf) before it picks."""

    def __init__(
        self,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        banned: tuple[int, ...],
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
    ):
        super().__init__(temperature, top_p, top_k, seed, min_p, repetition_penalty)
        self.banned = list(banned)

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[:, self.banned] = float("-inf")
        return logits

    def scores(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return super().scores(self._masked(logits), rows)

    def pick(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return super().pick(self._masked(logits), rows)
