"""A maintainer's tools. Those that import tests.support run from the checkout's root as
`python -m scripts.NAME`; the others also by their path."""
