"""A reward model as a reward (`rl.rewards[i].model`): `horizon convert` of an
XForSequenceClassification checkpoint (native Llama, generic GPT-2), its scores against TRL 1.16's
reward-model path (trl.data_utils.apply_chat_template over prompt + completion messages, the
reward tokenizer right-padded without special tokens, AutoModelForSequenceClassification with
num_labels=1 and the tokenizer's pad id, logits[:, 0]), a GRPO run whose written rewards are that
model's, and the one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from horizon_cli.config.schema import DataConfig, EngineConfig
from horizon_cli.engine.ranks import OneProcess
from horizon_cli.errors import InputError
from horizon_cli.recipes.grpo.reward_model import RewardModel, batch_scores
from tests.conftest import horizon, write_config, write_jsonl
from tests.support.tokenizer import make_tokenizer

trl = pytest.importorskip("trl")
from trl.data_utils import apply_chat_template  # noqa: E402

SIZES = dict(num_hidden_layers=2, max_position_embeddings=128, num_labels=1)


def _classifier(kind: str, positions: int = 128):
    torch.manual_seed(3)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64,
                                       num_attention_heads=4, num_key_value_heads=2, **SIZES)  # fmt: skip
        return transformers.LlamaForSequenceClassification(cfg)
    cfg = transformers.GPT2Config(
        vocab_size=400, n_embd=32, n_layer=2, n_head=4, n_positions=positions, num_labels=1
    )
    return transformers.GPT2ForSequenceClassification(cfg)


def reward_checkpoint(
    root: Path, kind: str = "llama", pad: bool = True, labels: int = 1, positions: int = 128
) -> Path:
    """A tiny random classifier saved with the tiny tokenizer (pad=False: a tokenizer without a pad
    token, whose EOS then pads, as TRL sets it) under root/hf."""
    m = _classifier(kind, positions)
    if labels != 1:
        m.score = torch.nn.Linear(32, labels, bias=False)
        m.config.num_labels = labels
    with torch.no_grad():  # a score that varies: the random init of a 1-row head is small
        m.score.weight.normal_(0, 1.0)
    m.save_pretrained(root / "hf")
    make_tokenizer(root / "hf")
    if not pad:
        cfg = json.loads((root / "hf" / "tokenizer_config.json").read_text())
        cfg.pop("pad_token", None)
        (root / "hf" / "tokenizer_config.json").write_text(json.dumps(cfg))
        (root / "hf" / "special_tokens_map.json").unlink(missing_ok=True)
        assert transformers.AutoTokenizer.from_pretrained(root / "hf").pad_token is None
    return root / "hf"


def trl_scores(src: Path, prompts: list, completions: list) -> torch.Tensor:
    """GRPOTrainer's reward-model branch (_calculate_rewards), step by step."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        src, num_labels=1, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(src)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.get_text_config().pad_token_id = tok.pad_token_id
    if isinstance(prompts[0], list):
        texts = [
            apply_chat_template({"messages": p + c}, tok)["text"]
            for p, c in zip(prompts, completions, strict=True)
        ]
    else:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    inputs = tok(
        text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
    )
    with torch.inference_mode():
        return model(**inputs).logits[:, 0].float()


CONV_P = [[{"role": "user", "content": "What is the capital of France?"}],
          [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one two three"}],
          [{"role": "user", "content": "Hello world!"}]]  # fmt: skip
CONV_C = [[{"role": "assistant", "content": "Paris is."}], [{"role": "assistant", "content": "four five six seven"}],
          [{"role": "assistant", "content": ""}]]  # fmt: skip
TEXT_P = ["The quick brown fox", "Write a short poem about", "hi"]
TEXT_C = [
    " jumps over the lazy dog.</s>",
    " the sea and the sky</s></s>",
    " thanks",
]  # EOS at the end: pad if no pad


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("pad", [True, False])
def test_scores_equal_trls_reward_model_path(tmp_path, kind, pad):
    src = reward_checkpoint(tmp_path, kind, pad)
    out = horizon("convert", src, tmp_path / "store", "--dtype", "float32")
    assert out.exit_code == 0, out.output
    said = " ".join(out.output.split())
    assert "a reward model (" in said and "it scores as rl.rewards[i].model" in said
    rm = RewardModel(str(tmp_path / "store"), "rl.rewards[0]", DataConfig())
    rm.open(EngineConfig(device="cpu", dtype="float32"), None)
    try:
        for prompts, comps in ((CONV_P, CONV_C), (TEXT_P, TEXT_C)):
            got = batch_scores(rm, OneProcess(), prompts, comps, None, 2)  # 2 micro-batches
            want = trl_scores(src, prompts, comps)
            assert want.std() > 1e-3  # the rows score apart
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        rm.close()


def test_convert_refuses_more_than_one_label_and_the_store_is_no_policy(tmp_path):
    src = reward_checkpoint(tmp_path / "two", labels=2)
    out = horizon("convert", src, tmp_path / "two" / "store")
    assert out.exit_code == 2 and "score.weight has 2 labels" in out.output
    assert not (tmp_path / "two" / "store").exists()
    src = reward_checkpoint(tmp_path / "one")
    assert horizon("convert", src, tmp_path / "store").exit_code == 0
    out = horizon("generate", tmp_path / "store", "--prompt", "hi")
    assert out.exit_code == 2 and "a reward model (LlamaForSequenceClassification): it scores" in " ".join(
        out.output.split()
    )
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello world"}] * 4)
    for model in (tmp_path / "store", src):  # the store, and the checkpoint itself as model.path
        cfg = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
        out = horizon("train", cfg, "--dry-run")
        assert (
            out.exit_code == 2
            and "a reward model (LlamaForSequenceClassification): it scores" in " ".join(out.output.split())
            and "model.path" in out.output
        )


def test_inspect_of_a_reward_store_says_what_it_is(tmp_path):
    """Its parameters as transformers counts them (the score head too), no tied embedding where the
    classifier has none, and no host-memory-to-train table for a store train refuses."""
    src = reward_checkpoint(tmp_path)
    assert horizon("convert", src, tmp_path / "store", "--dtype", "float32").exit_code == 0
    out = horizon("inspect", tmp_path / "store")
    said = " ".join(out.output.split())
    n = sum(
        p.numel() for p in transformers.AutoModelForSequenceClassification.from_pretrained(src).parameters()
    )
    assert out.exit_code == 0 and f"parameters │ {n:,} (the score head's included)" in said, said
    assert "tied embeddings" not in said and "host memory to train" not in said
    assert "a reward model is not trained" in said


def test_an_exported_reward_store_is_its_checkpoint(tmp_path):
    """Exported, a reward store is the classifier it came from: its config as written (Llama's
    untied embedding stays untied: the store ties it only to stream the decoder as a causal LM)
    and the same scores under AutoModelForSequenceClassification."""
    src = reward_checkpoint(tmp_path)
    assert horizon("convert", src, tmp_path / "store", "--dtype", "float32").exit_code == 0
    out = horizon("export", tmp_path / "store", tmp_path / "out")
    assert out.exit_code == 0, out.output
    want, got = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "out"))
    assert want["tie_word_embeddings"] is False and got == want
    ids = torch.tensor([[5, 6, 7, 8, 9, 4, 3]])  # one row: the config names no pad id
    with torch.inference_mode():
        a, b = (
            transformers.AutoModelForSequenceClassification.from_pretrained(d)(ids).logits
            for d in (src, tmp_path / "out")
        )
    assert torch.equal(a, b)


def test_a_causal_lm_store_or_a_checkpoint_is_no_reward_model(tmp_path, tiny_store):
    with pytest.raises(InputError, match="causal LM's store, not a reward model's"):
        RewardModel(str(tiny_store), "rl.rewards[1]", DataConfig())
    with pytest.raises(InputError, match="convert it first"):
        RewardModel(str(tiny_store.parent / "hf"), "rl.rewards[1]", DataConfig())
    with pytest.raises(InputError, match=r"rl.rewards\[1\].model: .*not found"):
        RewardModel(str(tmp_path / "nowhere"), "rl.rewards[1]", DataConfig())
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}] * 2)
    for model, said in ((tiny_store.parent / "hf", "convert it first"), (tiny_store, "not a reward model's")):
        rl = {"num_generations": 2, "rewards": [{"model": str(model)}]}
        out = horizon(
            "train", write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "o", rl=rl), "--dry-run"
        )
        errors = [ln for ln in out.output.splitlines() if ln.startswith("error:")]
        assert out.exit_code == 2 and len(errors) == 1 and "rl.rewards[0].model" in errors[0], out.output
        assert said in " ".join(out.output.split()), out.output  # the plan's line, not a generic one


def test_grpo_trains_on_a_reward_models_scores(tmp_path, tiny_store):
    from rich.console import Console

    from horizon_cli.train import run_training

    src = reward_checkpoint(tmp_path / "rm")
    assert horizon("convert", src, tmp_path / "rm" / "store", "--dtype", "float32").exit_code == 0
    rows = [
        {"prompt": [{"role": "user", "content": p}]} for p in ("Hello world!", "one two three", "Paris is")
    ]
    data = write_jsonl(tmp_path / "p.jsonl", rows * 2)
    rl = {"num_generations": 3, "max_completion_length": 6,
          "rewards": [{"model": str(tmp_path / "rm" / "store")}, {"function": "length", "target": 4, "weight": 0.5}]}  # fmt: skip
    cfg = write_config(tmp_path / "g.yaml", tiny_store, data, tmp_path / "run", rl=rl,
                       train={"steps": 2, "batch_size": 2, "micro_batch_size": 2, "seed": 5},
                       output={"save_every": 0, "export": False})  # fmt: skip
    run_training(cfg, [], console=Console(quiet=True))
    lines = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "step-1.jsonl").read_text().splitlines()]
    assert len(lines) == 6
    tok = transformers.AutoTokenizer.from_pretrained(tiny_store / "hf")
    prompts = [r["prompt"] for r in lines]
    comps = [
        [{"role": "assistant", "content": tok.decode(r["completion_ids"], skip_special_tokens=True)}]
        for r in lines
    ]
    want = trl_scores(src, prompts, comps)
    got = torch.tensor([r["rewards"]["hf"] for r in lines])  # named after the checkpoint's folder, as TRL
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if "rewards/hf/mean" in r)
    assert abs(first["rewards/hf/mean"] - float(want.mean())) < 1e-5 and first["reward_model_s"] > 0


@pytest.mark.parametrize("train_conv", [True, False])
def test_an_eval_set_of_the_other_kind_is_scored_as_its_own(tmp_path, tiny_store, train_conv):
    """Conversational training prompts with a text eval set, and the reverse: each batch scored as
    its own prompts are (TRL tells per batch); the eval set was scored as the training set's kind
    (messages turned into a string, or a traceback in the reward template)."""
    from rich.console import Console

    from horizon_cli.train import run_training

    src = reward_checkpoint(tmp_path / "rm")
    assert horizon("convert", src, tmp_path / "rm" / "store", "--dtype", "float32").exit_code == 0
    words = ("Hello world!", "one two three")
    conv = write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": w}]} for w in words])
    text = write_jsonl(tmp_path / "t.jsonl", [{"prompt": w} for w in words])
    (tmp_path / "kinds.py").write_text(
        "def kinds(prompts, completions, **kw):\n"
        "    return [float(isinstance(c, list)) + 10 * float(isinstance(p, list)) for p, c in zip(prompts, completions)]\n"
    )
    rl = {"num_generations": 2, "max_completion_length": 5,
          "rewards": [{"model": str(tmp_path / "rm" / "store")}, {"function": f"{tmp_path / 'kinds.py'}:kinds"}]}  # fmt: skip
    train_set, eval_set = (conv, text) if train_conv else (text, conv)
    cfg = write_config(tmp_path / "g.yaml", tiny_store, train_set, tmp_path / "run", rl=rl,
                       data={"path": str(train_set), "eval_path": str(eval_set), "max_seq_len": 64},
                       train={"steps": 1, "batch_size": 2, "micro_batch_size": 2, "seed": 5,
                              "eval_every": 1, "eval_batches": 1},
                       output={"save_every": 0, "export": False})  # fmt: skip
    run_training(cfg, [], console=Console(quiet=True))
    tok = transformers.AutoTokenizer.from_pretrained(tiny_store / "hf")
    for name, conversational in (("step-1", train_conv), ("eval-step-1", not train_conv)):
        lines = [
            json.loads(x) for x in (tmp_path / "run" / "rollouts" / f"{name}.jsonl").read_text().splitlines()
        ]
        assert len(lines) == 4
        texts = [tok.decode(r["completion_ids"], skip_special_tokens=True) for r in lines]
        comps = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        prompts = [r["prompt"] for r in lines]
        assert all(isinstance(p, list) == conversational for p in prompts)
        assert [r["rewards"]["kinds"] for r in lines] == [11.0 * conversational] * 4, name
        got = torch.tensor([r["rewards"]["hf"] for r in lines])
        torch.testing.assert_close(got, trl_scores(src, prompts, comps), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_two_ranks_score_what_one_scores(tmp_path, tiny_store):
    """Under torchrun the reward model is sharded like the reference and each rank scores an even
    share of the batch's micro-batches (prompts given as ids: read as text with the policy's
    tokenizer); the rewards, metrics, rollouts and weights equal one process's."""
    from tests.parallel.test_dist import torchrun
    from tests.preference.test_pref_train import quiet
    from tests.rl.test_grpo_dist import _configs, _same_runs

    src = reward_checkpoint(tmp_path / "rm")
    assert horizon("convert", src, tmp_path / "rm" / "store", "--dtype", "float32").exit_code == 0
    rl = {
        "rewards": [
            {"model": str(tmp_path / "rm" / "store"), "name": "rm"},
            {"function": "length", "target": 3},
        ]
    }
    cfgs = _configs(tmp_path, tiny_store, rl, 0.2)
    quiet(cfgs["one"])
    r = torchrun(2, cfgs["two"])
    assert r.returncode == 0, r.stderr
    _same_runs(tmp_path, 3)
    for n in ("one", "two"):
        rows = [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
        assert len({r["rewards/rm/mean"] for r in rows if "rewards/rm/mean" in r}) == 3
    a, b = ((tmp_path / n / "metrics.jsonl").read_text().splitlines() for n in ("one", "two"))
    ra, rb = (json.loads(x[0])["rewards/rm/mean"] for x in (a, b))
    assert ra == pytest.approx(rb, rel=1e-6)


def test_the_plan_holds_the_reference_and_the_reward_models_copies_and_buffers(tmp_path, tiny_store):
    """A forward-only engine holds its model's streaming copy on the host (state.frozen) and its
    weight buffers on the device for the whole run: the reference (beta > 0) and each reward model
    are in the plan (they were not), the device side equal to the engine's own accounting (over an
    emulated link, as on a GPU; a bf16 reward store computing in fp32: narrow, upcast there)."""
    from horizon_cli.config import load_config
    from horizon_cli.config.schema import OptimConfig
    from horizon_cli.engine import Engine
    from horizon_cli.planning.ladder import plan_for
    from horizon_cli.store import Store

    src = reward_checkpoint(tmp_path / "rm")
    assert horizon("convert", src, tmp_path / "rm" / "store", "--dtype", "bfloat16").exit_code == 0
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}] * 2)
    rm = {"model": str(tmp_path / "rm" / "store")}
    policy, scorer = Store.open(tiny_store), Store.open(tmp_path / "rm" / "store")
    engine = {"device": "cpu", "dtype": "float32", "prefetch": 2, "link_gbps": 1e6}

    def buffers(store: Store) -> int:
        eng = Engine(store, EngineConfig(**engine), OptimConfig(), forward_only=True)
        try:
            return sum(eng.p.t.memory.current.values())
        finally:
            eng.close()

    for beta in (0.0, 0.04):
        cfg = load_config(write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "o", engine=engine,
                                       rl={"beta": beta, "rewards": [{"function": "length", "target": 3}, rm]}))  # fmt: skip
        plan = plan_for(cfg, policy, "exact")
        assert (
            plan.host["reward model 1 (streaming copy)"] == sum(u.numel for u in scorer.manifest.units) * 2
        )  # bf16
        assert plan.device["reward model 1 (weight buffers)"] == buffers(scorer) > 0
        assert plan.host.get("reference (streaming copy)", 0) == sum(
            u.numel for u in policy.manifest.units
        ) * 4 * (beta > 0)
        assert plan.device.get("reference (weight buffers)", 0) == buffers(policy) * (beta > 0)
        lora = plan_for(cfg, policy, "lora")  # LoRA's reference: its base, adapters off
        assert (
            "reference (streaming copy)" not in lora.host and "reference (weight buffers)" not in lora.device
        )


def test_what_a_reward_model_cannot_score_is_refused_at_the_start():
    from types import SimpleNamespace as NS

    from horizon_cli.recipes.grpo.reward_model import check_models

    chat, plain = NS(chat_template="{{ messages }}"), NS(chat_template=None)
    rewards = [NS(model=None, key="rl.rewards[0]"), NS(model=NS(tokenizer=chat), key="rl.rewards[1]")]
    text = NS(rows=[NS(media=None)], conversational=False)
    check_models(rewards, text)  # text prompts: fine
    check_models(rewards[:1], NS(rows=[NS(media={"pixel_values": 1})], conversational=True))  # no model
    with pytest.raises(InputError, match=r"rl.rewards\[1\].model: prompts with images"):
        check_models(rewards, NS(rows=[NS(media=None), NS(media={"pixel_values": 1})], conversational=True))
    check_models(rewards, NS(rows=[NS(media=None)], conversational=True))  # a template: fine
    rewards[1].model.tokenizer = plain
    check_models(rewards, text)  # text needs none
    with pytest.raises(
        InputError, match=r"rl.rewards\[1\].model: the prompts are conversations and the reward"
    ):
        check_models(rewards, NS(rows=[NS(media=None)], conversational=True))


def test_a_text_beyond_the_reward_models_positions_is_one_line(tmp_path):
    """GPT-2's learned positions end at n_positions (128 here): an IndexError in the forward before."""
    src = reward_checkpoint(tmp_path, "gpt2")
    assert horizon("convert", src, tmp_path / "store", "--dtype", "float32").exit_code == 0
    rm = RewardModel(str(tmp_path / "store"), "rl.rewards[0]", DataConfig())
    with pytest.raises(InputError, match=r"rl.rewards\[0\].model: completion 2 of the batch is .* tokens as the "
                                         r"reward model reads it, beyond its 128 positions"):  # fmt: skip
        rm.rows(["hi", "one two three " * 60], [" four", " five"], str)


def test_ids_beyond_the_reward_models_vocabulary_are_one_line(tmp_path):
    """A reward store whose tokenizer has more ids than its model's embedding (another model's
    tokenizer): an IndexError in the embedding before."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, **SIZES)  # fmt: skip
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "hf")
    make_tokenizer(tmp_path / "hf")  # 400 ids
    assert horizon("convert", tmp_path / "hf", tmp_path / "store", "--dtype", "float32").exit_code == 0
    rm = RewardModel(str(tmp_path / "store"), "rl.rewards[0]", DataConfig())
    text = " ".join(TEXT_P + TEXT_C)
    assert max(rm.tokenizer(text)["input_ids"]) >= 200
    with pytest.raises(InputError, match=r"rl.rewards\[0\].model: completion 1 of the batch has token id .* "
                                         r"beyond the model's vocabulary of 200"):  # fmt: skip
        rm.rows([text], [" four"], str)


def test_a_completion_beyond_the_reward_models_positions_stops_the_run_naming_it(tmp_path, tiny_store):
    src = reward_checkpoint(tmp_path / "rm", "gpt2", positions=24)
    assert horizon("convert", src, tmp_path / "rm" / "store", "--dtype", "float32").exit_code == 0
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in ("hi", "zq xv kw " * 4)]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    rl = {
        "num_generations": 2,
        "max_completion_length": 4,
        "rewards": [{"model": str(tmp_path / "rm" / "store")}],
    }
    cfg = write_config(tmp_path / "g.yaml", tiny_store, data, tmp_path / "run", rl=rl,
                       train={"steps": 1, "batch_size": 2, "micro_batch_size": 2, "seed": 1})  # fmt: skip
    r = horizon("train", cfg)
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "rl.rewards[0].model: completion 1 of " in lines[0] and "p.jsonl: record 2 is " in lines[0], lines[
        0
    ]
    assert "beyond its 24 positions" in lines[0]


def test_a_damaged_reward_store_and_a_template_less_one_are_one_line_before_any_run(tmp_path, tiny_store):
    src = reward_checkpoint(tmp_path / "rm")
    store = tmp_path / "rm" / "store"
    assert horizon("convert", src, store, "--dtype", "float32").exit_code == 0
    out = horizon("inspect", store)
    assert (
        out.exit_code == 0
        and "reward model" in out.output
        and "rl.rewards[i].model" in "".join(out.output.split())
    )
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}] * 2)
    rl = {"num_generations": 2, "max_completion_length": 4, "rewards": [{"model": str(store)}]}
    cfg = write_config(tmp_path / "g.yaml", tiny_store, data, tmp_path / "run", rl=rl,
                       train={"steps": 1, "batch_size": 2, "micro_batch_size": 2})  # fmt: skip
    tc = json.loads((store / "hf" / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (store / "hf" / "tokenizer_config.json").write_text(json.dumps(tc))
    (store / "hf" / "chat_template.jinja").unlink(missing_ok=True)
    for args in (["--dry-run"], []):
        r = horizon("train", cfg, *args)
        lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert r.exit_code == 2 and len(lines) == 1, r.output
        assert (
            "the prompts are conversations and the reward model's tokenizer has no chat template" in lines[0]
        )
        assert not (tmp_path / "run").exists()
    (store / "hf" / "carried.safetensors").unlink()
    r = horizon("train", cfg, "--dry-run")
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert (
        "rl.rewards[0].model: " in lines[0]
        and "carried.safetensors: missing (the reward model's score head" in lines[0]
    )


def test_a_prompt_given_as_ids_scores_as_its_text(tmp_path):
    """The ids are read back without special tokens (as completions are): the policy's BOS is not
    text the reward model sees."""
    src = reward_checkpoint(tmp_path)
    assert horizon("convert", src, tmp_path / "store", "--dtype", "float32").exit_code == 0
    rm = RewardModel(str(tmp_path / "store"), "rl.rewards[0]", DataConfig())
    rm.open(EngineConfig(device="cpu", dtype="float32"), None)
    try:
        tok = make_tokenizer()
        ids = [tok(p)["input_ids"] for p in TEXT_P]
        assert all(i[0] == tok.bos_token_id for i in ids)
        by_ids = batch_scores(rm, OneProcess(), ids, TEXT_C, tok, 2)
        torch.testing.assert_close(by_ids, batch_scores(rm, OneProcess(), TEXT_P, TEXT_C, None, 2))
    finally:
        rm.close()
