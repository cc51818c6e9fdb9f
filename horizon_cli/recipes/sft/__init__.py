"""Supervised fine-tuning: token rows, the engine's cross-entropy (batches, recipe)."""
