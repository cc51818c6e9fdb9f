"""One-off studies behind docs/benchmarks.md's figures, indexed in benchmarks/README.md; each runs
from the checkout's root as `python -m benchmarks.investigations.NAME`."""
