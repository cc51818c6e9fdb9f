"""Config schema: one typed dataclass tree, loaded strictly by `config.load`.

Each field may carry `metadata` used by the loader's validation:
  choices=(...)   allowed values
  min=/max=       inclusive numeric bounds (`gt=` for a strict lower bound)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..optim.modes import EXACT, MODES, MemoryMode, memory_mode


def _f(default, **meta):
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    path: str = _f("")  # a store written by `horizon convert`
    # the model's dropout and router noise (its config.json's attn/resid/embd_pdrop, ...): null:
    # trained as the config sets them (engine/dropout.py); 0: off (the store is not changed)
    dropout: float | None = _f(None, min=0.0, max=0.0)


FORMATS = ("auto", "text", "instruction", "chat", "prompt_completion", "tokens", "preference", "prompt")


@dataclass
class SourceConfig:
    """One source of a run's data (an item of `data.path` as a list)."""

    path: str = _f("")  # a data file, a save_to_disk dir, a hub name, or a LLaMA-Factory dataset_info.json
    format: str | None = _f(None, choices=FORMATS)  # None: data.format
    weight: float = _f(1.0, gt=0.0)  # its rows per epoch: 2 = each twice, 0.5 = a seeded half
    split: str | None = _f(None)  # None: data.split
    names: list[str] | None = _f(None)  # dataset_info.json: the entries to use (None: all)


@dataclass
class DataConfig:
    # one source (a string), or several: a list of sources (a string item stands for {path: it})
    path: str | list[SourceConfig] = _f("")
    format: str = _f("auto", choices=FORMATS)
    max_seq_len: int = _f(2048, min=8)
    packing: bool = _f(False)
    shuffle: bool = _f(True)
    train_on_prompt: bool = _f(False)
    # the chat template: a Jinja string or a .jinja file (TRL's chat_template_path) instead of the
    # tokenizer's; kwargs for every rendering (TRL's chat_template_kwargs, e.g. enable_thinking: false)
    chat_template: str | None = _f(None)
    chat_template_kwargs: dict[str, Any] = _f({})
    eval_fraction: float = _f(0.0, min=0.0, max=0.5)
    eval_path: str | None = _f(None)
    split: str = _f("train")  # split name for hub datasets / save_to_disk dicts
    eval_split: str | None = _f(None)  # eval rows from this split of each source (a DatasetDict)
    cache_dir: str | None = _f(None)  # tokenization cache (default: <output.dir>/cache)
    ignore_fields: list[str] = _f([])  # fields no format reads that are metadata (fields.py)
    # images (vision.encode): one factor on both sides into [min_pixels, max_pixels] before the
    # processor, as LLaMA-Factory's image_max_pixels / image_min_pixels (its defaults)
    max_pixels: int = _f(768 * 768, min=1)
    min_pixels: int = _f(32 * 32, min=1)

    @property
    def where(self) -> str:
        """data.path as a line names it: the path, or the sources' paths (a registry's entries)."""
        if isinstance(self.path, str):
            return self.path
        return ", ".join(s.path + (f" ({', '.join(s.names)})" if s.names else "") for s in self.path)


@dataclass
class TrainConfig:
    steps: int = _f(1000, min=1)  # optimizer steps; with epochs: None until train/length.py resolves it
    epochs: float | None = _f(None, gt=0.0)  # instead of steps: passes over the training rows (pairs)
    batch_size: int = _f(64, min=1)  # sequences (preference: pairs) per optimizer step (global batch)
    micro_batch_size: int = _f(4, min=1)  # sequences (pairs) per forward/backward micro-batch
    seed: int = _f(0, min=0)
    eval_every: int = _f(0, min=0)
    eval_batches: int = _f(4, min=1)  # global batches per evaluation
    max_bad_steps: int = _f(3, min=1)  # consecutive non-finite steps that stop the run
    accept_changes: list[str] = _f([])  # resume despite these changed keys (train/compat.py)
    # eval-time samples: a prompts file (JSONL, as `horizon generate --prompts`) answered greedily at
    # each eval into <output.dir>/samples.jsonl; sample_tokens: new tokens per answer at most
    samples: str | None = _f(None)
    sample_tokens: int = _f(64, min=1)
    # a multimodal model's vision tower and projector (vision/): frozen (LLaMA-Factory's default:
    # freeze_vision_tower and freeze_multi_modal_projector are true), projector, or all
    vision: str = _f("frozen", choices=("frozen", "projector", "all"))


@dataclass
class OptimConfig:
    name: str = _f("adamw", choices=("adamw",))
    lr: float = _f(1.0e-5, min=0.0)
    betas: list[float] = _f([0.9, 0.95])
    eps: float = _f(1.0e-8, gt=0.0)
    weight_decay: float = _f(0.0, min=0.0)
    grad_clip: float = _f(1.0, min=0.0)  # global L2 norm; 0 disables
    kernel: str = _f("auto", choices=("auto", "torch", "native"))  # CPU AdamW implementation
    # exact: fp32 master + fp32 moments (= torch.optim.AdamW); lean: bf16 + 8-bit master correction,
    # 8-bit moments (optim/lean.py), <= 8 B/param in all
    memory: str = _f(EXACT.name, choices=tuple(MODES))
    # each unit's AdamW runs inside the backward as soon as its gradient is whole, its host gradient
    # returned at once (optim/modes.py RELEASED); auto: on only where the plan does not fit without
    # it (planning resolves it before the engine is built; until then auto reads as off)
    grad_release: str = _f("auto", choices=("auto", "true", "false"), bools={True: "true", False: "false"})

    @property
    def mode(self) -> MemoryMode:
        """optim.memory (and optim.grad_release) parsed: the mode every later question is asked of
        (optim/modes.py)."""
        return memory_mode(self.memory, self.grad_release == "true")


@dataclass
class ScheduleConfig:
    kind: str = _f("cosine", choices=("constant", "linear", "cosine"))
    warmup_steps: int = _f(0, min=0)
    min_lr_ratio: float = _f(0.0, min=0.0, max=1.0)


@dataclass
class EngineConfig:
    device: str = _f("auto")  # auto | cpu | cuda | cuda:N
    # the compute dtype; auto: bfloat16 where the device multiplies bf16 fast (CUDA compute
    # capability >= 8.0, a CPU with AVX-512 BF16 or AMX), else float32 (runtime/dtype.py); the
    # run records the resolved one
    dtype: str = _f("auto", choices=("auto", "bfloat16", "float32"))
    grad_dtype: str = _f(
        "auto", choices=("auto", "bfloat16", "float32")
    )  # gradients on the link and host (auto: dtype)
    prefetch: int = _f(2, min=1, max=8)  # weight buffers in flight (2 = double buffering)
    link_gbps: float = _f(0.0, min=0.0)  # device: cpu only — emulate a host<->device link (0: off)
    # device: cpu only, for tests and debugging — every copy on a thread of its own after a random
    # delay, ordered only by the engine's events (runtime/chaos.py): a missing wait shows as wrong numbers
    link_chaos: bool = _f(False)
    loss_chunk: int = _f(2048, min=16)  # label tokens per logits chunk in the loss head
    compute_threads: int = _f(0, min=0)  # torch intra-op threads (0: leave torch's default)
    # the last K layers keep their autograd graph and weights on the device from forward to backward
    # (no recompute, no second load); auto: as many as the plan's free memory holds; 0: recompute all
    keep_activations: int | str = _f("auto")
    # tokens per tile of each layer's token-local parts (MLP/MoE: model.tiling), run tile by tile in
    # the forward and the recompute; auto: untiled when the plan fits, else the largest tile that
    # fits what the plan leaves free (planning.tiling); 0: untiled
    seq_tile: int | str = _f("auto")
    # generation's KV cache (horizon generate, eval samples): auto (the device when the plan says
    # it fits there, else host memory) | device | host
    kv_cache: str = _f("auto", choices=("auto", "device", "host"))


@dataclass
class LoraConfig:
    """Present: train LoRA adapters (PEFT's LoRA) on a frozen, streamed base."""

    r: int = _f(16, min=1)
    alpha: float = _f(32.0, gt=0.0)  # scale alpha / r (use_rslora: alpha / sqrt(r))
    dropout: float = _f(0.0, min=0.0, max=0.9)  # on the adapter's input, as PEFT
    # PEFT target_modules: a list (exact module names or name suffixes) or one regex string that
    # must match the whole module name; "all-linear": every linear layer of the decoder layers
    targets: list[str] | str = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    use_rslora: bool = _f(False)
    init: str | None = _f(None)  # a PEFT adapter dir to start from (its r, alpha, targets must match)


PREF_LOSSES = ("dpo", "cdpo", "ipo", "simpo", "orpo", "kto")
REFERENCED = ("dpo", "cdpo", "ipo")  # the pair losses with a reference model (kto has one too)


@dataclass
class PreferenceConfig:
    """Present: preference optimisation on (prompt, chosen, rejected) pairs; each loss as TRL defines it
    (cdpo: conservative DPO, which TRL 1.16's DPOTrainer no longer has; see recipes/preference/loss.py)."""

    loss: str = _f("dpo", choices=PREF_LOSSES)
    beta: float = _f(0.1, gt=0.0)  # DPO/IPO/SimPO's beta; ORPO's lambda
    label_smoothing: float = _f(0.0, min=0.0, max=0.49)  # cdpo, simpo: the conservative loss's epsilon
    simpo_gamma: float = _f(0.5, min=0.0)  # simpo: the target reward margin
    sft_weight: float = _f(0.0, min=0.0)  # + this x the chosen completions' mean NLL (TRL's rpo_alpha)
    desirable_weight: float = _f(1.0, min=0.0)  # kto: the desirable examples' loss weight (TRL's name)
    undesirable_weight: float = _f(1.0, min=0.0)  # kto: the undesirable examples' loss weight


RL_LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "luspo", "sapo", "vespo")
BUILTIN_REWARDS = ("accuracy", "format", "length")
IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
ROLLOUT_ENGINES = ("auto", "resident", "streamed")
ROLLOUT_WEIGHTS = ("auto", "full", "fp8", "int8", "nf4")


@dataclass
class RewardConfig:
    """One reward function of an `rl:` run (recipes/grpo/rewards.py): a built-in name, "file.py:name" or
    "module:name" (TRL's calling convention), and its weight in the summed reward."""

    function: str = _f("")
    weight: float = _f(1.0)
    name: str | None = _f(
        None
    )  # its metric name (rewards/<name>/mean); default: the function's (model's) name
    pattern: str | None = _f(None)  # format: the regex the whole completion must match
    target: int | None = _f(None, min=1)  # length: the target completion length in tokens
    tolerance: int = _f(0, min=0)  # length: full reward within target +- tolerance
    column: str | None = _f(None)  # accuracy: the answer column (default: solution, else answer)
    # a reward model: the store of a converted XForSequenceClassification checkpoint (TRL's
    # reward_funcs take one; recipes/grpo/reward_model.py), instead of `function`
    model: str | None = _f(None)


@dataclass
class RLConfig:
    """Present: online RL (recipes/grpo/): each step samples num_generations completions per prompt on the
    current weights, scores them, and trains with TRL 1.16's GRPO loss. Defaults: GRPOConfig's."""

    algorithm: str = _f("grpo", choices=("grpo",))
    loss_type: str = _f("dapo", choices=RL_LOSSES)
    num_generations: int = _f(8, min=2)  # G: completions per prompt
    max_completion_length: int = _f(512, min=1)
    temperature: float = _f(1.0, gt=0.0)
    top_p: float = _f(1.0, gt=0.0, max=1.0)
    top_k: int = _f(0, min=0)  # 0: off
    min_p: float = _f(0.0, min=0.0, max=1.0)  # 0: off (TRL's None)
    repetition_penalty: float = _f(
        1.0, gt=0.0
    )  # 1: off; > 1 discourages the ids so far (prompt + completion)
    beta: float = _f(0.0, min=0.0)  # KL to the initial model (k3); 0: no reference pass
    epsilon: float = _f(0.2, min=0.0)
    epsilon_high: float | None = _f(None, min=0.0)  # None: epsilon
    num_iterations: int = _f(1, min=1)  # optimizer steps per batch of rollouts
    # true/false: "group"/"none", as GRPOConfig maps them
    scale_rewards: str = _f("group", choices=("group", "batch", "none"), bools={True: "group", False: "none"})
    mask_truncated_completions: bool = _f(False)
    rewards: list[RewardConfig] = _f([])
    # TRL 1.16's further GRPO options (GRPOConfig's names and defaults; recipes/grpo/loss.py)
    importance_sampling_level: str = _f("token", choices=("token", "sequence"))  # sequence: GSPO
    delta: float | None = _f(None, min=0.0)  # two-sided clipping: the ratio capped at delta (None: off)
    sapo_temperature_neg: float = _f(1.05, gt=0.0)  # sapo: the soft gate's temperature, advantage <= 0
    sapo_temperature_pos: float = _f(1.0, gt=0.0)  # sapo: advantage > 0
    vespo_k_pos: float = _f(2.0)  # vespo: the gamma weight's power, advantage >= 0
    vespo_lambda_pos: float = _f(3.0)  # vespo: its decay, advantage >= 0
    vespo_k_neg: float = _f(3.0)  # vespo: the power, advantage < 0
    vespo_lambda_neg: float = _f(2.0)  # vespo: the decay, advantage < 0
    off_policy_mask_threshold: float | None = _f(None, min=0.0)  # drop A < 0 sequences whose KL exceeds it
    top_entropy_quantile: float = _f(1.0, min=0.0, max=1.0)  # the loss on the top-rho tokens by entropy
    use_bias_correction_kl: bool = _f(True)  # the KL term times the importance ratio (TRL's default: on)
    # a sampler apart from the trained weights (its rollouts carry their log-probs): TRL 1.16's
    # vllm_importance_sampling_* (recipes/grpo/sampling.py); the streamed sampler needs none
    importance_sampling_correction: bool = _f(True)
    importance_sampling_mode: str = _f("sequence_mask", choices=IS_MODES)
    importance_sampling_clip_min: float | None = _f(None, min=0.0)
    importance_sampling_clip_max: float | None = _f(3.0, min=0.0)
    # where rollouts decode (recipes/grpo/rollout_engine.py): streamed (each layer over the link
    # every sweep) or resident (a weight-only copy of the policy on the device, refreshed once a
    # step, in rollout_weights' format: full = the compute dtype); auto: resident when it fits
    rollout_engine: str = _f("auto", choices=ROLLOUT_ENGINES)
    rollout_weights: str = _f("auto", choices=ROLLOUT_WEIGHTS)
    # tools in the rollouts (recipes/grpo/tools.py): functions "file.py:name" / "module:name", and an
    # environment class (one instance per rollout, its public methods the tools), as TRL 1.16's
    # tools / environment_factory; tool-calling rounds per completion at most (None: no limit)
    tools: list[str] = _f([])
    environment: str | None = _f(None)
    max_tool_calling_iterations: int | None = _f(None, min=0)
    tool_timeout_s: float = _f(60.0, gt=0.0)  # a tool call running longer fails (its error to the model)


@dataclass
class OutputConfig:
    dir: str = _f("")
    save_every: int = _f(0, min=0)  # checkpoint every N steps (0: only at the end)
    keep_last: int = _f(2, min=1)
    export: bool = _f(True)


@dataclass
class LogConfig:
    every: int = _f(1, min=1)
    tensorboard: bool = _f(False)
    plot: bool = _f(True)  # loss-curve PNG in the run dir at the end
    # experiment trackers (train/trackers.py), each an optional extra: the metrics.jsonl rows and the
    # resolved config. W&B: project wandb_project, the run named after output.dir (WANDB_MODE,
    # WANDB_API_KEY, ... as W&B reads them). MLflow: experiment mlflow_experiment at mlflow_uri
    # (default: MLFLOW_TRACKING_URI, else a file store in <output.dir>/mlruns)
    wandb: bool = _f(False)
    wandb_project: str = _f("horizon")
    mlflow: bool = _f(False)
    mlflow_uri: str | None = _f(None)
    mlflow_experiment: str = _f("horizon")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    lora: LoraConfig | None = None  # absent: full fine-tuning
    preference: PreferenceConfig | None = None  # absent: supervised fine-tuning
    rl: RLConfig | None = None  # present: online RL (GRPO) on prompts
    output: OutputConfig = field(default_factory=OutputConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def rows_per_example(self) -> int:
        """Sequences per counted example: a preference pair is two (chosen, rejected); an rl run's
        micro-batches count completions (one sequence each)."""
        return 2 if self.preference is not None else 1

    @property
    def dropout_off(self) -> str:
        """Why the run's method trains without the model's dropout ("": it trains with it): TRL's
        DPO, KTO, CPO (SimPO) and ORPO trainers disable it (`disable_dropout: true`), and horizon's
        preference losses are TRL's."""
        return "a preference run, as TRL's trainers (disable_dropout)" if self.preference is not None else ""

    @property
    def step_sequences(self) -> int:
        """Sequences one optimizer step trains on: an rl run's batch_size prompts x G completions."""
        per = self.rl.num_generations if self.rl is not None else self.rows_per_example
        return self.train.batch_size * per
