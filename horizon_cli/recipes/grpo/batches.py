"""The train loop's strategy for an `rl:` run (recipes.registry chooses it): each step's
batch is sampled, scored and given advantages here before the engine trains on it.

    step s       the group of steps g = s - s mod num_iterations reuses one batch of rollouts:
                 at s = g, train.batch_size prompts (data.sampler, batch g / num_iterations)
                 x G completions sampled on the current weights (rl.rollouts), scored
                 (rl.rewards), advantages over the whole batch (rl.advantages), the rollout
                 policy's log-probs (num_iterations > 1) and the reference's (beta > 0)
                 from forward-only sweeps (rl.logps), rollouts/step-N.jsonl written; then
                 micro-batches of train.micro_batch_size completions for recipes.grpo.loss
    eval         the held-out prompts sampled alike (a fixed seed), scored: eval_reward, ...;
                 their rollouts written to rollouts/eval-step-N.jsonl (N: the step it follows)
    ranks        under torchrun each rank samples and scores its contiguous part of the prompts
                 (engine.ranks.part: a group whole on one rank, rows seeded by their place in the
                 whole batch), the ranks decoding in lock step (generate.decoder); the rollouts
                 and their rewards are then gathered, so every rank holds the step's whole batch
                 in one process's order: advantages, metrics and the loss's divisors are the
                 whole batch's, and the loop trains each rank on its share of the micro-batches.
                 The forward-only sweeps (old, reference) run on an even share of the
                 micro-batches each, their log-probs gathered; rank 0 writes the run dir's files
    metrics      TRL's names: reward, reward_std, rewards/<name>/mean, frac_reward_zero_std,
                 completions/mean_length, completions/clipped_ratio, kl (beta > 0), entropy,
                 clip_ratio/{low,high,region}_mean, /low_min, /high_max, num_tokens (TRL's
                 num_input_tokens_seen: every sampled batch's prompt + completion tokens so far,
                 read back on resume: recipes.grpo.seen); and the step's split: rollout_s,
                 reference_s, rollout_tokens_per_s

The reference (beta > 0) is the initial model: for full fine-tuning a forward-only engine on the
model's store (nothing resident: its layers stream as the trained ones do); for fresh LoRA
adapters the base, the adapters off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ...config import Config
from ...config.schema import OptimConfig
from ...data import PreparedData, batch_indices
from ...data.batch import MicroBatch
from ...data.prompt_only import PromptRow, PromptSet
from ...data.prompts import model_eos_ids
from ...engine import Engine
from ...errors import InputError
from ...faults import phase
from ...generate.decoder import SweepStats
from ..recipe import Attached, Metrics
from . import rollouts as ro
from .advantages import advantages, reward_metrics
from .images import ImageSafeSampler, check_images, image_tokens, reference_stage
from .logps import token_logps
from .loss import GRPOObjective, payload_of, ratio_metrics, token_means
from .prompts import prompt_data
from .reward_model import RewardModel, check_models, model_scores, models
from .rewards import load_rewards, score
from .rollout_engine import Rollouts
from .sampling import correct
from .seen import tokens_seen
from .tools import load_toolbox
from .turns import finish, start, tool_metrics

if TYPE_CHECKING:
    from transformers import TrainerState

EVAL_SEED = 0x3C6EF372  # eval rollouts: the same seed at every evaluation


def unpadded(mbs: list[MicroBatch]) -> int:
    """The micro-batches' tokens without padding (prompt + completion of every row)."""
    return sum(int(mb.lengths.sum()) for mb in mbs if mb.lengths is not None)


class GRPOBatches:
    def __init__(self, cfg: Config, data: PreparedData) -> None:
        assert cfg.rl is not None
        self.cfg, self.rl, self.data = cfg, cfg.rl, prompt_data(data)
        self.rewards = load_rewards(cfg.rl.rewards, cfg.data)  # before any weight is loaded
        self.toolbox = load_toolbox(cfg.rl)  # rl.tools, rl.environment (recipes.grpo.tools)
        check_images(cfg, self.data)  # here, not in attach: the dry run builds the batches too
        check_models(self.rewards, self.data.train, self.data.eval)  # what a reward model cannot score
        self.weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)
        self.objective = GRPOObjective(cfg.rl)
        self.group: tuple[int, list[MicroBatch], dict] | None = None
        self.eval_rows: dict = {}
        self.engine: Engine | None = None
        self.fresh = True
        self.ref_engine: Engine | None = None
        self.seen = 0  # TRL's num_input_tokens_seen: prompt + completion tokens sampled in training
        self.done = 0  # the steps trained (an evaluation's rollouts are named after the last)

    # -- the loop's hooks ----------------------------------------------------------------------
    def attach(self, run: Attached) -> None:
        engine, store = self.engine, self.store = run.engine, run.store
        self.run_dir, self.console, self.main = run.run_dir, run.console, run.main
        self.ranks = engine.ranks
        hf = getattr(store, "hf_dir", None) or store.root / "hf"
        self.tokenizer = self.data.train.tokenizer
        self.eos = model_eos_ids(hf) or (
            [eos] if (eos := getattr(self.tokenizer, "eos_token_id", None)) is not None else []
        )
        if self.rl.top_entropy_quantile < 1.0 and self.ranks.world > 1:
            raise InputError(
                "rl.top_entropy_quantile: the entropy quantile over the whole batch is not computed across "
                "ranks yet; run it on one process (or set 1.0)"
            )
        self.banned = image_tokens(self.data, store, self.cfg.data)  # the image token: never sampled
        self.rollouts = Rollouts(  # streamed or a resident copy (rl.rollout_engine)
            self.rl,
            engine,
            engine.lora is not None,
            self.cfg.engine.kv_cache,
            self.cfg.train.batch_size * self.rl.num_generations,
            max((len(r.ids) for r in self.data.train.rows), default=1),
        )
        self.ref_adapters = True
        if self.rl.beta > 0 and engine.lora is not None:
            if not engine.tuning.reference_on_base:
                raise InputError(
                    "rl.beta: a reference for adapters started from lora.init is not supported yet (beta: 0)"
                )
            self.ref_adapters = False  # fresh adapters: the initial policy is the base
        elif self.rl.beta > 0:
            # sharded like the policy: every rank holds its slice, layers all-gathered per sweep
            self.ref_engine = Engine(
                store,
                self.cfg.engine,
                OptimConfig(),
                forward_only=True,
                dist=engine.p.dist,
                stage=reference_stage(self.cfg, self.data, store),
            )

        for m in models(self.rewards):  # a reward model: its forward-only engine, sharded like the reference
            m.open(self.cfg.engine, engine.p.dist)

    def close(self) -> None:
        closing: list[Engine | RewardModel] = [*models(self.rewards), *filter(None, [self.ref_engine])]
        for e in closing:
            e.close()
        self.ref_engine = None

    def prepare(self, start: int) -> None:
        """The reference is scored per step; a resumed run's count of tokens seen is read back."""
        self.seen = tokens_seen(self.run_dir, start) if start else 0

    def step(self, step: int) -> tuple[list[MicroBatch], int]:
        mu = self.rl.num_iterations
        g = step - step % mu
        self.done = step + 1
        self.fresh = step == g  # a later step of the group reuses its rollouts: no rollout time
        if self.group is None or self.group[0] != g:
            if step == g:
                self.group = (g, *self._rollouts(g))
            else:  # resumed inside a group: the rollouts of its first step, as they were
                got = ro.load_group(self.run_dir, g)
                if got is None:
                    raise InputError(
                        f"output.dir: {self.run_dir}/rollouts/step-{g + 1}.pt is missing: a run resumed inside a "
                        "group of rl.num_iterations steps needs that group's rollouts"
                    )
                self.group = (g, got["mbs"], got["metrics"])
        return self.group[1], unpadded(self.group[1])

    def eval_batches(self) -> Iterator[list[MicroBatch]]:
        ev, t = self.data.eval, self.cfg.train
        n = min(len(ev), t.batch_size * t.eval_batches) if ev is not None else 0
        self.eval_rows = {}
        sums: dict = {}
        shown: list[str] | None = [] if self.main else None
        for a in range(0, n, t.batch_size):
            idx = list(range(a, min(n, a + t.batch_size)))
            assert ev is not None  # n > 0
            mbs, m, _ = self._sample(ev, ev.take(idx), ro.step_seed(t.seed ^ EVAL_SEED, a), -1, shown)
            for k, v in m.items():
                if isinstance(v, float | int):
                    sums.setdefault(k, []).append(v)
            yield mbs
        pick = {"min": min, "max": max}  # completions/min_length: the least over the batches
        self.eval_rows = {
            k: pick.get(k.rpartition("/")[2].split("_")[0], lambda v: sum(v) / len(v))(v)
            for k, v in sums.items()
        } | {"num_tokens": self.seen}  # TRL's eval row: the training count at the time
        if shown:
            ro.write(self.run_dir, f"eval-step-{self.done}", shown)

    def metrics(self, stats: dict[str, float], n: int, prefix: str = "") -> Metrics:
        out = dict(self.eval_rows) if prefix else dict(self.group[2]) if self.group else {}
        if not prefix and not self.fresh:
            out |= {"rollout_s": 0.0, "reference_s": 0.0, "rollout_tokens_per_s": None}
        out |= token_means(self.rl, stats)  # entropy, kl
        out |= ratio_metrics(self.rl, stats)  # at num_iterations 1 and in eval too (ratio 1: 0), as TRL
        return {prefix + k: v for k, v in out.items()}

    def show(self, row: Mapping[str, object]) -> str:
        r = row.get("reward")
        split = f"{row.get('rollout_s', 0):.1f}/{row.get('reference_s', 0):.1f}/{row.get('engine_s', 0):.1f}"
        speed = row.get("rollout_tokens_per_s")  # None: the step reused its group's rollouts
        roll = "rollouts reused" if speed is None else f"rollout {speed:,.0f} tok/s"
        if (calls := row.get("tools/call_frequency")) is not None:
            roll += f"  tools {calls:.2f}/completion ({row.get('tools/failure_frequency', 0):.0%} failed)"
        return (
            f"  reward {r:.3f}" if r is not None else "  reward -"
        ) + f"  {roll}  rollout/ref/train {split} s"

    # -- one batch of rollouts -----------------------------------------------------------------
    def _rollouts(self, g: int) -> tuple[list[MicroBatch], dict]:
        t = self.cfg.train
        idx = batch_indices(
            len(self.data.train), g // self.rl.num_iterations, t.batch_size, t.seed, self.cfg.data.shuffle
        )
        shown: list[str] | None = [] if self.main else None
        mbs, m, sampled = self._sample(
            self.data.train, self.data.train.take(idx), ro.step_seed(t.seed, g), g, shown
        )
        if shown is not None:
            ro.write(self.run_dir, f"step-{g + 1}", shown)
        self.seen += sampled  # every rank holds the whole batch's rows
        m["num_tokens"] = self.seen
        if self.rl.num_iterations > 1 and self.main:
            ro.save_group(self.run_dir, g, {"mbs": mbs, "metrics": m})
        return mbs, m

    def _sample(
        self, src: PromptSet, prompts: list[PromptRow], seed: int, step: int, shown: list[str] | None
    ) -> tuple[list[MicroBatch], dict, int]:
        """The rollouts of `prompts` (rows of `src`, the training or eval set: conversational or not
        on its own, as TRL tells per batch) as micro-batches, metrics and TRL's num_tokens count of
        them (prompt + the ids the model sampled, not a tool result's); `shown` gets JSONL lines."""
        assert self.engine is not None
        rl, G = self.rl, self.rl.num_generations
        sweeps: list = []
        lo, hi = self.ranks.part(len(prompts))
        t0 = time.perf_counter()

        def on_sweep(s: SweepStats) -> None:  # a crash-test mark in every decode sweep (faults.py): rollout:N
            phase("rollout", step + 1)
            sweeps.append(s)

        # a rank without prompts (a short eval batch) samples the first one, unused: it joins each sweep
        mine = [p.ids for p in prompts[lo:hi]] or [prompts[0].ids]
        pics = [p.media for p in prompts[lo:hi]] or [prompts[0].media]
        knobs = (rl.temperature, rl.top_p, rl.top_k, seed, self.banned, rl.min_p, rl.repetition_penalty)
        pick = ImageSafeSampler(*knobs) if self.banned else None  # the image token never sampled
        turns = (
            start(
                self.toolbox,
                self.tokenizer,
                prompts[lo:hi] or prompts[:1],
                G,
                lo,
                rl.max_completion_length,
                self.engine.spec.max_positions,
            )
            if self.toolbox is not None
            else None
        )
        outs = self.rollouts.sample(
            mine,
            G,
            seed,
            pick,
            eos=self.eos,
            tokenizer=self.tokenizer,
            on_sweep=on_sweep,
            first=lo,
            media=pics,
            more=turns.more if turns is not None else None,
        )
        envs = finish(turns, outs, G, lo) if turns is not None else None
        if turns is not None and turns.failed and shown is not None:
            self.console.print(
                f"[yellow]warning:[/] {turns.failed} (its error went to the model)", highlight=False
            )
        outs = [replace(o, prompt=o.prompt + lo) for o in outs] if hi > lo else []
        t1 = time.perf_counter()
        logs: dict = {}  # what the functions passed to log_metric / log_extra (this rank's)
        try:
            vals, bad = self._score(prompts, outs, step, src.conversational, logs, envs), None
        except InputError as e:  # every rank stops with the first failing rank's line
            vals, bad = [], str(e)
        parts = self.ranks.gather((outs, vals, bad))
        if bad := next((b for _, _, b in parts if b is not None), None):
            raise InputError(bad)
        outs = [o for o_r, _, _ in parts for o in o_r]
        per_func = torch.tensor(
            [sum((v_r[i] for _, v_r, _ in parts), []) for i in range(len(self.rewards))], dtype=torch.float32
        ).T.contiguous()  # (n, F)
        size = self.cfg.train.micro_batch_size  # a reward model: one sweep over the batch
        t_rm = model_scores(self.rewards, per_func, self.ranks, prompts, outs, src, size)
        adv, r, zero = advantages(per_func, self.weights, G, rl.scale_rewards)
        if shown is not None and bool(torch.isnan(per_func).all(dim=1).any()):  # TRL's warning, once a batch
            k = int(torch.isnan(per_func).all(dim=1).nonzero()[0])
            self.console.print(
                f"[yellow]warning:[/] All reward functions returned None for completion {k % G + 1} of "
                f"{prompts[outs[k].prompt].where}; at least one should return a reward",
                highlight=False,
            )
        mbs = ro.micro_batches_of(
            outs, adv, self.cfg.train.micro_batch_size, self.data.pad_id, rl.mask_truncated_completions
        )
        t2 = time.perf_counter()
        # a sampler apart from the trained weights (its rollouts carry their log-probs: the resident
        # engine's, issue 40): the old log-probs are always swept, as TRL does under vLLM
        apart = bool(mbs) and all(payload_of(mb).sampling is not None for mb in mbs)
        if rl.num_iterations > 1 or (apart and rl.importance_sampling_correction):
            self._logps(self.engine, mbs, "old", True)
        if rl.beta > 0:
            self._logps(self.ref_engine or self.engine, mbs, "ref", self.ref_adapters)
        t3 = time.perf_counter()
        is_m = correct(rl, mbs) if apart and rl.importance_sampling_correction else {}
        if shown is not None:
            cols = {"prompt": [prompts[o.prompt].prompt for o in outs]} | logs.get("extra", {})  # as read
            shown += ro.lines(outs, [x.name for x in self.rewards], per_func, r, adv, cols)
        m = (
            reward_metrics(per_func, [x.name for x in self.rewards], r, zero)
            | ro.length_metrics(outs)
            | {
                "rollout_s": t1 - t0,
                "reference_s": t3 - t2,
                "rollout_tokens_per_s": ro.speed(sweeps),
                "rollout_refresh_s": self.rollouts.refresh_s,
            }
            | ({"reward_model_s": t_rm} if t_rm is not None else {})
            | {k: sum(v) / len(v) for k, v in logs.get("metrics", {}).items() if v}
        )  # log_metric: TRL's mean
        m |= is_m  # the sampler's (TRL's sampling/ metrics), when it is apart
        m |= tool_metrics(outs) if self.toolbox is not None else {}
        return mbs, m, sum(len(o.prompt_ids) + (sum(o.mask) if o.mask else len(o.ids)) for o in outs)

    def _state(self, step: int) -> TrainerState:
        """The TrainerState reward functions get, with TRL's fields (an epoch: the prompts once,
        each batch trained num_iterations times)."""
        from transformers import TrainerState

        t = self.cfg.train
        per_epoch = max(len(self.data.train) / t.batch_size, 1e-9) * self.rl.num_iterations
        return TrainerState(
            global_step=step,
            max_steps=t.steps,
            epoch=step / per_epoch,
            num_train_epochs=math.ceil(t.steps / per_epoch),
            train_batch_size=t.batch_size,
            logging_steps=self.cfg.log.every,
            is_world_process_zero=self.main,
        )

    def _score(
        self,
        prompts: list[PromptRow],
        outs: list[ro.Rollout],
        step: int,
        conversational: bool,
        logs: dict | None = None,
        envs: list | None = None,
    ) -> list[list[float]]:
        """Per reward function, this rank's completions' values (none: no call)."""
        if not outs:
            return [[] for _ in self.rewards]
        G = self.rl.num_generations
        comps = ro.completions_of(outs, conversational)
        cols: dict[str, list] = {k: [prompts[o.prompt].columns[k] for o in outs] for k in prompts[0].columns}
        if envs is not None and self.toolbox is not None and self.toolbox.environment is not None:
            cols["environments"] = envs  # TRL passes the rollouts' instances so

        def where(k: int) -> str:
            return f"completion {k % G + 1} of {prompts[outs[k].prompt].where}"  # from 1, as records

        return score(
            self.rewards,
            [prompts[o.prompt].prompt for o in outs],
            comps,
            [o.ids for o in outs],
            cols,
            max(step, 0),
            where,
            self._state(max(step, 0)),
            logs,
        )

    def _logps(self, engine: Engine, mbs: list[MicroBatch], key: str, adapters: bool) -> None:
        """GRPOPayload.old or .ref (key): each micro-batch's per-token log-probs (rl.logps). Each rank sweeps the same
        number of them (micro-batches dealt round-robin, a short rank padding with a copy whose
        result is dropped), then the ranks' results are gathered."""
        W = self.ranks.world
        got = self.ranks.gather(
            token_logps(engine, self.ranks.eval_share(mbs, lambda mb: mb), self.rl.temperature, adapters)
        )
        for j, mb in enumerate(mbs):
            pay = payload_of(mb)
            if key == "old":
                pay.old = got[j % W][j // W]
            else:
                pay.ref = got[j % W][j // W]
