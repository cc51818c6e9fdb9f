"""Tests of NF4 stores (horizon_cli/quant/)."""
