"""A sequence-classification checkpoint (a reward model, as TRL's `reward_funcs` take one) as a store.

`XForSequenceClassification` is the causal LM's decoder (`XModel`, under the same prefix) with a
`score` linear layer (num_labels x hidden, no LM head) on the last hidden state, after the final
norm. Convert stores it as the causal LM of its model type with tied embeddings (the decoder's
units as any store's; the head unit holds the final norm) and carries the `score.*` tensors
untrained beside the config (store.carried); the manifest's `extra["reward"]` marks the store.
Such a store only scores (recipes.grpo.reward_model): training or generating from it is refused.

TRL loads a reward model with num_labels=1 and takes logits[:, 0]; a checkpoint with more labels
is refused here.
"""

from __future__ import annotations

from ..errors import InputError

HEAD = "score."  # the classifier's tensors (GenericForSequenceClassification.score)
KEY = "reward"  # manifest.extra's key


def classifier(cfg: dict) -> str | None:
    """The sequence-classification class a config.json names, if it names one."""
    return next(
        (str(a) for a in cfg.get("architectures") or [] if str(a).endswith("ForSequenceClassification")), None
    )


def as_causal_lm(cfg: dict, where: str) -> dict:
    """The config as its model type's causal LM with the embedding tied (a classifier has no LM
    head; the store's head unit then holds the final norm alone)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = cfg.get("model_type")
    lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(mt))
    if lm is None:
        raise InputError(f"{where}: {classifier(cfg)}: model_type {mt!r} has no causal LM in transformers")
    return {**cfg, "architectures": [lm], "tie_word_embeddings": True}


def head_names(shapes: dict[str, tuple[int, ...]], where: str) -> list[str]:
    """The checkpoint's classifier tensors (`score.weight`, a bias if it has one) among its tensors'
    shapes, checked: one label."""
    got = sorted(n for n in shapes if n.startswith(HEAD))
    if f"{HEAD}weight" not in got:
        raise InputError(f"{where}: a sequence-classification checkpoint without {HEAD}weight")
    labels = shapes[f"{HEAD}weight"][0]
    if labels != 1:
        raise InputError(
            f"{where}: {HEAD}weight has {labels} labels; a reward model scores with one (TRL loads it "
            "with num_labels=1)"
        )
    return got


def reward_of(extra: dict) -> dict | None:
    """A store manifest's reward marker ({"class": ..., "head": [...]}), None for a causal LM."""
    got = extra.get(KEY)
    return got if isinstance(got, dict) else None


def scorer_class(extra: dict) -> str | None:
    """A store's classifier class when it is a reward model's, else None."""
    r = reward_of(extra)
    return None if r is None else str(r.get("class"))


def not_a_policy(cls: str | None, where: str) -> None:
    """InputError when the model is a reward model (cls: its classifier class, from reward_of or
    classifier; None: a causal LM): it scores, it is not trained or sampled."""
    if cls is not None:
        raise InputError(
            f"{where}: a reward model ({cls}): it scores completions as rl.rewards[i].model; it is "
            "not trained or sampled from"
        )
