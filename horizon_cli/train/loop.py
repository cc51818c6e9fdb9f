"""The training loop: schedule, steps, evaluation, metrics, progress, checkpoints, export.

The data of step s is a pure function of (seed, s), and a checkpoint holds the complete
training state, so a run resumed from step_N continues exactly as if it had never stopped.

Sharded runs (`dist`): every rank builds the same global batch and takes its contiguous share
of its micro-batches (the same number on every rank: parallel.shard.check_world); the loss is
divided by the global batch's label count, which every rank counts itself. Rank 0 alone writes
metrics, shows progress and finishes the run (plot, export); checkpoints are collective.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.progress import Progress

from ..arch.calls import spec_sequence
from ..config import Config, dump_yaml
from ..data import PreparedData
from ..data.batch import MicroBatch
from ..engine import Engine, StepResult
from ..engine.build import build_engine
from ..engine.ranks import ranks_for
from ..engine.stats import combine
from ..engine.tuning import tuning_for
from ..errors import HorizonError, InputError
from ..faults import phase
from ..fmt import fmt_bytes, fmt_loss
from ..lora.setup import LoraSetup
from ..optim.schedules import lr_at
from ..parallel.comm import Dist
from ..progress import byte_progress, train_columns
from ..recipes.recipe import Attached
from ..recipes.registry import batches_for
from ..store import Store, ckpt
from ..vision.run import has_images, vision_stage
from . import checkpoint
from .checkpoint import verify_base
from .checks import kernel_ready
from .inputs import load_data
from .keep_choice import kept_layers
from .metrics import MetricsLog, plot_loss, read_metrics
from .rundir import RunDir
from .samples import Samples, keep_until
from .trackers import Trackers


class Trainer:
    def __init__(
        self,
        cfg: Config,
        store: Store,
        rd: RunDir,
        console: Console,
        lora: LoraSetup | None = None,
        dist: Dist | None = None,
        keep: int = 0,
        samples: Samples | None = None,
    ):
        """keep: the kept layers K the plan chose (engine.keep_activations; planning.keep)."""
        self.cfg, self.store, self.rd, self.console = cfg, store, rd, console
        self.keep = keep
        self.samples = samples  # eval-time samples (train.samples), answered at each eval
        self.dist = dist  # a sharded run's rank (None: one process), passed to the engine
        self.lora = lora  # LoRA: the frozen base is `store` itself, checkpoints hold the adapters
        self.tuning = tuning_for(lora)  # what train/ asks of the run's training (engine.tuning)
        self.ranks = ranks_for(dist)  # ... and of its processes (engine.ranks)
        self.main = self.ranks.is_main
        self.run_dir = rd.path
        self.proc = psutil.Process()
        self._engine: Engine | None = None
        self.saved = -1  # the step of the last checkpoint this process wrote or resumed

    # -- setup -------------------------------------------------------------------------------
    def run(self) -> dict:
        if self.rd.trained:  # killed after its last checkpoint: only the finish may be left to do
            ck = self.rd.candidates[0]
            why = ckpt.check(ck, deep=True)  # the engine that would have checked it is not built
            if why is not None:
                self.rd.damaged_at_load(ck, why)
        if self.rd.trained:
            self.rd.begin()
            return self._finish(self.rd.resume_step)
        self.data = self._load_data()
        self.batches = batches_for(self.cfg, self.data)  # the run's recipe (recipes.registry)
        kernel_ready(self.cfg.optim.kernel, self.console)  # a build is its own phase, not step 1's
        try:
            state = self._resume()
            # the trackers start before the run dir changes: one that cannot start fails the start
            trackers = Trackers(self.cfg, self.run_dir, state["step"], self.console) if self.main else None
            try:
                self.batches.attach(Attached(self.engine, self.store, self.run_dir, self.console, self.main))
                self.rd.begin()  # everything is checked and loaded: from here on the run dir changes
                self.batches.prepare(state["step"])  # preference, kto: the reference pass before step 1
                self.bad = state.get("bad_steps", 0)
                if self.samples is not None and self.main:
                    keep_until(self.run_dir, state["step"])
                self.metrics = (
                    MetricsLog(
                        self.run_dir, state["step"], self.cfg.log.tensorboard, self.console, trackers=trackers
                    )
                    if self.main
                    else _NoMetrics()
                )
            except BaseException:
                if trackers is not None:
                    trackers.close()
                raise
            try:
                last = self._loop(state["step"])
            finally:
                self.metrics.close()
            return self._finish(last)
        finally:
            self.batches.close()
            self._close_engine()

    def _load_data(self) -> PreparedData:
        """Rank 0 tokenizes (and fills the run's cache) first; the others then read the cache."""
        return self.ranks.first(lambda: load_data(self.cfg, self.store, self.run_dir / "cache", self.console))

    def _resume(self) -> dict:
        """Build the engine on the newest checkpoint that loads intact (a damaged one is set
        aside and the one before it tried), or on the model when there is none."""
        while self.rd.candidates:
            ck = self.rd.candidates[0]
            phase("load", ckpt.step_of(ck))
            try:
                self._engine = self._build_engine(ck)
                state = checkpoint.load(self._engine, ck)
            except InputError:
                self._close_engine()
                why = ckpt.check(ck, deep=True)
                if why is None:
                    raise
                self.rd.damaged_at_load(ck, why)  # reported and renamed aside by rd.begin()
                continue
            self.console.print(f"[bold]resuming[/] from {ck} (step {state['step']})")
            self.saved = state["step"]
            return state
        phase("load", 0)
        checkpoint.seed_globals(self.cfg.train.seed)  # a checkpoint restores them instead
        self.tuning.fresh()  # LoRA: a fresh start after all (every checkpoint damaged) needs lora.init
        self._engine = self._build_engine(None)
        return {"step": 0, "bad_steps": 0}

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "no engine before _resume"
        return self._engine

    def _close_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def _images(self) -> bool:
        """Whether the engine runs the vision tower: images in the data, or projector adapters
        (whose checkpoint files must exist even in a step without images)."""
        return has_images(self.data.train) or bool(self.lora is not None and self.lora.tower)

    def _build_engine(self, ck: Path | None) -> Engine:
        src = self.tuning.source(ck, self.store)  # a checkpoint's store, or the frozen base
        keep = kept_layers(
            self.keep,
            self.cfg,
            ck,
            self.ranks,
            self.store.arch.n_layers,
            self.console,
            calls=len(spec_sequence(self.store.arch)),
        )
        with byte_progress(self.console, "load weights", src.nbytes()) as advance:
            obj = self.batches.objective  # None: SFT's TokenCE; else the recipe's own
            engine = build_engine(
                self.cfg,
                src,
                lora=self.lora,
                dist=self.dist,
                progress=advance,
                objective=obj,
                keep=keep,
                stage=vision_stage(src, self.cfg.train.vision, self.lora) if self._images() else None,
            )
        try:
            verify_base(engine, ck, src)  # sharded: the model's checksums, split over the ranks
        except BaseException:
            engine.close()
            raise
        if engine.optimizer.note:
            self.console.print(f"[yellow]warning:[/] {engine.optimizer.note}")
        host = sum(engine.host.nbytes().values()) + (sum(engine.base.nbytes().values()) if engine.base else 0)
        what = self.tuning.describe(engine.host) + self.ranks.describe()
        self.console.print(
            f"engine: {engine.t.kind} {engine.t.device}, {self.cfg.engine.dtype}, prefetch {self.cfg.engine.prefetch}, "
            f"AdamW kernel {engine.optimizer.kernel_name}, host state {fmt_bytes(host)}{what}"
        )
        return engine

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self, start: int) -> int:
        cfg, t = self.cfg, self.cfg.train
        step = start
        fields = "loss [cyan]{task.fields[loss]}[/] lr {task.fields[lr]} {task.fields[tps]} tok/s RAM {task.fields[ram]}"
        with Progress(*train_columns(t.steps, fields), console=self.console) as prog:
            task = prog.add_task("train", total=t.steps, completed=start, loss="-", lr="-", tps="-", ram="-")
            t_prev = time.perf_counter()
            while step < t.steps:
                phase("step", step + 1)
                row = self._step(step)
                now = time.perf_counter()
                row["step_s"] = now - t_prev
                row["tokens_per_s"] = row["input_tokens"] / row["step_s"]
                t_prev = now
                step += 1
                answers = []
                if t.eval_every and step % t.eval_every == 0:
                    row.update(self.evaluate())
                if self.samples is not None and (
                    step % t.eval_every == 0 if t.eval_every else step == t.steps
                ):
                    answers = self.samples.answer(self.engine, step)
                self.metrics.write(row)
                self._show(prog, task, row)
                if answers and self.main:
                    Samples.write(self.run_dir, answers)
                    Samples.show(prog.console, answers)
                phase("after-step", step)
                if row["skipped"]:
                    self._bad_step(row)
                if cfg.output.save_every and step % cfg.output.save_every == 0 and step < t.steps:
                    self.save(step)
                    t_prev = time.perf_counter()
        return step

    def _step(self, step: int) -> dict:
        cfg, t = self.cfg, self.cfg.train
        s = cfg.schedule
        lr = lr_at(
            step, lr=cfg.optim.lr, total=t.steps, kind=s.kind, warmup=s.warmup_steps, min_ratio=s.min_lr_ratio
        )
        mbs, input_tokens = self.batches.step(step)
        divisor = self.engine.objective.divisor(mbs)  # the global batch's (label tokens, or pairs)
        res: StepResult = self.engine.step(self._share(mbs), lr, divisor)
        return {
            "step": step + 1,
            "loss": res.loss if math.isfinite(res.loss) else None,
            "lr": lr,
            "grad_norm": res.grad_norm if math.isfinite(res.grad_norm) else None,
            "tokens": sum(mb.label_tokens for mb in mbs),
            "input_tokens": input_tokens,  # without padding
            "skipped": res.skipped,
            "engine_s": res.step_s,
            "h2d_bytes": res.h2d_bytes,
            "d2h_bytes": res.d2h_bytes,
            "weight_loads": res.weight_loads,
            "device_peak_bytes": res.device_peak_bytes,
            "kept_layers": res.kept_layers,  # K: the last K layers neither recomputed nor loaded again
            "host_rss_bytes": self.proc.memory_info().rss,
            "aux_loss": res.aux_loss,  # MoE: load-balancing loss (None for dense models)
            "expert_imbalance": res.expert_imbalance,  # MoE: max/mean tokens per expert, per routed layer
            **self.batches.metrics(res.stats, res.tokens),  # preference: rewards, accuracy, logps
        }

    def _share(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        """This rank's contiguous share of the global batch's micro-batches (all of them on one)."""
        return self.ranks.share(mbs)

    def _show(self, prog: Progress, task, row: dict) -> None:
        loss = fmt_loss(row["loss"]) if row["loss"] is not None else "nan"
        prog.update(
            task,
            advance=1,
            loss=loss,
            lr=f"{row['lr']:.2e}",
            tps=f"{row['tokens_per_s']:,.0f}",
            ram=fmt_bytes(row["host_rss_bytes"]),
        )
        if row["step"] % self.cfg.log.every == 0 or row["step"] == self.cfg.train.steps or "eval_loss" in row:
            ev = f" eval {fmt_loss(row['eval_loss'])}" if row.get("eval_loss") is not None else ""
            gn = f"{row['grad_norm']:.3f}" if row["grad_norm"] is not None else "nan"
            prog.console.print(
                f"step {row['step']:>5}/{self.cfg.train.steps}  loss {loss}{ev}  lr {row['lr']:.2e}  grad {gn}  "
                f"{row['tokens_per_s']:,.0f} tok/s  {row['step_s']:.2f} s/step"
                + self.batches.show(row)
                + ("  [red]skipped: non-finite[/]" if row["skipped"] else ""),
                highlight=False,
            )

    def _bad_step(self, row: dict) -> None:
        self.bad += 1
        if self.bad >= self.cfg.train.max_bad_steps:
            raise HorizonError(
                f"step {row['step']}: {self.bad} non-finite steps in a row (loss or gradient is NaN/inf); "
                "stopping. Lower optim.lr, check the data, or resume from the last checkpoint."
            )

    # -- eval, save, finish ------------------------------------------------------------------
    def evaluate(self) -> dict:
        """eval_loss (and a preference run's eval_rewards_*, eval_logps_*) over the held-out data."""
        ev = self.data.eval
        if ev is None or not len(ev):
            return {"eval_loss": None}
        self.engine.wait()
        total, n, sums = 0.0, 0, dict[str, float]()
        for mbs in self.batches.eval_batches():
            s, k, stats = self.engine.evaluate(self._eval_share(mbs))
            total, n = total + s, n + k
            sums = combine(self.engine.objective.reductions, sums, stats)  # each stat by its kind
        return {"eval_loss": total / n if n else None, **self.batches.metrics(sums, n, "eval_")}

    def _eval_share(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        """Micro-batches dealt round-robin; a rank short of one gets a copy of the first with no
        labels (every rank must run the same loads and collectives; it adds nothing)."""
        return self.ranks.eval_share(mbs, MicroBatch.unlabelled)

    def save(self, step: int) -> Path:
        trainer = {
            "step": step,
            "adam_step": self.engine.adam_step,
            "memory": self.cfg.optim.mode.form,  # which state files it holds
            "bad_steps": self.bad,
            "dtype": self.cfg.engine.dtype,
            "model_fingerprint": ckpt.model_fingerprint(self.store),
            "seed": self.cfg.train.seed,
            **self.tuning.trainer_fields(self.store),  # LoRA: the frozen base it names
            "kept_layers": self.engine.kept_layers,  # reused on resume (engine.keep_activations: auto)
        }
        path = checkpoint.save(
            self.engine,
            self.run_dir,
            step,
            trainer,
            dump_yaml(self.cfg),
            self.store,
            self.cfg.output.keep_last,
        )
        self.saved = step
        self.console.print(f"saved checkpoint {path}", highlight=False)
        return path

    def _follower_finish(self, step: int, ck: Path) -> dict:
        """A rank > 0 is done once the last checkpoint is written: rank 0 finishes the run."""
        return {"step": step, "checkpoint": str(ck), "rank": self.ranks.rank}

    def _finish(self, step: int) -> dict:
        """The last checkpoint, the loss plot, the export; then finished.json, written last."""
        if self._engine is not None and self.saved != step:
            ck = self.save(step)
        else:
            ck = self.run_dir / "checkpoints" / f"step_{step}"
        if not self.main:
            return self._follower_finish(step, ck)
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        final = rows[-1]["loss"] if rows else None
        out = {"step": step, "checkpoint": str(ck), "final_loss": final}
        if self.cfg.log.plot and rows:
            out["plot"] = str(plot_loss(rows, self.run_dir / "loss.png", title=f"{self.run_dir.name}"))
        out.update(self.tuning.finish(ck, self.run_dir))  # LoRA: the adapter alone, as PEFT files
        if self.cfg.output.export:
            from ..export import export

            phase("export")
            dst = self.run_dir / "export"
            export(ck, dst, force=True, console=self.console)  # LoRA: the base with the adapters merged
            out["export"] = str(dst)
        self.rd.record_finished(ck, exported=self.cfg.output.export)
        phase("finished")
        self.console.print(
            f"[green]done[/]: {step} steps, final loss {fmt_loss(final)}, checkpoint {ck}"
            + (f", HF export {out['export']}" if "export" in out else ""),
            highlight=False,
        )
        return out


class _NoMetrics:
    """Metrics of a rank > 0: rank 0 writes the run's."""

    def write(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass
