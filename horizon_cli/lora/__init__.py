"""LoRA and QLoRA in one place: which linear layers are adapted (targets, PEFT's rules), a run's
settings (setup), the arithmetic on a layer's linear outputs (layer), the adapters' host state
(state), their memory plan (plan), PEFT's adapter files (peft) and the merged or adapter export
(export). The engine plugs them in through its params and tuning strategies (engine.params'
LoraParams, engine.tuning's LoraTuning); nothing below this package imports it."""
