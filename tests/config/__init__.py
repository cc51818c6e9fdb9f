"""Tests of the shipped configs (configs/, horizon_cli/config/)."""
