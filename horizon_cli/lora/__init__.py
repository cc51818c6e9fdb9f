"""LoRA: which linear layers are adapted (targets, PEFT's rules) and PEFT's adapter files (peft)."""
