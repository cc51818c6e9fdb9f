"""horizon as a model of lm-evaluation-harness (the optional `lm_eval` package): `--model horizon
--model_args path=RUN_OR_STORE` scores a store or a run dir's newest checkpoint on the streamed
engine, on the machine that trained it.

    loglikelihood          requests sorted by length, `batch_size` rows per sweep of the weights
    loglikelihood_rolling  lm-eval's own rolling windows, scored the same way
    generate_until         the generation loop (generate.decoder): one sweep per new token for the
                           whole batch, stopping at `until` strings, EOS or max_gen_toks

Tokenization follows lm-eval's `hf` model rule for rule (its own helpers: BOS handling, the
prefix token of an empty context, trailing spaces moved to the continuation, left truncation), so
the scores are those of `--model hf` on the run's export (tests/generate/test_harness.py).

lm-eval has no plugin discovery: the model is registered when this module is imported.
`horizon eval SRC [lm_eval arguments]` does that and runs lm-eval's command line;
from Python, `import horizon_cli.generate.harness` before `lm_eval.simple_evaluate(model="horizon")`.
"""

from __future__ import annotations

import glob
import inspect
from pathlib import Path
from typing import NoReturn

import torch
from rich.console import Console

from ..data.batch import IGNORE, MicroBatch
from ..errors import InputError
from ..model.sample import Sampler
from .decoder import MICRO_TOKENS, Decoder
from .model_source import open_source
from .run import build

try:
    import jinja2
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        _add_special_kwargs,
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
except ImportError:  # pragma: no cover - the optional extra is missing
    raise InputError(
        "the evaluation harness needs lm-evaluation-harness: pip install 'horizon-cli[eval]'"
    ) from None

SAMPLING = ("do_sample", "temperature", "top_p", "top_k")
AUTO_BATCH = 64  # batch_size "auto" (or lm-eval's "auto:N"): rows per sweep


def batch_rows(value: int | str) -> int:
    """`batch_size` as rows per sweep of the weights: "auto" (lm-eval's "auto:N" too) or a
    positive integer; anything else is an InputError naming --batch_size."""
    text = str(value).strip()
    if text == "auto" or text.startswith("auto:"):
        return AUTO_BATCH
    if not text.isdigit() or int(text) < 1:
        raise InputError(f"horizon eval: --batch_size {value!r} is not a positive integer or auto")
    return int(text)


@register_model("horizon")
class HorizonLM(TemplateLM):
    def __init__(
        self,
        path: str,
        batch_size: int | str = 64,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        kv_cache: str | None = None,
        chat_template_args: dict | None = None,
        enable_thinking: bool | None = None,
        **_ignored,
    ):
        """path: a store or a run dir. batch_size: rows per sweep of the weights ("auto": 64).
        device, dtype, kv_cache: engine settings (default: the run's, or the store's dtype).
        chat_template_args, enable_thinking: passed to the tokenizer's chat template, as the hf
        model passes them (--apply_chat_template)."""
        super().__init__()
        self.batch = batch_rows(batch_size)  # checked before the engine is built
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            device = None  # lm-eval's command line says cuda by default: keep engine.device (auto: the CPU)
        over = {k: v for k, v in (("device", device), ("dtype", dtype), ("kv_cache", kv_cache)) if v}
        self.source = open_source(path, over)
        self.tokenizer = self.source.tokenizer()
        if self.tokenizer is None:
            raise InputError(f"{path}: the evaluation harness needs a tokenizer, and the model has none")
        self.path = path
        self.chat_template_args = dict(chat_template_args or {})
        if enable_thinking is not None:
            self.chat_template_args["enable_thinking"] = enable_thinking
        self.engine = build(self.source, Console(stderr=True))
        self._max_length = int(max_length or self.source.store.arch.max_positions)
        self.max_gen_toks, self.add_bos_token = int(max_gen_toks), add_bos_token
        self.custom_prefix = prefix_token_id
        self.eos_ids = self.source.eos_ids()

    # -- tokens (as lm-eval's hf model) ---------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix is not None:
            return self.custom_prefix
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    # -- chat templates (--apply_chat_template), as lm-eval's hf model ------------------------
    @property
    def tokenizer_name(self) -> str:
        """Names the template in lm-eval's request cache: the tokenizer's path, as the hf model."""
        return self.tokenizer.name_or_path.replace("/", "__")

    def _need_template(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError(
                f"{self.path}: --apply_chat_template: the model's tokenizer has no chat template"
            )

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template:
            self._need_template()
        try:
            return super().chat_template(chat_template)
        except ValueError as e:  # a template name the tokenizer does not have
            raise InputError(f"{self.path}: --apply_chat_template: {e}") from None

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation as the tokenizer's template renders it (the prompt left open for the
        assistant, or its last message continued); a template that refuses a system message
        gets the conversation without it, as in the hf model."""
        self._need_template()

        def render(history: list[dict[str, str]]) -> str:
            return self.tokenizer.apply_chat_template(
                history,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
                **self.chat_template_args,
            )

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            return render([m for m in chat_history if m["role"] != "system"])

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        kw = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False
        return self.tokenizer.encode(string, **kw)

    def _context_ids(self, string: str, keep: int) -> list[int]:
        """A generation context as the hf model encodes a batch of them, left-truncated."""
        kw = {}
        if has_bos_prefix(string, getattr(self.tokenizer, "bos_token", None)):
            kw = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            kw = {"add_special_tokens": self.add_bos_token}
        return self.tokenizer(string, **kw)["input_ids"][-keep:]

    # -- scoring --------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """(_, context ids, continuation ids) -> (sum of the continuation's log-probs, whether each
        of its tokens is the argmax). Longest first, `batch` rows per sweep."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for a in range(0, len(order), self.batch):
            chunk = order[a : a + self.batch]
            rows, conts = [], []
            for i in chunk:
                _, ctx, cont = requests[i]
                assert ctx and cont and len(cont) <= self.max_length
                ids = (ctx + cont)[-(self.max_length + 1) :]
                rows.append((ids, [IGNORE] * (len(ids) - len(cont)) + cont))
                conts.append(len(cont))
            res = self._score_rows(rows)
            for i, n, (logp, best) in zip(chunk, conts, res, strict=True):
                assert logp.numel() == n
                out[i] = (float(logp.sum()), bool(best.all()))
        return out

    def _score_rows(self, rows: list[tuple[list[int], list[int]]]):
        """One sweep over rows of (ids, labels), cut into micro-batches; per row (logp, best)."""
        Row = tuple[list[int], list[int]]
        mbs: list[list[Row]] = []
        cur: list[Row] = []
        for r in rows:  # sorted longest first: the first row of a micro-batch sets its length
            if cur and len(cur[0][0]) * (len(cur) + 1) > MICRO_TOKENS:
                mbs.append(cur)
                cur = []
            cur.append(r)
        mbs.append(cur)
        scores = self.engine.scores([MicroBatch.from_rows(m, self.tokenizer.pad_token_id or 0) for m in mbs])
        out = []
        for m, (logp, best) in zip(mbs, scores, strict=True):
            off = 0
            for _, labels in m:
                n = sum(t != IGNORE for t in labels[1:])
                out.append((logp[off : off + n], best[off : off + n]))
                off += n
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            for ctx, cont in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1),
            ):
                windows.append((None, ctx, cont))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logp, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[k] += logp
        return totals

    # -- generation ---------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their generation settings; each group in batches of `batch` rows."""
        args = [req.args for req in requests]
        groups: dict[str, list[int]] = {}
        for i, (_, gen) in enumerate(args):
            groups.setdefault(repr(sorted(gen.items())), []).append(i)
        out = [""] * len(args)
        eos_text = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(args[members[0]][1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            new = int(kwargs.pop("max_gen_toks"))
            kwargs.pop("max_length", None)
            unknown = sorted(set(kwargs) - set(SAMPLING))
            if unknown:
                raise InputError(
                    f"generate_until: generation setting {unknown[0]!r} is not supported by horizon"
                )
            sample = kwargs.get("do_sample") and float(kwargs.get("temperature", 1.0)) > 0
            sampler = Sampler(
                float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                float(kwargs.get("top_p", 1.0)) if sample else 1.0,
                int(kwargs.get("top_k", 0) or 0) if sample else 0,
            )
            dec = Decoder(
                self.engine,
                sampler,
                max_new_tokens=new,
                eos_ids=self.eos_ids,
                tokenizer=self.tokenizer,
                stops=until,
                host_kv=self.source.engine.kv_cache == "host",
            )
            keep = self.max_length - new
            if keep <= 0:
                raise InputError(
                    f"generate_until: max_gen_toks {new} leaves no room in {self.max_length} positions"
                )
            prompts = [(i, self._context_ids(args[i][0], keep)) for i in members]
            for a in range(0, len(prompts), self.batch):
                for c in dec.run(prompts[a : a + self.batch]):
                    text = c.text or ""  # decoded, cut before a stop string (its ids too)
                    out[c.index] = postprocess_generated_text(
                        generation=text, stop=until, think_end_token=None
                    )
        return out


# model_args that lm-eval itself adds (its --trust_remote_code; simple_evaluate's own settings)
LM_EVAL_ADDS = ("trust_remote_code", "max_batch_size")


def run_lm_eval(src: str, args: list[str]) -> None:
    """lm-eval's command line with `--model horizon --model_args path=SRC` (more model_args, e.g.
    batch_size or kv_cache, may follow in `args`' own --model_args). The arguments are parsed by
    lm-eval's own parser and checked here first, so a bad one is one line (exit 2), not a
    traceback after the engine is built."""
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    ns = parse_args(HarnessCLI(), args)
    ns.model, ns.model_args = "horizon", {"path": src, **ns.model_args}
    ns.func(ns)  # lm-eval's `run` command on the checked arguments


def parse_args(cli, args: list[str]):
    """lm-eval's `run` arguments, parsed by its own parser (a parse error is one line) and checked:
    the model is horizon, the tasks exist, batch_size is rows per sweep (given once), and every
    model_arg is one HorizonLM takes."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    def refuse(message: str) -> NoReturn:
        raise InputError(f"horizon eval: {message}")

    run = cli._subparsers.choices["run"]  # lm-eval 0.4.x: the `run` subcommand's parser
    cli._parser.error = run.error = refuse  # type: ignore[method-assign]
    ns = cli._parser.parse_args(["run", *args])
    try:
        cfg = EvaluatorConfig.from_cli(ns)  # lm-eval's own checks (and --config's YAML merged)
        given = EvaluatorConfig.load_yaml_config(ns.config) if ns.config else {}
    except (ValueError, TypeError, OSError) as e:
        refuse(str(e))
    if ns.model is not None or "model" in given:
        refuse(f"the model is horizon (drop --model {ns.model or given['model']})")
    margs = dict(cfg.model_args or {})
    known = set(inspect.signature(HorizonLM.__init__).parameters) - {"self", "_ignored", "path"}
    for key in margs:
        if key == "path":
            refuse(f"--model_args path: the model is SRC ({margs[key]!r} given besides it)")
        if key not in known | set(LM_EVAL_ADDS):
            refuse(
                f"--model_args {key}: not a setting of horizon's model (one of {', '.join(sorted(known))})"
            )
    if "batch_size" in margs:  # lm-eval passes --batch_size itself: one of the two, once
        if "batch_size" in vars(ns) and str(ns.batch_size) != str(margs["batch_size"]):
            refuse(f"--model_args batch_size={margs['batch_size']} and --batch_size {ns.batch_size} disagree")
        ns.batch_size = str(margs.pop("batch_size"))
    batch_rows(getattr(ns, "batch_size", cfg.batch_size))
    ns.model_args = margs
    tasks = cfg.tasks if isinstance(cfg.tasks, list) else [t for t in str(cfg.tasks or "").split(",") if t]
    if not tasks:
        refuse("name the tasks to score (--tasks NAME ..., or a task YAML file)")
    check_tasks(tasks, cfg.include_path)
    return ns


def check_tasks(names: list[str], include_path: str | None) -> None:
    """Every task name is one lm-eval knows (in --include_path first, which needs no index of its
    built-in tasks), every task file exists; InputError naming the first that is not."""
    from lm_eval.tasks import TaskManager

    if len(names) == 1 and Path(names[0]).is_dir():
        return  # lm-eval's own form: a directory of task YAML files
    for name in names:
        if name.endswith(".yaml") and not glob.glob(name):
            raise InputError(f"horizon eval: --tasks {name}: no such task file")
    left = [n for n in names if not n.endswith(".yaml")]
    if left and include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        left = [n for n in left if not local.match_tasks([n])]
    if left:
        every = TaskManager(include_path=include_path)
        left = [n for n in left if not every.match_tasks([n])]
    if left:
        where = (
            f" (nor in --include_path {include_path})"
            if include_path
            else " (a local task: --include_path DIR)"
        )
        raise InputError(f"horizon eval: --tasks {left[0]}: no such task in lm-eval{where}")
