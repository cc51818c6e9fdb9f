"""KTO on unpaired preference examples: loss, batches, recipe (the reference pass is preference's)."""
