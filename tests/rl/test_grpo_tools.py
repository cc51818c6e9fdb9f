"""rl.tools against TRL 1.16's own code, on scripted completions.

A scripted sampler (tests.support.scripted: each row's turns given as ids) drives horizon's
rollouts (recipes.grpo.rollouts.sample with the recipes.grpo.turns hook, the streamed engine's
decode loop) and, as a stand-in for its generation, TRL's `GRPOTrainer._tool_call_loop` on a stub
trainer: the same tool calls, the same tools. Compared: each completion's ids (the tool messages'
ids appended), its tool mask, its messages (assistant and tool turns), the tool-call and failure
counts, for completion limits that leave every turn, truncate the last, and roll back a result
that would overflow. Then the loss and every gradient against TRL's `_compute_loss` with that
tool mask; the KV cache kept across turns against a fresh prefill; a hanging tool.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig, RLConfig
from horizon_cli.data.prompt_only import PromptRow
from horizon_cli.engine import Engine
from horizon_cli.generate.decoder import Decoder
from horizon_cli.model.sample import Sampler
from horizon_cli.recipes.grpo import rollouts as ro
from horizon_cli.recipes.grpo.loss import GRPOObjective
from horizon_cli.recipes.grpo.tools import Toolbox
from horizon_cli.recipes.grpo.turns import start
from tests.support.oracle import check_grads, make_store
from tests.support.scripted import Scripted

trl = pytest.importorskip("trl")
from trl.chat_template_utils import parse_response  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from tests.rl.test_grpo_loss import trl_stub  # noqa: E402
from tests.support.tool_tokenizer import make_tool_tokenizer  # noqa: E402

POSITIONS = 1024
G = 2


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


TOOLS = [add, divide]


def call(name: str, **args) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


# per row (prompt p's generation j at p x G + j), its turns as text (each ends with the EOS)
TURNS = [
    [call("add", a=3, b=4), "The answer is 7."],  # one call, then the answer
    ["It is 84."],  # no call
    [call("multiply", a=1, b=2) + "\n" + call("add", x=1), call("divide", a=1, b=0), call("add", a=12, b=7),
     "19."],  # unknown tool, arguments that do not bind, a tool that raises, then a good one
    ["Let me think about this one for a while before I call a tool. " * 2 + call("add", a=1, b=2), "3."],
]  # fmt: skip
PROMPTS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "user", "content": "What is 12 + 7?"}],
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = make_tool_tokenizer()
    model, store = make_store(
        tmp_path_factory.mktemp("tools"), "llama", vocab_size=len(tok), max_position_embeddings=POSITIONS
    )
    ids = [
        tok.apply_chat_template(p, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
        for p in PROMPTS
    ]
    turns = [
        [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in row] for row in TURNS
    ]
    return types.SimpleNamespace(tok=tok, model=model, store=store, ids=ids, turns=turns)


def box(rounds: int = 1 << 30, timeout: float = 30.0, tools=TOOLS) -> Toolbox:
    return Toolbox(list(tools), None, "", rounds, timeout)


def ours(s, eng: Engine, max_len: int, rounds: int = 1 << 30, host_kv: bool = False):
    rows = [
        PromptRow(ids, p, {}, f"record {k + 1}")
        for k, (ids, p) in enumerate(zip(s.ids, PROMPTS, strict=True))
    ]
    sess = start(box(rounds), s.tok, rows, G, 0, max_len, POSITIONS)
    rl = RLConfig(num_generations=G, max_completion_length=max_len, rewards=[])
    sampler = Scripted({r: [t for turn in s.turns[r] for t in turn] for r in range(len(s.turns))})
    outs = ro.sample(eng, s.ids, G, rl, 0, [s.tok.eos_token_id], s.tok, "host" if host_kv else "device",
                     sampler=sampler, more=sess.more)  # fmt: skip
    from horizon_cli.recipes.grpo.turns import finish

    finish(sess, outs, G, 0)
    return outs


def trls(s, max_len: int, rounds: int | None = None):
    """TRL's _tool_call_loop on the same first turns, its generation the scripted later turns."""
    tok = s.tok
    prompt_ids = [s.ids[r // G] for r in range(len(s.turns))]
    done = {r: 1 for r in range(len(s.turns))}

    def generate(pcts, images, fields, num_generations, has_tool_images=False):
        out = []
        for pct in pcts:  # which row: its prompt and first turn begin the sequence
            r = next(
                r
                for r in done
                if pct[: len(prompt_ids[r]) + len(s.turns[r][0])] == prompt_ids[r] + s.turns[r][0]
            )
            out.append(s.turns[r][done[r]][:max_len])  # the generator's max_new_tokens
            done[r] += 1
        return out, None

    stub = types.SimpleNamespace(
        _sync_tool_dicts=[{f.__name__: f for f in TOOLS} for _ in s.turns],
        _async_tool_dicts=[{} for _ in s.turns],
        max_tool_calling_iterations=rounds if rounds is not None else 1 << 30,
        max_completion_length=max_len, use_vllm=False, _is_vlm=False, processing_class=tok, _tokenizer=tok,
        chat_template=None, chat_template_kwargs={}, tools=TOOLS, environment_factories=None,
        model=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=POSITIONS)),
        _generate_single_turn=generate,
    )  # fmt: skip
    stub._get_tool_suffix_ids = types.MethodType(GRPOTrainer._get_tool_suffix_ids, stub)
    first = [list(t[0][:max_len]) for t in s.turns]
    comps = [[parse_response(tok, ids, prefix=prompt_ids[r], tools=TOOLS)] for r, ids in enumerate(first)]
    prompts = [copy.deepcopy(PROMPTS[r // G]) for r in range(len(s.turns))]
    mask, comps, ids, _, calls, failed, _ = GRPOTrainer._tool_call_loop(
        stub, prompts, prompt_ids, first, comps, None, None, {}
    )
    return mask, comps, ids, calls, failed


def engine(s) -> Engine:
    return Engine(s.store, EngineConfig(device="cpu", dtype="float32"), OptimConfig(kernel="torch"))


# 400: every turn fits; 110: row 3's result would overflow (rolled back), row 2's second turn is
# cut by the limit; 60: row 3's first turn is cut (no call), row 2's first results roll back
@pytest.mark.parametrize("max_len", [400, 110, 60])
@pytest.mark.parametrize("rounds", [None, 1])
def test_turns_equal_trls_tool_call_loop(setup, max_len, rounds):
    s = setup
    mask, comps, ids, calls, failed = trls(s, max_len, rounds)
    eng = engine(s)
    try:
        outs = ours(s, eng, max_len, rounds if rounds is not None else 1 << 30)
    finally:
        eng.close()
    for r, o in enumerate(outs):
        assert o.ids == ids[r], r
        assert o.mask == mask[r], r
        assert o.messages == comps[r], r
        assert o.truncated == (o.ids[-1] != s.tok.eos_token_id)
    assert sum(o.calls for o in outs) == calls and sum(o.failures for o in outs) == failed
    if max_len == 400 and rounds is None:  # the long case takes every path: 3 failures, 4 results
        assert failed == 3 and sum(1 for c in comps for m in c if m["role"] == "tool") == 6
        assert "Tool multiply not found." in str(comps[2]) and "division by zero" in str(comps[2])
    if max_len == 110:  # row 3's call made, its result rolled back: no tool turn, no masked id
        assert outs[3].calls == 1 and all(outs[3].mask) and outs[3].messages[-1]["role"] == "assistant"


def test_kv_cache_across_turns_equals_a_fresh_prefill(setup):
    """After the tool result, the greedy tokens decoded on the row's kept cache are those a fresh
    prefill of prompt + first turn + tool result gives (host and device caches)."""
    s = setup
    eng = engine(s)
    try:
        for host in (False, True):
            rows = [PromptRow(s.ids[0], PROMPTS[0], {}, "record 1")]
            sess = start(box(), s.tok, rows, 1, 0, 64, POSITIONS)
            dec = Decoder(eng, Scripted({0: s.turns[0][0]}, then_greedy=True), max_new_tokens=64, eos_ids=[],
                          host_kv=host, more=sess.more)  # fmt: skip
            # no EOS ends a row here but the scripted one: the sampler's turn ends it, the hook goes on
            dec.eos = {s.tok.eos_token_id}
            got = dec.run([(0, s.ids[0])])[0].ids
            head = sess.rows[0].spans[0][1]  # first turn + tool result
            fresh = Decoder(eng, Sampler(), max_new_tokens=64 - head, host_kv=host).run(
                [(0, s.ids[0] + got[:head])]
            )
            assert got[head:] == fresh[0].ids[: len(got) - head] and len(got) > head
    finally:
        eng.close()


def test_loss_and_gradients_equal_trls_with_the_tool_mask(setup):
    """Tool-result ids carry no loss and no KL: horizon's labels against TRL's tool_mask."""
    s = setup
    eng0 = engine(s)
    try:
        outs = ours(s, eng0, 110)
    finally:
        eng0.close()
    B, C, P = len(outs), max(len(o.ids) for o in outs), max(len(p) for p in s.ids)
    cfg = RLConfig(max_completion_length=110, rewards=[], loss_type="grpo", beta=0.04, num_iterations=1)
    model = copy.deepcopy(s.model).train()
    add_fused_lm_head(model, temperature=cfg.temperature, outputs=("log_probs", "entropy"))
    stub = trl_stub(cfg, model)
    pid = torch.zeros(B, P, dtype=torch.long)
    pmask = torch.zeros(B, P, dtype=torch.long)
    cid, cmask, tmask = (torch.zeros(B, C, dtype=torch.long) for _ in range(3))
    for r, o in enumerate(outs):
        p = s.ids[r // G]
        pid[r, P - len(p) :], pmask[r, P - len(p) :] = torch.tensor(p), 1  # TRL left-pads prompts
        cid[r, : len(o.ids)], cmask[r, : len(o.ids)] = torch.tensor(o.ids), 1
        tmask[r, : len(o.ids)] = torch.tensor(o.mask)
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0])
    with torch.no_grad():
        ids = torch.cat([pid, cid], 1)
        lp, _, _ = stub._get_per_token_logps_and_entropies(model, ids, torch.cat([pmask, cmask], 1), C)
    ref = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    trl_in = {"prompt_ids": pid, "prompt_mask": pmask, "completion_ids": cid, "completion_mask": cmask,
              "tool_mask": tmask, "advantages": adv, "num_items_in_batch": (cmask * tmask).sum(),
              "ref_per_token_logps": ref}  # fmt: skip
    loss = GRPOTrainer._compute_loss(stub, model, trl_in)
    loss.backward()
    kl = stub._metrics["train"]["kl"][-1]
    eng = Engine(s.store, EngineConfig(device="cpu", dtype="float32", loss_chunk=7), OptimConfig(kernel="torch"),
                 objective=GRPOObjective(cfg))  # fmt: skip
    try:
        mbs = ro.micro_batches_of(outs, adv, 3, 0, False)
        for mb, a in zip(mbs, range(0, B, 3), strict=True):  # the reference's log-probs, label order
            mb.payload.ref = torch.cat([ref[r, : len(o.ids)][torch.tensor(o.mask, dtype=torch.bool)]
                                        for r, o in enumerate(outs[a : a + 3], start=a)])  # fmt: skip
        loss_sum, n, _ = eng.forward_backward(mbs, eng.objective.divisor(mbs))
        _, _, stats = eng.evaluate(mbs)
        assert abs(loss_sum / n - loss.item()) <= 1e-5 * max(abs(loss.item()), 1e-2)
        assert stats["kl"] / stats["tokens"] == pytest.approx(kl, rel=1e-5)
        assert stats["tokens"] == int((cmask * tmask).sum())
        check_grads(eng, model, 1e-5)
    finally:
        eng.close()


def test_a_hanging_tool_fails_the_call_after_its_timeout(setup):
    import threading

    never = threading.Event()

    def add(a: int, b: int) -> int:  # noqa: ARG001
        """Hang.

        Args:
            a: a
            b: b
        """
        never.wait()
        return 0

    s = setup
    rows = [PromptRow(s.ids[0], PROMPTS[0], {}, "record 1")]
    sess = start(box(timeout=0.05, tools=[add]), s.tok, rows, 1, 0, 400, POSITIONS)
    c = types.SimpleNamespace(index=0, ids=list(s.turns[0][0]))
    suffix = sess.more(c)
    never.set()
    assert suffix and sess.rows[0].failures == 1 and sess.rows[0].calls == 1
    assert sess.rows[0].messages[-1] == {
        "role": "tool",
        "name": "add",
        "content": "{'error': 'timed out after 0.05 s'}",
    }
    assert sess.failed is not None and "add" in sess.failed and "completion 1 of record 1" in sess.failed


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_bad_returns_environments_and_tokenizers_stop_in_one_line(setup):
    from horizon_cli.errors import InputError
    from horizon_cli.recipes.grpo.tools import check_tokenizer

    s = setup

    def add(a: int, b: int) -> object:
        """Add.

        Args:
            a: a
            b: b
        """
        return Unprintable()

    rows = [PromptRow(s.ids[0], PROMPTS[0], {}, "record 1")]
    sess = start(box(tools=[add]), s.tok, rows, 1, 0, 400, POSITIONS)
    with pytest.raises(
        InputError, match=r"rl.tools \(add\): returned a Unprintable .* on completion 1 of record 1"
    ):
        sess.more(types.SimpleNamespace(index=0, ids=list(s.turns[0][0])))

    class Seen:  # record 2's reset returns an observation
        def reset(self, **record):
            return "you see a door" if record["prompt"] is PROMPTS[1] else None

    class Broken:  # the third instance's constructor raises: completion 1 of record 2 (G = 2)
        made = 0

        def __init__(self):
            Broken.made += 1
            if Broken.made == 3:
                raise OSError("disk")

        def reset(self, **record):
            return None

    rows = [PromptRow(s.ids[0], PROMPTS[0], {}, "record 1"), PromptRow(s.ids[1], PROMPTS[1], {}, "record 2")]
    with pytest.raises(
        InputError, match=r"\(Seen\): reset returned an observation \(completion 1 of record 2\)"
    ):
        start(Toolbox([], Seen, "Seen", 8, 1.0), s.tok, rows, 2, 0, 400, POSITIONS)
    with pytest.raises(
        InputError, match=r"\(Broken\): its constructor raised OSError: disk \(completion 1 of record 2\)"
    ):
        start(Toolbox([], Broken, "Broken", 8, 1.0), s.tok, rows, 2, 0, 400, POSITIONS)

    plain = copy.deepcopy(s.tok)
    plain.response_template = None
    with pytest.raises(InputError, match="rl.tools: the tokenizer has no response template"):
        check_tokenizer(plain)
    check_tokenizer(s.tok)
