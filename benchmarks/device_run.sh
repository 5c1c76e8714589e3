#!/usr/bin/env bash
# One call on the GPU machine does everything (METHOD.md: few, full calls): the GPU tests and the
# differential tests on the CUDA build of MLX, benchmarks/kernels.py, benchmarks/decode.py, and
# (time permitting) ncu's GPU-side time of the fused expert kernel vs gather_qmm.
# Logs and JSON lines land in $OUT (the device tool brings them back). Each stage has its own
# time limit and a failing stage does not stop the next; the whole run fits in 600 s.
#   usage (device):  bash .devwhl/pN/install.sh && bash benchmarks/device_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/strata-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)
BUDGET=${STRATA_DEVICE_BUDGET:-540}   # seconds this script may use (the call's limit is 600)
TESTS_S=${STRATA_TESTS_S:-170} KERNELS_S=${STRATA_KERNELS_S:-110} DECODE_S=${STRATA_DECODE_S:-220}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
stage() {  # stage NAME LIMIT_S CMD...: run with min(LIMIT, time left - 5), log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local l; l=$(left); (( l - 5 < limit )) && limit=$(( l - 5 ))
  if (( limit < 15 )); then echo "== $name skipped (no time left)" | tee -a "$OUT/summary.log"; return; fi
  echo "== $name (limit ${limit}s) $(date +%T)" | tee -a "$OUT/summary.log"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? after $(( $(date +%s) - START ))s" | tee -a "$OUT/summary.log"
  tail -n 25 "$OUT/$name.log"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c 'import mlx.core as mx, numpy, sys; print("mlx", mx.__version__, mx.default_device(), "cuda", mx.cuda.is_available(), "numpy", numpy.__version__, sys.version.split()[0])'
  df -h /dev/shm | tail -1; nproc; free -g | head -2; which g++ ncu || true
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

# GPU tests + the differential suite (ops path on the CUDA device, kernel path through cuda_kernel).
# The emulated path is CPU-only and already runs in CI: skipped here to save device time.
# STRATA_TEST_SELECT narrows the test run when device time is short (e.g. "-m gpu").
stage tests $TESTS_S python3 -m pytest -q -p no:cacheprovider -rs tests/test_mlx_twins.py tests/test_mlx_kernels.py \
  tests/test_mlx_engine.py -k "not emulated" ${STRATA_TEST_SELECT:-} --durations=10
stage kernels $KERNELS_S python3 benchmarks/kernels.py
stage decode $DECODE_S python3 benchmarks/decode.py ${STRATA_DECODE_ARGS:-}
if command -v ncu >/dev/null; then
  stage ncu 80 ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \
    -k 'regex:moe|qmm|qmv|gather' python3 benchmarks/kernels.py --ncu
fi
grep -h '^JSON' "$OUT"/kernels.log "$OUT"/decode.log > "$OUT/results.jsonl" 2>/dev/null
echo "== done after $(( $(date +%s) - START ))s" | tee -a "$OUT/summary.log"
