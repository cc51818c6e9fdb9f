"""The run dir of `horizon train`: one owner at a time, what a start resumes, and the rule that a
start that fails changes nothing.

    claim()   lock the dir (a second `horizon train` exits 2 naming the holder), pick the newest
              intact checkpoint and check that this config may resume it (compat.py). Reads only.
    probe()   the same checks without locking or creating anything (`--dry-run`): the same lines.
    begin()   called once the resume point is loaded and the run really starts: rename damaged
              checkpoints aside, sweep what killed processes left, write config.yaml, prune.
    release   on the way out: unlock. A start that failed before begin() removes what it wrote
              (the tokenization cache, <run>/cache): a run dir it created goes entirely, an
              existing one is left as it was.

    <run>/.lock           held (flock) while a process trains here; removed on exit
    <run>/finished.json   written last by a run that finished: its step and what it exported
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from .. import owner
from ..config import Config, dump_yaml
from ..errors import InputError
from ..fsutil import write_text_atomic
from ..lora.setup import check_same_kind
from ..store import Store, ckpt
from . import compat

FINISHED = "finished.json"
CACHE = "cache"  # <run>/cache: the run's tokenization cache (train/inputs.py), filled before begin()


class RunDir:
    def __init__(self, cfg: Config, store: Store | None, console: Console):
        self.cfg, self.store, self.console = cfg, store, console
        self.path = Path(cfg.output.dir)
        self.lock: owner.DirLock | None = None
        self.made: list[Path] = []  # folders this start created (outermost first)
        self.cached: set[str] | None = None  # entries of <run>/cache before this start (None: none there)
        self.begun = False  # begin() ran: the run dir is in use, a failure leaves it as it is
        self.candidates: list[Path] = []  # intact checkpoints, newest first
        self.damaged: list[tuple[Path, str]] = []
        self.accepted: list[str] = []  # trajectory changes the config accepts
        self.follower = False  # a sharded run's rank > 0: rank 0 owns the dir (train/claim.py)

    # -- claim: checks only --------------------------------------------------------------------
    @classmethod
    @contextlib.contextmanager
    def claim(cls, cfg: Config, store: Store, console: Console) -> Iterator[RunDir]:
        rd = cls(cfg, store, console)
        rd._lock()
        try:
            rd.inspect()
            yield rd
        finally:
            rd._release()

    @classmethod
    def probe(cls, cfg: Config, store: Store | None, console: Console) -> RunDir:
        """claim()'s checks, in its order and with its lines, creating and locking nothing (a dry
        run). store None (a model not converted yet): the resume point is found, not checked."""
        rd = cls(cfg, store, console)
        rd._check_path()
        p = rd.path
        base = next(d for d in (p, *p.parents) if os.path.lexists(d))  # where mkdir or the lock writes
        if not os.access(base, os.W_OK | os.X_OK):
            raise InputError(f"output.dir: {p} is not writable (Permission denied)")
        holder = owner.probe(p)
        if holder:
            raise in_use(p, holder)
        if store is not None:
            rd.inspect()
        else:
            compat.check_accept_keys(cfg)
            rd.candidates, rd.damaged = ckpt.intact(p)
        return rd

    def _check_path(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise InputError(f"output.dir: {self.path} is not a directory")

    def _lock(self) -> None:
        self._check_path()
        p = self.path
        self.made = [d for d in (p, *p.parents) if not os.path.lexists(d)][::-1]
        try:
            p.mkdir(parents=True, exist_ok=True)
            self.lock = owner.DirLock.acquire(p)
        except owner.Locked as e:
            self._remove_made()
            raise in_use(p, e.holder) from None
        except OSError as e:
            self._remove_made()
            raise InputError(f"output.dir: {p} is not writable ({e.strerror or e})") from None
        cache = p / CACHE
        if os.path.lexists(cache):
            self.cached = set(os.listdir(cache)) if cache.is_dir() and not cache.is_symlink() else set()

    def inspect(self) -> None:
        """Which checkpoint a start resumes, and whether this config may resume it (read-only)."""
        compat.check_accept_keys(self.cfg)
        self.candidates, self.damaged = ckpt.intact(self.path)
        if self.candidates:
            self.check_resumable(self.candidates[0])

    def check_resumable(self, ck: Path) -> None:
        assert self.store is not None  # a probe without a store checks no checkpoint (probe)
        trainer = ckpt.read_trainer(ck)
        if trainer.get("model_fingerprint") != ckpt.model_fingerprint(self.store):
            raise InputError(
                f"output.dir: {self.path} holds a checkpoint of a different model ({ck.name}); "
                "use another output.dir or remove the run dir"
            )
        check_same_kind(self.cfg.lora, trainer, self.path, ck)
        if trainer.get("dtype") != self.cfg.engine.dtype:
            raise InputError(
                f"engine.dtype: {self.cfg.engine.dtype} differs from the checkpoint's "
                f"{trainer.get('dtype')} in {ck} (its optimizer state has another layout; engine.dtype: "
                f"auto decides per machine): set engine.dtype: {trainer.get('dtype')} to resume it"
            )
        self.accepted = compat.check_resume(ckpt.read_config_text(ck), self.cfg, str(ck), ckpt.step_of(ck))

    @property
    def resume_step(self) -> int:
        return ckpt.step_of(self.candidates[0]) if self.candidates else 0

    @property
    def trained(self) -> bool:
        """The newest checkpoint is at or past train.steps: nothing left to train."""
        return bool(self.candidates) and self.resume_step >= self.cfg.train.steps

    def finished(self) -> bool:
        """Trained, and the finish (plot, export) of that very checkpoint completed."""
        if not self.trained:
            return False
        try:
            rec = json.loads((self.path / FINISHED).read_text())
        except (OSError, ValueError):
            return False
        return rec.get("checkpoint") == self.candidates[0].name and (
            rec.get("export") or not self.cfg.output.export
        )

    def damaged_at_load(self, ck: Path, why: str) -> None:
        """`ck` failed its deep check while loading: drop it, and check the next one may resume."""
        self.candidates.remove(ck)
        self.damaged.append((ck, why))
        if self.candidates:
            self.check_resumable(self.candidates[0])

    # -- begin: the run starts, the dir is written ---------------------------------------------
    def begin(self) -> None:
        if self.follower:
            return
        for ck, why in self.damaged:
            aside = ckpt.quarantine(ck)
            self.console.print(
                f"[yellow]warning:[/] {escape(why)}; kept as {escape(str(aside))}", highlight=False
            )
        self.damaged = []
        ckpt.sweep(self.path)
        write_text_atomic(self.path / "config.yaml", dump_yaml(self.cfg))
        ckpt.prune(self.path, self.cfg.output.keep_last)
        self.made = []  # the run dir is in use now: never removed on the way out
        self.begun = True
        for line in self.accepted:
            self.console.print(f"[yellow]note:[/] resuming with a changed setting: {escape(line)}")

    def record_finished(self, ck: Path, exported: bool) -> None:
        if self.follower:
            return
        rec = {"step": ckpt.step_of(ck), "checkpoint": ck.name, "export": exported}
        write_text_atomic(self.path / FINISHED, json.dumps(rec) + "\n")

    # -- release -------------------------------------------------------------------------------
    def _release(self) -> None:
        if self.lock is not None:
            if not self.begun:
                self._undo()  # while still locked: no other start can be writing here
            self.lock.release()
            self.lock = None
        self._remove_made()

    def _undo(self) -> None:
        """A start that failed before begin(): remove what it wrote (everything in a run dir it
        created; in an existing one, the cache entries it added), never what was there before."""
        if self.path in self.made:
            for child in self.path.iterdir():
                if child.name != owner.DirLock.NAME:
                    _remove(child)
            return
        cache = self.path / CACHE
        if self.cached is None:
            _remove(cache)
        elif cache.is_dir() and not cache.is_symlink():
            for name in set(os.listdir(cache)) - self.cached:
                _remove(cache / name)

    def _remove_made(self) -> None:
        for d in reversed(self.made):
            with contextlib.suppress(OSError):
                d.rmdir()  # only while still empty
        self.made = []


def in_use(path: Path, holder: str) -> InputError:
    return InputError(f"output.dir: {path} is in use by {holder} (one `horizon train` per run dir)")


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
