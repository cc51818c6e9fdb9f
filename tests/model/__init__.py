"""Tests of the math (horizon_cli/model/): attention, masks, the native and the generic layer."""
