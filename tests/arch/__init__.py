"""Tests of architecture descriptions (horizon_cli/arch/)."""
