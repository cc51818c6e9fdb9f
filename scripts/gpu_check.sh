#!/usr/bin/env bash
# The GPU check for one ten-minute slot: one call, every stage timed, the whole under 540 s, results
# as JSON under the output folder (gpu_check.json: a `stages` list, each with name, ok, seconds,
# rc, limit and the stage's own results; each stage's log beside it as NAME.txt).
#
#   bash scripts/gpu_check.sh [--cpu] [--out DIR]      (DIR: default $OUT, else gpu_check_out)
#
# --cpu rehearses every stage on the CPU (small shapes, the same code paths and scripts), so a GPU
# slot is never spent on a typo; its limits are 1.5x the GPU's, its budget 290 s.
#
# Stages (limits in seconds; a stage never gets more than what is left of the 535 s budget):
#   env         30   torch, CUDA, driver, the GPU and its memory (benchmarks/gpu_stages.py env)
#   bandwidth   30   pinned H2D, D2H and both at once at 1 GB (gpu_stages.py bandwidth)
#   race       130   2 Llama-3.1-8B-shaped bf16 layers, 32K vocabulary, 3 steps: plain, serialized
#                    (no copy overlaps compute) and with torch.cuda._sleep delays on the copy streams,
#                    prefetch 1/2/3, keep 0/auto, bitwise equal (benchmarks/gpu_race.py)
#   parity      90   fp32 engine parity against transformers, the -m gpu tests (tests/runtime/test_cuda_gpu.py,
#                    tests/runtime/test_gpu_ready_gpu.py), under TORCH_LOGS=recompiles (recompiles in the log)
#   kv          40   host-KV against device-KV generation, rows ending at different times
#   layer       35   one real-shaped layer in bf16 against fp32 (gpu_stages.py layer)
#   throughput 160   an 8B-shaped model of 16 layers at 64K and 8K tokens a step: phases, GPU-busy
#                    fraction, GB/s, MFU, allocated / reserved / driver memory against the plan
#
# Runs from a checkout with the machine's own python3 (PYTHON= to choose); the package is used from
# the source tree, not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
OUT=${OUT:-gpu_check_out}
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) DEVICE=cpu ;;
    --out) OUT=$2; shift ;;
    *) echo "error: unknown argument $1 (use --cpu, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
BUDGET=535  # seconds; the limits below add up to 515
SCALE=2     # limits x SCALE / 2: the CPU rehearsal (a loaded machine, cold imports) gets 1.5x
if [ "$DEVICE" = cpu ]; then BUDGET=290; SCALE=3; fi
START=$SECONDS
: > "$OUT/stages.jsonl"
status=0

stage() {  # stage NAME LIMIT CMD...: log to OUT/NAME.txt, its JSON (if any) at OUT/NAME.json
  local name=$1 limit=$2; shift 2
  limit=$((limit * SCALE / 2))
  local left=$((BUDGET - (SECONDS - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  local t0 rc
  t0=$EPOCHREALTIME
  if [ "$limit" -le 0 ]; then
    rc=124; echo "no time left" > "$OUT/$name.txt"
  else
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    rc=$?
  fi
  local dt
  dt=$(awk "BEGIN { print $EPOCHREALTIME - $t0 }")
  [ $rc -eq 0 ] || status=1
  printf '{"name": "%s", "ok": %s, "rc": %d, "seconds": %.1f, "limit": %d}\n' \
    "$name" "$([ $rc -eq 0 ] && echo true || echo false)" "$rc" "$dt" "$limit" >> "$OUT/stages.jsonl"
  printf '%-10s rc=%-3d %6.1f s  (limit %d)\n' "$name" "$rc" "$dt" "$limit"
}

if [ "$DEVICE" = cuda ]; then
  PARITY=(tests/engine/test_engine_parity.py tests/runtime/test_cuda_gpu.py tests/runtime/test_gpu_ready_gpu.py tests/runtime/test_gpu_ready.py)
  KV=(tests/runtime/test_gpu_ready_gpu.py::test_host_kv_generation_releases_no_buffer_under_a_copy)
  RACE=()
else  # the rehearsal: the same files (the gpu tests are collected and skipped), fewer cases
  PARITY=(tests/engine/test_engine_parity.py tests/runtime/test_cuda_gpu.py tests/runtime/test_gpu_ready_gpu.py tests/runtime/test_gpu_ready.py
          -k "not (qwen or mistral or llama31 or True or eval_loss)")
  RACE=(--steps 2)
  KV=(tests/runtime/test_chaos.py -k "generation and True")  # host KV under the chaos transport
fi

stage env 30 $PY benchmarks/gpu_stages.py env --device $DEVICE --json "$OUT/env.json"
stage bandwidth 30 $PY benchmarks/gpu_stages.py bandwidth --device $DEVICE --json "$OUT/bandwidth.json"
stage race 130 $PY benchmarks/gpu_race.py --device $DEVICE --json "$OUT/race.json" "${RACE[@]}"
stage parity 90 env HORIZON_TEST_DEVICE=$DEVICE TORCH_LOGS=recompiles $PY -m pytest -q -p no:cacheprovider \
  -m 'gpu or not gpu' "${PARITY[@]}"
stage kv 40 env HORIZON_TEST_DEVICE=$DEVICE $PY -m pytest -q -p no:cacheprovider -m 'gpu or not gpu' "${KV[@]}"
stage layer 35 $PY benchmarks/gpu_stages.py layer --device $DEVICE --json "$OUT/layer.json"
stage throughput 160 $PY benchmarks/gpu_stages.py throughput --device $DEVICE --json "$OUT/throughput.json"

$PY - "$OUT" "$DEVICE" "$((SECONDS - START))" <<'EOF'
import json, sys
from pathlib import Path
out, device, total = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
stages = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]
for s in stages:
    f = out / f"{s['name']}.json"
    if f.is_file():
        s["results"] = json.loads(f.read_text())
    s["log"] = f"{s['name']}.txt"
    if "recompile" in (out / s["log"]).read_text(errors="replace"):
        s["recompiles"] = (out / s["log"]).read_text(errors="replace").count("Recompiling function")
report = {"device": device, "seconds": total, "ok": all(s["ok"] for s in stages), "stages": stages}
(out / "gpu_check.json").write_text(json.dumps(report, indent=1))
print(f"{'ok' if report['ok'] else 'FAILED'}: {sum(s['ok'] for s in stages)}/{len(stages)} stages in {total} s"
      f" -> {out / 'gpu_check.json'}")
EOF
exit $status
