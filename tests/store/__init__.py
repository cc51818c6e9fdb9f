"""Tests of the parameter store (horizon_cli/store/)."""
