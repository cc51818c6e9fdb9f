"""The run's data as the trainer reads it: the tokenizer from the store's files, and the tokenized
data set (through the run's cache), with one line when a format needs a tokenizer there is not."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ..config import Config
from ..data import PreparedData, prepare_data
from ..data.encode import ONLY_TOKENS, NoTokenizer
from ..data.templates import configure
from ..errors import InputError
from ..recipes.registry import recipe_for
from ..store.files import ModelFiles
from ..vision.run import prompt_images


class NoTokenizerFiles(InputError):
    """The model has no tokenizer files and the data needs a tokenizer."""


def load_tokenizer(store: ModelFiles, fmt: str):
    hf = getattr(store, "hf_dir", None) or store.root / "hf"  # a PlannedModel (dry run): the HF dir itself
    has = hf.is_dir() and any(
        (hf / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if not has:
        if fmt in (
            "tokens",
            "auto",
            "preference",
        ):  # may be pre-tokenized: the data stage says if it needs one
            return None
        raise NoTokenizerFiles(
            f"{no_tokenizer(store)}, and data.format {fmt!r} needs a tokenizer{ONLY_TOKENS}"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf))


def no_tokenizer(store: ModelFiles) -> str:
    """Where the tokenizer files were looked for: a store's hf/ dir, or a lone config.json's dir."""
    if getattr(store, "hf_dir", None) is not None:
        return f"model.path: {getattr(store, 'name', store.root)} holds a config.json but no tokenizer files"
    return f"model.path: store {store.root} has no tokenizer files (in {store.root / 'hf'})"


def load_data(cfg: Config, store: ModelFiles, cache_dir: Path | None, console: Console) -> PreparedData:
    """The data of the run, tokenized (through the cache at `cache_dir` when given)."""
    try:
        return _load_data(cfg, store, cache_dir, console)
    except NoTokenizer as e:  # data.format auto found a format that needs one
        raise NoTokenizerFiles(
            f"{no_tokenizer(store)}, and format {e.fmt!r} needs a tokenizer{e.hint}"
        ) from None


def _load_data(cfg: Config, store: ModelFiles, cache_dir: Path | None, console: Console) -> PreparedData:
    from ..vision.run import image_data

    recipe = recipe_for(cfg)
    own = recipe.read_data(
        cfg,
        lambda fmt: configure(load_tokenizer(store, fmt), cfg.data),
        store.arch,
        console,
        lambda: prompt_images(store),
    )
    if own is not None:  # the recipe's own data form (rl: prompts, read whole: nothing to cache)
        return own
    return prepare_data(
        recipe.data_section(cfg),
        configure(load_tokenizer(store, cfg.data.format), cfg.data),
        seed=cfg.train.seed,
        model_max_len=store.arch.max_positions,
        vocab_size=store.arch.vocab,
        cache_dir=cache_dir,
        log=lambda s: console.print(s, highlight=False),
        batch_size=cfg.train.batch_size,
        images=image_data(store),  # a multimodal store's processor; None: image records refused
    )
