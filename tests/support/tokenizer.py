"""A tiny byte-level BPE tokenizer for offline tests (data pipeline and engine).

Byte-level, so any text encodes and decodes back exactly. Special tokens: <pad> <s> </s> plus the
chat role markers; the tokenizer adds <s> (BOS) but not </s> (EOS), like Llama's. The chat
template is ChatML-shaped with </s> as the end-of-turn marker and a newline after it:

    <s><|user|>\\nhi</s>\\n<|assistant|>\\nhello</s>\\n
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

VOCAB_SIZE = 400  # len(tokenizer): a tiny model for these tokens needs vocab_size >= this
SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today?",
    "Write a short poem about the sea and the sky.",
    "Below is an instruction that describes a task. Write a response.",
    "### Instruction:\n### Input:\n### Response:\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "one two three four five six seven eight nine ten",
    "user assistant system hello hi thanks answer question",
]


def train_bpe(corpus: list[str], specials: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on corpus (deterministic: same corpus, same merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    return tok


def _backend() -> Tokenizer:
    """The tiny tokenizer's BPE on CORPUS, with its <s> post-processor."""
    tok = train_bpe(CORPUS, SPECIALS, VOCAB_SIZE)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def make_tokenizer(tmp_path: str | Path | None = None, chat_template: bool | str = True):
    """The tiny tokenizer; `chat_template`: True (the ChatML-shaped default), False (none) or a template.

    With `tmp_path`, it is saved there with `save_pretrained` and the reloaded copy is returned
    (so the directory can serve as a model's tokenizer files).
    """
    template = CHAT_TEMPLATE if chat_template is True else (chat_template or None)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_backend(),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS[3:],
        chat_template=template,
    )
    if tmp_path is None:
        return tok
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)
