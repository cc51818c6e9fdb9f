"""One numbering of records in every message: from 1, in file order (the line of a JSONL file), in
SFT, preference, KTO and GRPO data and in reward errors alike (issue 43: GRPO counted from 0)."""

from __future__ import annotations

from tests.conftest import horizon, write_config, write_jsonl


def _error(r) -> str:
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    return lines[0]


def test_a_grpo_prompt_and_a_reward_error_name_the_record_from_1(tmp_path, tiny_store):
    rows = [{"prompt_input_ids": [5, 6, 7]}, {"prompt_input_ids": [5, 6, 7]}, {"prompt_input_ids": []}]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    rl = {"num_generations": 2, "max_completion_length": 4, "rewards": [{"function": "length", "target": 4}]}
    msg = _error(horizon("train", write_config(tmp_path / "a.yaml", tiny_store, data, tmp_path / "a", rl=rl)))
    assert "p.jsonl: record 3: the prompt is empty" in msg  # the third line
    (tmp_path / "rw.py").write_text(
        "def f(completions, bias, **kw):\n"
        "    if 1 in bias:\n"
        "        raise ValueError('boom')\n"
        "    return [0.0] * len(completions)\n"
    )
    rows = [{"prompt_input_ids": [5, 6, 7], "bias": int(i == 1)} for i in range(2)]
    data = write_jsonl(tmp_path / "q.jsonl", rows)
    rl = {**rl, "rewards": [{"function": f"{tmp_path / 'rw.py'}:f"}]}
    cfg = write_config(tmp_path / "b.yaml", tiny_store, data, tmp_path / "b", rl=rl,
                       data={"shuffle": False}, train={"steps": 1, "batch_size": 2, "micro_batch_size": 2})  # fmt: skip
    msg = _error(horizon("train", cfg))
    assert "raised ValueError: boom on completion 1 of" in msg and "q.jsonl: record 2" in msg, msg
