"""Tests of transports and device choice (horizon_cli/runtime/)."""
