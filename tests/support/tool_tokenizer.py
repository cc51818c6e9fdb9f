"""A tiny byte-level BPE tokenizer that calls tools, for offline tests of rl.tools.

Its chat template is TRL 1.16's Qwen2.5 template (trl/chat_templates/qwen2_5.jinja: tools rendered
into the system turn, <tool_call>{json}</tool_call> calls, <tool_response> results in a user turn),
<|im_end|> its EOS, and its response template the one TRL's add_response_schema sets for it (so
transformers' parse_response reads its tool calls).
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tests.support.tokenizer import train_bpe

VOCAB_SIZE = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
            "</tool_response>", "<think>", "</think>"]  # fmt: skip
CORPUS = [
    '{"name": "add", "arguments": {"a": 3, "b": 4}}',
    '{"name": "multiply", "arguments": {"a": 12, "b": 7}}',
    "What is 12 times 7? The answer is 84.",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "# Tools\n\nYou may call one or more functions to assist with the user query.",
    "function description parameters type object properties integer number string required",
    "user assistant system tool dummy error not found",
    "0123456789 + - * / = ( ) , .",
]


def template() -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def make_tool_tokenizer(tmp_path: str | Path | None = None):
    """The tokenizer (saved to tmp_path and reloaded when given: a model's tokenizer files)."""
    from trl.chat_template_utils import add_response_schema

    tok = train_bpe(CORPUS, SPECIALS, VOCAB_SIZE)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[3:],
        chat_template=template(),
    )
    add_response_schema(fast)
    if tmp_path is None:
        return fast
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)
