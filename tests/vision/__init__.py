"""Tests of images (horizon_cli/vision/)."""
