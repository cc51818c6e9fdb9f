"""Tests of the census of transformers' model types (scripts/census.py)."""
