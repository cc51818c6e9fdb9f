"""Hugging Face Hub ids as sources: `horizon convert owner/name DST` and `model.path: owner/name`
in a dry run. Everything goes through huggingface_hub and its cache (HF_HUB_CACHE, else
HF_HOME/hub): downloads resume, show their progress and send HF_TOKEN; a file already in the cache
is not fetched again. Only what convert reads is fetched: config.json, the tokenizer, generation
and chat-template files (hf_files.HF_FILES), and the weights pick_weights chooses with their index
(safetensors where the repository has both). A dry run fetches config.json alone.

Offline (HF_HUB_OFFLINE=1, or the hub unreachable) the cache answers; what it lacks is one
InputError naming the id and the cache dir, before anything is written.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import HorizonError, InputError
from .hf_files import HF_FILES, INDEXES, index_files, pick_weights


def hub_id(src: str | Path) -> str | None:
    """src as a hub repository id, or None where it names a local path. An existing path wins;
    otherwise `owner/name` (one slash, a valid repo id) is an id. Whatever looks like a path
    (starts with `.`, `/` or `~`, or has more slashes) stays a path, and gets the usual "not
    found"."""
    text = str(src)
    if os.path.lexists(text) or text.startswith((".", "/", "~")) or text.count("/") != 1 or "\\" in text:
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return None
    return text


def looks_like_bare_id(src: str | Path) -> bool:
    """`gpt2`: a name without its owner, which is not a local path either (for a hint)."""
    text = str(src)
    return "/" not in text and not text.startswith((".", "~")) and not os.path.lexists(text)


def cache_dir() -> Path:
    """huggingface_hub's cache as the environment names it now: HF_HUB_CACHE, else HF_HOME/hub,
    else its default (read when called, so a test, or a caller, may point it elsewhere)."""
    from huggingface_hub import constants

    env = os.environ
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(env[key]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE).expanduser()


def offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or flag.strip().upper() in ("1", "ON", "YES", "TRUE")


def _named(repo: str, revision: str | None) -> str:
    return f"{repo}@{revision}" if revision else repo


def _not_cached(repo: str, revision: str | None, why: str, what: str = "") -> InputError:
    what = what or "it is not in the Hugging Face cache"
    return InputError(
        f"{_named(repo, revision)}: {why} and {what} ({cache_dir()}): run the same command once "
        "with network access, or give a local directory"
    )


def _offline_why() -> str:
    return "offline (HF_HUB_OFFLINE is set)"


def _refusal(repo: str, revision: str | None, e: Exception) -> InputError | None:
    """The hub's answer as one line, where it is one the cache cannot make up for."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, GatedRepoError):
        return InputError(
            f"{repo}: a gated model: accept its terms on https://huggingface.co/{repo} and set HF_TOKEN "
            "to a token of that account"
        )
    if isinstance(e, RepositoryNotFoundError):
        return InputError(
            f"{repo}: no such model on the Hugging Face Hub, or a private one (set HF_TOKEN to a token "
            "that can read it)"
        )
    if isinstance(e, RevisionNotFoundError):
        return InputError(f"--revision {revision}: no such branch, tag or commit in {repo}")
    return None


def _listing(repo: str, revision: str | None) -> tuple[str, list[str]] | str:
    """(commit, the repository's files) from the hub, or why the hub cannot say (then the cache
    answers)."""
    if offline():
        return _offline_why()
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HTTPError, OfflineModeIsEnabled

    try:
        info = HfApi().model_info(repo, revision=revision)
    except (OfflineModeIsEnabled, HTTPError, OSError) as e:
        refused = _refusal(repo, revision, e)
        if refused is not None:
            raise refused from None
        return f"the hub cannot be reached ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return str(info.sha), [s.rfilename for s in info.siblings or []]


@contextlib.contextmanager
def _progress(show: bool) -> Iterator[None]:
    """huggingface_hub's own progress bars, unless the caller's console is quiet."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was = are_progress_bars_disabled()
    if not show and not was:
        disable_progress_bars()
    try:
        yield
    finally:
        if not show and not was:
            enable_progress_bars()


def _download(repo: str, revision: str | None, files: list[str], local: bool, show: bool) -> Path:
    """The snapshot folder holding `files` (fetched where missing; local: from the cache alone)."""
    from huggingface_hub import snapshot_download

    with _progress(show):
        return Path(
            snapshot_download(
                repo,
                revision=revision,
                cache_dir=cache_dir(),
                allow_patterns=[glob.escape(f) for f in files],
                local_files_only=local,
            )
        )


def fetch_checkpoint(repo: str, revision: str | None = None, show: bool = True) -> tuple[Path, str]:
    """(the cached snapshot folder holding what convert reads, its commit). Online the hub lists
    the repository at `revision` (default: main) and the files are fetched at that commit;
    offline the cache's snapshot for `revision` must already hold them. A download cut off is a
    run-time failure (HorizonError): the same command resumes it."""
    from huggingface_hub.errors import HTTPError, LocalEntryNotFoundError

    listed = _listing(repo, revision)
    local, why = isinstance(listed, str), listed if isinstance(listed, str) else ""
    try:
        if isinstance(listed, str):  # the cache's snapshot for this revision, as it is
            snap = _download(repo, revision, [], local=True, show=show)
            names = [p.name for p in snap.iterdir() if p.is_file()]
        else:
            names = listed[1]
        small = [f for f in names if f in HF_FILES or f in INDEXES]
        if "config.json" not in small:
            if local:
                raise _not_cached(repo, revision, why, "the cache holds no config.json of it")
            raise InputError(
                f"{_named(repo, revision)}: no config.json on the hub (not a transformers model?)"
            )
        snap = _download(repo, revision, small, local=local, show=show)  # records refs/<revision>
        index, weights = pick_weights(names, lambda name: index_files(snap / name))
        if not weights and local:
            raise _not_cached(repo, revision, why, "the cache holds no weights of it")
        if not weights:
            raise InputError(
                f"{_named(repo, revision)}: no weights on the hub (expected *.safetensors or pytorch_model*.bin)"
            )
        # every file from the commit the first download resolved
        snap = _download(repo, snap.name, small + weights, local=local, show=show)
    except LocalEntryNotFoundError:
        raise _not_cached(repo, revision, why) from None
    except HTTPError as e:
        refused = _refusal(repo, revision, e)
        if refused is not None:
            raise refused from None
        raise HorizonError(
            f"{_named(repo, revision)}: download failed ({e}); run it again to resume"
        ) from None
    missing = [f for f in [*small, *weights] if not (snap / f).is_file()]
    if missing and local:
        raise _not_cached(repo, revision, why, f"the cache holds only part of it ({missing[0]} is missing)")
    if missing:
        raise HorizonError(f"{_named(repo, revision)}: {missing[0]} did not download; run it again to resume")
    return snap, snap.name


def fetch_config(repo: str, revision: str | None = None) -> Path:
    """The cached snapshot folder holding the repository's config.json (fetched alone: a dry run
    plans from it; tokenizer files already in the cache are used too)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HTTPError, LocalEntryNotFoundError

    local = offline()
    try:
        with _progress(False):
            path = hf_hub_download(
                repo, "config.json", revision=revision, cache_dir=cache_dir(), local_files_only=local
            )
    except LocalEntryNotFoundError:
        why = _offline_why() if local else "the hub cannot be reached"
        raise _not_cached(repo, revision, why, "its config.json is not in the Hugging Face cache") from None
    except EntryNotFoundError:
        raise InputError(f"{_named(repo, revision)}: no config.json (not a transformers model?)") from None
    except (HTTPError, OSError) as e:
        refused = _refusal(repo, revision, e)
        raise refused or InputError(f"{_named(repo, revision)}: cannot fetch config.json ({e})") from None
    return Path(path).parent
