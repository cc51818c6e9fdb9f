"""Tests of generation (horizon_cli/generate/)."""
