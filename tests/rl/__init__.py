"""Tests of online RL: GRPO (horizon_cli/recipes/grpo/)."""
