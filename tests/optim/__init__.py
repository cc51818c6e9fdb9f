"""Tests of AdamW kernels, lean, schedules (horizon_cli/optim/, kernels/)."""
