"""Tests of `horizon profile` (horizon_cli/profile/)."""
