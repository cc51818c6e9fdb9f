"""Tests of the Python API (horizon_cli/api.py)."""
