"""The benchmarks: harnesses here, one-off studies in investigations/ (benchmarks/README.md)."""
