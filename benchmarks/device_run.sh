#!/usr/bin/env bash
# The GPU machine's runs, by named suite: one call runs the suites named (or $STRATA_SUITES, a
# comma list; default: tests,kernels,decode), each under its own time limit and the whole under
# STRATA_DEVICE_BUDGET seconds (the device call's limit is 600). Logs land in $OUT/<suite>.log with
# each benchmark's table and JSON line; a failing suite does not stop the next, and a suite at its
# limit gets SIGINT first (pytest still prints its summary; the benchmarks have printed a
# JSON-PART line per finished part).
#
#   bash benchmarks/device_run.sh                    # tests, kernels, decode
#   bash benchmarks/device_run.sh decode prompt peers
#   STRATA_DEVICE_BUDGET=300 bash benchmarks/device_run.sh gpu-tests
#
# Suites:
#   tests           the GPU tests of the engines, kernels, compiled step, twins and native kernel
#   gpu-tests       every gpu-marked test of the suite, 4 processes at once (benchmarks/gpu_tests.sh)
#   kernels         benchmarks/kernels.py: copy bandwidth, dispatch, the expert kernels, a token's kernels
#   native          benchmarks/kernels.py --native: MLX's affine 4/8-bit and MXFP4 records vs gather_qmm
#   decode          benchmarks/decode.py (STRATA_DECODE_ARGS): all-resident and streaming ms/token
#   decode-context  benchmarks/decode_context.py: compiled decode at contexts 8 and 2048, the plan's presets
#   prompt          benchmarks/prompt.py --mlx at 128 / 512 / 2048 tokens, then the prompt path's GPU tests
#   peers           benchmarks/peers.py: strata against mlx-lm on one shape (peers-medians: 5 processes a side)
#   host-turn       benchmarks/host_turn.py: the streaming host turn by phase
#   speculative     benchmarks/speculative.py --backend mlx, then the speculation tests
#   doctor          benchmarks/doctor_validate.py: the doctor's quick probe against measured runs
#   dense           dense weights as stored (F32 / F16 / Q8_0): the MLX dense tests and dense_stored.py
#   hybrid          Qwen3.5's DeltaNet: its GPU tests, benchmarks/deltanet.py, decode at its per-layer shape
#   deepseek        DeepSeek-V3's MLA: its GPU tests, benchmarks/mla.py, decode at its per-layer shape
#   qwen4           Qwen4-Exp: its tests on the GPU, qwen4_decode.py (F32 and F16 dense), the seed shape's decode
#   ngram-rows      benchmarks/ngram_rows.py: the PLE row store from this machine's disk, cold page cache
#   tier2           tier 2 on mlx-lm's model files: a hybrid (qwen3_next) and an MLA (deepseek_v3) checkpoint at the
#                   real per-layer shapes made here (benchmarks/make_tier2_checkpoint.py), then benchmarks/tier2.py on each
#   tier2-repack    benchmarks/tier2_repack.py --cold on the qwen3_next one: experts in place vs `strata convert DIR`'s records
#   ncu             ncu's GPU time of the expert kernel's block shapes and of a decoded token's kernels
#   ggml            llama.cpp's types kept as stored: their GPU tests, kernels.py --ggml (each expert type's
#                   share of copy bandwidth, the dense GEMV), decode ms/token of the seed shape with Q4_K experts
#                   (Q5_0 downs, as llama.cpp writes a 576-wide down) against the same in Q2_0
#   ggml-ncu        ncu's GPU time of the ggml expert kernel (1 and 64 tokens per type) and the dense GEMV
set -uo pipefail
OUT=${OUT:-/tmp/strata-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)
BUDGET=${STRATA_DEVICE_BUDGET:-540}
SUITES=${*:-${STRATA_SUITES:-tests,kernels,decode}}
SUITES=${SUITES// /,}
DECODE_ARGS=${STRATA_DECODE_ARGS:-} TEST_SELECT=${STRATA_TEST_SELECT:-}
# strata reads every STRATA_* variable as a config key and rejects unknown ones: none reach the suites
unset STRATA_SUITES STRATA_DEVICE_BUDGET STRATA_DECODE_ARGS STRATA_TEST_SELECT
KNOWN=",tests,gpu-tests,kernels,native,decode,decode-context,prompt,peers,peers-medians,host-turn,speculative,doctor,dense,hybrid,deepseek,qwen4,ngram-rows,tier2,tier2-repack,ncu,ggml,ggml-ncu,"
for s in ${SUITES//,/ }; do
  case "$KNOWN" in *",$s,"*) ;; *) echo "device_run.sh: unknown suite '$s' (known: ${KNOWN:1:-1})" >&2; exit 2 ;; esac
done

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
wanted() { case ",$SUITES," in *",$1,"*) return 0 ;; esac; return 1; }
run() {  # run NAME LIMIT_S CMD...: min(LIMIT, time left - 5) seconds, logged to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local l; l=$(left); (( l - 5 < limit )) && limit=$(( l - 5 ))
  if (( limit < 15 )); then echo "== $name skipped (no time left)" | tee -a "$OUT/summary.log"; return; fi
  echo "== $name (limit ${limit}s) $(date +%T)" | tee -a "$OUT/summary.log"
  timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? after $(( $(date +%s) - START ))s" | tee -a "$OUT/summary.log"
  tail -n 25 "$OUT/$name.log"
}
gpu_pytest() {  # the GPU tests' pytest: the device hypothesis profile, a failure's traceback at once
  env PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device python3 -m pytest -v -p no:randomly \
    -p no:cacheprovider -p mlx_agree --tb=short -rfEs "$@"
}

# float32 matmul precision: strata.mlx_backend sets MLX_ENABLE_TF32=0 unless the user set it.
# Check that the in-code default takes effect (and what TF32 would give); if it does not, export it.
tf32() {  # tf32 [VALUE]: relative error of a float32 GPU matmul (K = 2560) vs float64
  local e=(env -u MLX_ENABLE_TF32); [ -n "${1:-}" ] && e=(env MLX_ENABLE_TF32="$1")
  "${e[@]}" python3 -c '
import numpy as np, mlx.core as mx, strata.mlx_backend
r = np.random.default_rng(0); a = r.standard_normal((16, 2560)).astype(np.float32); b = r.standard_normal((2560, 512)).astype(np.float32)
g = np.array(mx.array(a) @ mx.array(b)); ref = a.astype(np.float64) @ b.astype(np.float64)
print(f"{float(np.linalg.norm(g - ref) / np.linalg.norm(ref)):.3g}")' 2>&1 | tail -1
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c 'import mlx.core as mx, numpy, sys; print("mlx", mx.__version__, mx.default_device(), "cuda", mx.cuda.is_available(), "numpy", numpy.__version__, sys.version.split()[0])'
  df -h /dev/shm | tail -1; nproc; free -g | head -2; which g++ ncu || true
  echo "float32 matmul rel err: strata default $(tf32), MLX_ENABLE_TF32=1 $(tf32 1), =0 $(tf32 0)"
  echo "suites: $SUITES"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
if ! grep -q "strata default [0-9.e-]*e-0[6-9]" "$OUT/env.log"; then
  echo "== the in-code TF32 default did not take effect: exporting MLX_ENABLE_TF32=0" | tee -a "$OUT/summary.log"
  export MLX_ENABLE_TF32=0
fi

# the emulated path is CPU-only and runs in CI: deselected here
wanted tests && run tests 220 gpu_pytest --durations=15 tests/mlx_backend/test_mlx_engine.py tests/mlx_backend/test_mlx_kernels.py \
  tests/mlx_backend/test_mlx_compiled.py tests/mlx_backend/test_mlx_twins.py tests/mlx_backend/test_mlx_native_kernel.py tests/families/test_gpt_oss_engines.py \
  -k "not emulated" $TEST_SELECT
wanted gpu-tests && run gpu-tests 280 bash benchmarks/gpu_tests.sh 250  # logs in /tmp/strata-gpu-tests
wanted kernels && run kernels 100 python3 benchmarks/kernels.py
wanted native && run native 200 python3 benchmarks/kernels.py --native
wanted decode && run decode 180 python3 benchmarks/decode.py $DECODE_ARGS
wanted decode-context && run decode-context 200 python3 benchmarks/decode_context.py --contexts 8,2048 \
  --forms default,unchained --also 8/no_views
wanted prompt && run prompt 300 bash -c 'python3 benchmarks/prompt.py --mlx --lengths 128,512,2048 --repeat 3;
  PYTHONPATH="tests:${PYTHONPATH:-}" python3 -m pytest -q -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs \
  tests/mlx_backend/test_mlx_prompt.py tests/mlx_backend/test_mlx_q2_mma.py tests/mlx_backend/test_mlx_prompt_rows.py tests/mlx_backend/test_mlx_pair_sort.py \
  -k "not emulated"'
# mlx-lm's wheel installed for the benchmark only (--no-deps: peers.py loads its model files alone)
wanted peers && run peers 240 python3 benchmarks/peers.py
wanted peers-medians && run peers-medians 540 python3 benchmarks/peers.py --tokens 16 --processes 5
wanted host-turn && run host-turn 60 python3 benchmarks/host_turn.py --backend numpy,mlx --layers 16 --tokens 16 --repeat 3
wanted speculative && run speculative 240 bash -c 'python3 benchmarks/speculative.py --backend mlx --repeat 3 &&
  PYTHONPATH="tests:${PYTHONPATH:-}" python3 -m pytest -q -p no:cacheprovider tests/speculative/test_speculative_generate.py'
wanted doctor && run doctor 150 python3 benchmarks/doctor_validate.py --backend mlx --quick --remeasure \
  --models small,demo --arenas 0.15,0.3,0.6 --budget-s 120 --case-timeout 30 --cache-dir /tmp/strata-doctor-cache
wanted dense && run dense 150 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree --tb=short -rfEs tests/mlx_backend/test_mlx_dense.py -k "not emulated";
  python3 benchmarks/dense_stored.py --backend mlx --shape demo --hidden 1024 --layers 8 --tokens 32 --case-timeout 40'
# Qwen3.5-397B's 60 layers fit neither all-resident (148 GB) nor as a /dev/shm file (121 GB) on
# one H200 machine: its per-layer shape with fewer layers (decode.py says why it skips a part)
wanted hybrid && run hybrid 300 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 110 \
  python3 -m pytest -q -p no:randomly -p no:cacheprovider -p mlx_agree --tb=short -rfEs \
  tests/mlx_backend/test_mlx_deltanet_kernel.py tests/families/test_hybrid_engines.py -k "not emulated";
  timeout 60 python3 benchmarks/deltanet.py;
  timeout 120 python3 benchmarks/decode.py --shape qwen3.5-397b --layers 40 --skip streaming,handshake'
# DeepSeek-V3's 61 layers are ~246 GB all-resident: its per-layer shape with 16 layers
wanted deepseek && run deepseek 300 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 110 \
  python3 -m pytest -q -p no:randomly -p no:cacheprovider -p mlx_agree --tb=short -rfEs -m gpu \
  tests/mlx_backend/test_mlx_mla_kernel.py tests/mlx_backend/test_mlx_mla.py tests/families/test_sigmoid_engines.py;
  timeout 60 python3 benchmarks/mla.py;
  timeout 120 python3 benchmarks/decode.py --shape deepseek-v3 --layers 16 --tokens 8 --skip streaming,handshake'
wanted qwen4 && run qwen4 480 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" timeout 200 python3 -m pytest -q \
  -p no:cacheprovider --tb=short -rfEs tests/mlx_backend/test_mlx_qwen4.py tests/families/test_qwen4_engines.py tests/mlx_backend/test_mlx_qwen4_ple_rows.py \
  tests/mlx_backend/test_mlx_qwen4_dense.py tests/mlx_backend/test_mlx_hyper_compute.py;
  timeout 80 python3 benchmarks/qwen4_decode.py --tokens 16;
  timeout 80 python3 benchmarks/qwen4_decode.py --tokens 16 --dense f16;
  timeout 110 python3 benchmarks/decode.py --shape qwen4-seed --ple-gb 4 --tokens 8 --prompt 1'
wanted ggml && run ggml 480 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 150 \
  python3 -m pytest -q -p no:randomly -p no:cacheprovider -p mlx_agree --tb=short -rfEs \
  tests/mlx_backend/test_mlx_ggml_kernels.py tests/mlx_backend/test_mlx_ggml_engine.py -k "not emulated";
  timeout 120 python3 benchmarks/kernels.py --ggml;
  timeout 100 python3 benchmarks/decode.py --expert-type Q4_K --skip streaming,handshake --no-eval-sweep;
  timeout 100 python3 benchmarks/decode.py --expert-type Q2_0 --skip streaming,handshake --no-eval-sweep'
if wanted ggml-ncu; then
  if command -v ncu >/dev/null; then
    run ggml-ncu 300 bash -c 'ncu --clock-control none -k "regex:strata_(moe_ggml|ggml_gemv)" --csv --metrics \
      gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
      python3 benchmarks/kernels.py --ncu ggml'
  else
    echo "== ggml-ncu skipped (no ncu here)" | tee -a "$OUT/summary.log"
  fi
fi
wanted ngram-rows && run ngram-rows 180 python3 benchmarks/ngram_rows.py --gb 8 --tokens 100 --threads 8 --layer-ms 0,0.5
# mlx-lm's wheel installed for tier 2 as for peers (with its imports: transformers and the rest are the image's).
# The checkpoints (random weights, mlx-lm's own classes and 4-bit quantization) stay in /tmp/strata-tier2
# while the machine is warm: a config.json there means a whole one (written last)
wanted tier2 && run tier2 500 bash -c 'for f in qwen3_next deepseek_v3; do d=/tmp/strata-tier2/$f;
  if [ ! -f $d/config.json ]; then rm -rf $d;
    timeout 150 python3 benchmarks/make_tier2_checkpoint.py $f --out $d --quiet || continue; fi;
  timeout 180 python3 benchmarks/tier2.py $d --tokens 32; done'
wanted tier2-repack && run tier2-repack 400 bash -c 'd=/tmp/strata-tier2/qwen3_next; if [ ! -f $d/config.json ]; then
  rm -rf $d; timeout 150 python3 benchmarks/make_tier2_checkpoint.py qwen3_next --out $d --quiet || exit 1; fi;
  python3 benchmarks/tier2_repack.py $d --tokens 32 --repeat 2 --cold'
if wanted ncu; then
  if command -v ncu >/dev/null; then
    # the expert kernel's 64-token launches (one per block shape) with the sections that say why,
    # then every kernel of one decoded 2-layer token (the prompt's 14 launches skipped)
    run ncu 240 bash -c 'ncu --clock-control none -k regex:strata_moe_slots --launch-skip 3 --launch-count 4 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      python3 benchmarks/kernels.py --ncu moe;
      ncu --clock-control none -k "regex:strata_" --launch-skip 14 --metrics \
      gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active \
      python3 benchmarks/kernels.py --ncu decode'
  else
    echo "== ncu skipped (no ncu here)" | tee -a "$OUT/summary.log"
  fi
fi
echo "== done after $(( $(date +%s) - START ))s" | tee -a "$OUT/summary.log"
