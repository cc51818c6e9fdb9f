"""Sharded data parallelism: which part of each unit a rank holds, and what a world size allows."""
