"""Sampling's min_p and repetition_penalty (TRL's GRPOConfig and transformers' generate take both):
the scores a token is drawn from equal transformers' logits processors in generate's order
(repetition penalty on the raw logits over the ids so far, then temperature, top-k, top-p, min-p),
and the `rl:` section takes them."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from horizon_cli.model.sample import Sampler


@pytest.mark.parametrize("temperature, top_k, top_p, min_p, penalty",
                         [(1.0, 0, 1.0, 0.1, 1.0), (0.7, 20, 0.9, 0.05, 1.3), (1.2, 0, 1.0, 0.0, 0.8), (1.0, 0, 0.95, 0.2, 1.1)])  # fmt: skip
def test_warp_equals_transformers_processors(temperature, top_k, top_p, min_p, penalty):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    ids = torch.randint(0, 50, (3, 7), generator=g)
    procs = [RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1.0 else []
    procs.append(TemperatureLogitsWarper(temperature))
    procs += [TopKLogitsWarper(top_k)] if top_k else []
    procs += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    procs += [MinPLogitsWarper(min_p)] if min_p else []
    want = LogitsProcessorList(procs)(ids, logits.clone())
    s = Sampler(temperature, top_p, top_k, min_p=min_p, repetition_penalty=penalty)
    for r in range(3):
        s.begin(r, ids[r].tolist())
    got = s.warp(logits.clone(), [0, 1, 2])
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)], atol=1e-6)


def test_the_rl_section_takes_min_p_and_repetition_penalty(tmp_path, tiny_store):
    from horizon_cli.config import load_config
    from tests.conftest import horizon, write_config, write_jsonl

    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt_input_ids": [5, 6, 7]}] * 4)
    rl = {"num_generations": 2, "max_completion_length": 4, "min_p": 0.1, "repetition_penalty": 1.2,
          "rewards": [{"function": "length", "target": 4}]}  # fmt: skip
    cfg = write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "run", rl=rl,
                       train={"steps": 1, "batch_size": 2, "micro_batch_size": 2})  # fmt: skip
    got = load_config(cfg).rl
    assert (got.min_p, got.repetition_penalty) == (0.1, 1.2)
    assert horizon("train", cfg).exit_code == 0
    bad = write_config(tmp_path / "b.yaml", tiny_store, data, tmp_path / "run2", rl={**rl, "min_p": 1.5})
    r = horizon("train", bad)
    assert r.exit_code == 2 and "rl.min_p: 1.5 is above the maximum 1.0" in r.output


THINK = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}four five\n{% endif %}{% endif %}"
)


def test_a_chat_template_and_its_kwargs_from_the_config(tmp_path, tok):
    """data.chat_template (a Jinja string, or a .jinja file as TRL's chat_template_path) replaces
    the tokenizer's; data.chat_template_kwargs go to every rendering (TRL's chat_template_kwargs,
    e.g. enable_thinking); the cache key follows both."""
    import copy
    import json

    from horizon_cli.config.schema import DataConfig
    from horizon_cli.data.cache import tokenizer_fingerprint
    from horizon_cli.data.prepare import prepare_data
    from horizon_cli.data.prompt_only import prepare_prompts
    from horizon_cli.data.templates import configure

    (tmp_path / "t.jinja").write_text(THINK)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "one two"}]}) + "\n")
    for given in (THINK, str(tmp_path / "t.jinja")):
        cfg = DataConfig(path=str(tmp_path / "p.jsonl"), chat_template=given,
                         chat_template_kwargs={"enable_thinking": False})  # fmt: skip
        t = configure(copy.deepcopy(tok), cfg)
        (train, _) = prepare_prompts(cfg, t, 400, 128, 8, 0)
        want = tok(tok.apply_chat_template([{"role": "user", "content": "one two"}], chat_template=THINK,
                                           add_generation_prompt=True, tokenize=False, enable_thinking=False),
                   add_special_tokens=False)["input_ids"]  # fmt: skip
        assert train.rows[0].ids == want and "four five" in t.decode(want)
    plain = configure(copy.deepcopy(tok), DataConfig(chat_template=THINK))
    assert tokenizer_fingerprint(plain) != tokenizer_fingerprint(tok)  # the template
    # the kwargs: a cache entry of their own (data.prepare's key), the same tokenizer object
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": f"a{i}"}]}) + "\n"
                            for i in range(4)))  # fmt: skip
    for kw in (None, {"enable_thinking": False}, {"enable_thinking": False}):
        cfg = DataConfig(path=str(rows), chat_template=THINK, chat_template_kwargs=kw, max_seq_len=64)
        prepare_data(
            cfg, configure(copy.deepcopy(tok), cfg), cache_dir=tmp_path / "cache", log=lambda s: None
        )
    assert len(list((tmp_path / "cache").iterdir())) == 2
