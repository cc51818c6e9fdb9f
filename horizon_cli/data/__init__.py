"""The data pipeline: dataset files -> token rows -> micro-batches for the engine.

Stages, one module each:

    catalog    data.path (one source, a list, LLaMA-Factory's dataset_info.json via registry) -> sources
    source     find and load raw records (local file, save_to_disk dir, hub name) via `datasets`
    formats    text | instruction | chat | prompt_completion | tokens | preference | unpaired: `auto`
    fields     the fields no format reads: metadata, text (a warning) or meaning (refused)
    records    a record -> its turns as text (scalars, system/history, sharegpt, tool calls)
    templates  chat-template / Alpaca rendering, checked against the record, and the loss spans
    encode     tokenization, label masking, token ids checked against the model's vocabulary
    completion prompt/completion records as TRL's SFTTrainer tokenizes them
    preference preference records -> (prompt, chosen, rejected) ids, as TRL's DPOTrainer tokenizes them
    pairs      pairs -> two rows each (TRL's truncation); PairSet: a token set seen pair by pair
    unpaired   KTO records -> (prompt, completion, desirable) ids as TRL's KTOTrainer; each example
               with a mismatched completion (TRL's KL pairs), two rows seen as a PairSet
    build      one source -> its rows (long text split, the rest truncated and counted)
    pack       greedy packing with per-document doc_ids and boundary-masked labels; long-text pieces
    tokset     TokenSet: flat numpy arrays (tokens, labels, row offsets, doc_ids)
    cache      TokenSets on disk, keyed by source, settings and tokenizer; atomic writes
    mixture    several sources' rows as one epoch, by weight (a view: no tokens copied)
    prepare    the entry point below; eval split
    sampler    global batch of step s: a pure function of (seed, step, N, batch_size, shuffle)
    collate    rows -> right-padded `MicroBatch`es (batch.py, the engine contract)

API used by the training loop:

    prepared = prepare_data(cfg.data, tokenizer, seed=cfg.train.seed, model_max_len=...,
                            vocab_size=..., cache_dir=<output.dir>/cache, log=print,
                            batch_size=cfg.train.batch_size)
                                       tokenizer may be None for `tokens` data
    prepared.train, prepared.eval      TokenSet or MixedSet (eval may be None); len(ts), ts[i] -> Row,
                                       ts.label_tokens, ts.num_tokens, ts.format, ts.stats; preference
                                       data: a PairSet (len counts pairs; prepared.unit "pairs")
    prepared.format, prepared.pad_id   format used (what `auto` chose); padding id
    prepared.steps_for(epochs, batch_size)  optimizer steps of that many epochs
    rows = batch_rows(prepared.train, step, cfg.train.batch_size, cfg.train.seed, cfg.data.shuffle)
    micro_batches = collate(rows, cfg.train.micro_batch_size, prepared.pad_id)   # list[MicroBatch]

Every problem with the input raises `InputError` with one line naming the file or config key,
and the record; fields that are read by no format are named by `warning:` lines through `log`,
or refused when they may change what a record means (fields.py).
"""

from .batch import IGNORE, MicroBatch
from .collate import collate, pad_id_of
from .formats import FORMATS, resolve_format
from .mixture import MixedSet
from .prepare import PreparedData, load_token_set, prepare_data, split_eval
from .sampler import batch_indices, batch_rows
from .tokset import Row, TokenSet

__all__ = [
    "FORMATS",
    "IGNORE",
    "MicroBatch",
    "MixedSet",
    "PreparedData",
    "Row",
    "TokenSet",
    "batch_indices",
    "batch_rows",
    "collate",
    "load_token_set",
    "pad_id_of",
    "prepare_data",
    "resolve_format",
    "split_eval",
]
