"""horizon's tests, a folder per package they test; tests/support is what they, scripts/ and
benchmarks/ share (tiny models, the tokenizer, the oracles), tests/fixtures the files they read."""
