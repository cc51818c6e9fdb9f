#!/usr/bin/env bash
# One command on a machine with one CUDA GPU (an H200: about 7 minutes, at most 12), results in
# one folder:
#   1. parity: the engine oracles on the GPU (logits, loss, gradients against transformers; 20-step
#      AdamW parity; micro-batch invariance; event ordering on the timeline) and the CUDA-only
#      checks (tests/runtime/test_cuda_gpu.py: a failed registration leaves no error, pinned fallback,
#      flex block masks against dense masks forward and backward, the device fit check, sequence
#      tiles against untiled and their peak against the plan) and
#      dropout's masks on the CUDA generator (tests/engine/test_dropout.py: recompute bit for bit, seeds)
#   1b. lora: LoRA against peft on the GPU (dense and NF4 bases; tests/lora/test_lora_engine.py)
#   2. throughput: tokens/s and MFU at Llama-3.1-8B's layer shape (4 layers, vocab 128256, seq
#      4096), peak device memory against the plan
#   2b. keep: the same with engine.keep_activations auto (every layer kept if the plan finds room):
#      step time against 2 (all recomputed), peak memory against the plan with its kept layers;
#      and kept against recomputed runs within float tolerance (tests/engine/test_keep.py on the GPU)
#   3. profile: `horizon profile` of that store: link bandwidth, per-layer times, overlap, a trace
#      and a timeline
#   4. pinned: host memory kinds against the link (registered / pinned / staging / pageable)
#
#   bash scripts/gpu_check.sh [OUT]          (OUT: default $OUT, else gpu_check_out)
#
# Runs from a checkout with the GPU machine's own python3 (torch, transformers); the package is
# used from the source tree, not installed. The 4 GB random store lives in a temp dir.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
status=0
run() {  # run NAME TIMEOUT CMD...: log to OUT/NAME.txt, keep going on failure
  local name=$1 limit=$2; shift 2
  echo "== $name" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n 3 "$OUT/$name.txt" | tee -a "$OUT/summary.txt"
  echo "rc=$rc ($((SECONDS - t0)) s)" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/summary.txt" 2>&1
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" >> "$OUT/summary.txt" 2>&1
run parity 180 env HORIZON_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider -m 'gpu or not gpu' \
  tests/engine/test_engine_parity.py tests/engine/test_engine_training.py "tests/engine/test_pipeline.py::test_schedule_ordering" \
  tests/runtime/test_cuda_gpu.py tests/model/test_generic_parity.py tests/model/test_generic_training.py \
  tests/engine/test_keep.py::test_kept_equals_recomputed_bitwise tests/engine/test_keep.py::test_moe_and_qlora_kept_equal_recomputed \
  tests/engine/test_keep.py::test_a_sequence_objective_kept_equals_recomputed tests/engine/test_dropout.py
run lora 30 env HORIZON_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider tests/lora/test_lora_engine.py \
  -k "steps_match or nf4"
run throughput 210 $PY benchmarks/gpu_throughput.py --store "$WORK/store" --profile-config "$WORK/profile.yaml" \
  --json "$OUT/throughput.json"
if [ -d "$WORK/store" ]; then  # the same store and shapes, every layer the plan has room for kept
  run keep 90 $PY benchmarks/gpu_throughput.py --store "$WORK/store" --keep auto --json "$OUT/throughput-keep.json"
fi
if [ -f "$WORK/profile.yaml" ]; then
  run profile 120 $PY -m horizon_cli.cli profile "$WORK/profile.yaml" --json "$OUT/profile.json" \
    --trace "$OUT/trace.json" --plot "$OUT/timeline.png"
fi
run pinned 60 $PY benchmarks/gpu_pinned.py --json "$OUT/pinned.json"
exit $status
