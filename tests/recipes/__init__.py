"""Tests of horizon_cli/recipes/: the registry and the seam between a training method and the engine."""
