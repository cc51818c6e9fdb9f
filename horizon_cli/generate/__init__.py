"""Generation, in one package that plugs into the engine through its public parts (the sweep, the
parts, the guard) and the pass protocol (engine.seams.LayerPass); nothing below imports it.

    decoder       the loop over a batch of prompts (`Decoder`): micro-batches, sampling, stopping
    decode        the sweeps: `DecodePass` (a layer with its KV cache) and `Generation` (open, step)
    kvcache       the batch's KV cache, on the device or between sweeps on the host
    kvprobe       each cache layer's size, read off transformers' model on the meta device
    budget        the plan's arithmetic: bytes per sweep, the cache and where it lives, the link bound
    plan          the plan `horizon generate` prints, the link measured
    model_source  the model a generation runs: a store or a run dir (its adapters, its config)
    run           the command `horizon generate`
    harness       horizon's model for lm-evaluation-harness

The prompts (data.prompts) and sampling (model.sample) live below; eval-time samples
(train.samples) run the same `Decoder`."""

from .run import Settings, run_generate

__all__ = ["Settings", "run_generate"]
