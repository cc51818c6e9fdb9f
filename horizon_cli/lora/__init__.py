"""LoRA and QLoRA in one place: which linear layers are adapted (targets, PEFT's rules), a run's
settings (setup), the arithmetic on a layer's linear outputs (linear), the adapters' host state
(state), their bytes and the lora rung's memory plan (sizes), PEFT's adapter files (peft), and the
export of a LoRA run: adapters merged into the base, or the adapter copied (merge). The engine
plugs them in through its params and tuning strategies (engine.params' LoraParams, engine.tuning's
LoraTuning); nothing below this package imports it."""
