#!/usr/bin/env bash
# On a machine with a CUDA GPU, in about 8 minutes, results in one folder:
#   1. the engine oracles (logits, loss, gradients, 20-step AdamW parity, micro-batch invariance,
#      event ordering) on the GPU
#   2. throughput of a ~1.2B-parameter Llama-shaped model at seq 2048, with MFU
#   3. horizon profile of that shape's little sibling, with a trace and a timeline
#   4. host memory kinds against the link (registered / pinned / staging / pageable)
#
#   bash scripts/gpu_check.sh [OUT]          (OUT: default $OUT, else gpu_check_out)
#
# Runs from a checkout with the GPU machine's own python3 (torch, transformers); the package is
# used from the source tree, not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
status=0
run() {  # run NAME TIMEOUT CMD...: log to OUT/NAME.txt, keep going on failure
  local name=$1 limit=$2; shift 2
  echo "== $name" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n 3 "$OUT/$name.txt" | tee -a "$OUT/summary.txt"
  echo "rc=$rc" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/summary.txt" 2>&1
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$OUT/summary.txt" 2>&1
run parity 200 env HORIZON_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
  tests/test_engine_parity.py tests/test_engine_training.py "tests/test_pipeline.py::test_schedule_ordering" \
  tests/test_generic_parity.py tests/test_generic_training.py
run throughput 200 $PY scripts/gpu_throughput.py --json "$OUT/throughput.json"
run profile 100 $PY -m horizon_cli.cli profile --json "$OUT/profile.json" --plot "$OUT/timeline.png"
run pinned 60 $PY scripts/gpu_pinned.py --json "$OUT/pinned.json"
exit $status
