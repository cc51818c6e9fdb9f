"""Tests of records, formats, sources, packing and batches (horizon_cli/data/)."""
