"""Tests of conversion of HF checkpoints into stores (horizon_cli/convert/), real checkpoints included."""
