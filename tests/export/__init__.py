"""Tests of export to HF checkpoints (horizon_cli/export/)."""
