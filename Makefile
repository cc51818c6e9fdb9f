# horizon — common verbs. `make demo` and `make test` install into .venv first when needed.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo demo-lora demo-dpo demo-grpo demo-tools demo-vision test test-slow test-full census audit lint format bench bench-convert smollm2 clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/python scripts/demo.py

demo-lora: install
	$(BIN)/python scripts/demo.py --lora

demo-dpo: install
	$(BIN)/python scripts/demo.py --dpo

demo-grpo: install
	$(BIN)/python scripts/demo.py --grpo

demo-tools: install
	$(BIN)/python scripts/demo.py --tools

demo-vision: install
	$(BIN)/python -m scripts.demo_vision

# two tiers (docs/benchmarks.md, "The test tiers"): `make test` the fast one (pyproject's addopts: not slow and not
# opt-in), `make test-slow` only the slow one, `make test-full` both in one run; .ci/run runs test then test-slow.
# Opt-in, in neither: gpu (a CUDA device), smollm2 and gemma3 (real checkpoints built on demand), census (every
# causal-LM type of the installed transformers, ~40 min: a new release's types are recorded by scripts/census.py first)
OPT_IN  := not gpu and not smollm2 and not gemma3 and not census
PYTEST  := $(BIN)/python -m pytest -n auto --dist loadfile

test: install
	$(PYTEST)

test-slow: install
	$(PYTEST) -m 'slow and $(OPT_IN)'

test-full: install
	$(PYTEST) -m '$(OPT_IN)'

census: install
	$(PYTEST) -m census tests/census

# the mutation audit (scripts/mutation_audit.py, its rows in scripts/mutation_audit.yaml): each row's mutant against its tests, one at a time
# (hours on a laptop); rows whose anchor no longer applies are listed as stale, not failed
audit: install
	$(BIN)/python scripts/mutation_audit.py --json bench_out/mutation_audit.json

lint: install
	$(BIN)/ruff check horizon_cli tests scripts benchmarks kernels
	$(BIN)/ruff format --check horizon_cli tests scripts benchmarks kernels
	$(BIN)/mypy horizon_cli

format: install
	$(BIN)/ruff format horizon_cli tests scripts benchmarks kernels
	$(BIN)/ruff check --fix horizon_cli tests scripts benchmarks kernels

bench: install
	$(BIN)/python scripts/bench.py  # the benchmark runner: benchmarks/bench_peers.py

bench-convert: install
	$(BIN)/python scripts/bench.py convert --json bench_out/convert.json

smollm2: install
	$(BIN)/python scripts/smollm2.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
