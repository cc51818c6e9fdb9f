"""Tests of memory plans and the ladder (horizon_cli/planning/)."""
