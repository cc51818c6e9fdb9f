"""GRPO with images (vision): what the loop's strategy needs beyond the prompts' tensors, which
ride with each prompt (data.prompt_only.PromptRow.media) into its rollouts' prefill
(rl.rollouts.sample) and every log-prob pass (each micro-batch's media: the policy's, the
rollout policy's and the reference's, through the engine's vision stage).

    reference   the reference engine (beta > 0, full fine-tuning) gets the tower too, frozen: the
                store's own tower and projector are the initial model's
    refused     a reference with projector adapters (LoRA with train.vision: projector: the
                base is the policy with every adapter off, the projector's not built); held-out
                prompts with images when the training prompts have none: data.prompt_only
"""

from __future__ import annotations

from ..errors import InputError
from ..vision.run import has_images, vision_stage


def check_images(cfg, data) -> None:
    if has_images(data.train) and cfg.rl.beta > 0 and cfg.lora is not None and cfg.train.vision != "frozen":
        raise InputError(
            f"rl.beta: a reference for LoRA with train.vision: {cfg.train.vision} and images is not built yet "
            "(beta: 0, or train.vision: frozen)"
        )


def reference_stage(cfg, data, store):
    """The reference engine's embedding stage: the frozen tower when the prompts have images."""
    return vision_stage(store, "frozen") if has_images(data.train) else None
