"""Tests of the streamed engine (horizon_cli/engine/): parity, training, kept layers, tiles, the pipeline."""
