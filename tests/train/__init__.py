"""Tests of `horizon train`: runs, resume, run dirs, checks, trackers (horizon_cli/train/)."""
