"""Tests of host state and the CPU optimizer worker (horizon_cli/state/)."""
