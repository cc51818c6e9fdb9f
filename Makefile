# horizon — common verbs. `make demo` and `make test` install into .venv first when needed.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo demo-lora demo-dpo demo-grpo demo-tools demo-vision test test-slow audit lint format bench bench-convert smollm2 clean

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

test: install
	$(BIN)/python -m pytest -n auto --dist loadfile

test-slow: install
	$(BIN)/python -m pytest -n auto --dist loadfile -m 'slow or not slow and not gpu and not smollm2'

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
