"""Tests of preference training: DPO and its kin, KTO (data, losses, runs)."""
