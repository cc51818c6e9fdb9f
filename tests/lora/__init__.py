"""Tests of LoRA and QLoRA (horizon_cli/lora/)."""
