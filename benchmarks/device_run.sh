#!/usr/bin/env bash
# One call on the GPU machine does everything (METHOD.md: few, full calls): the GPU tests and the
# differential tests on the CUDA build of MLX, benchmarks/kernels.py, benchmarks/decode.py, and
# (time permitting) ncu's GPU-side time of the fused expert kernel vs gather_qmm.
# Logs and JSON lines land in $OUT (the device tool brings them back; at most 8 files: env,
# summary, tests, kernels, host_turn, decode, ncu_moe, ncu, or speculative or native when selected; the JSON lines are in the logs; junit.xml dropped). Each stage has its own time
# limit, a share of STRATA_DEVICE_BUDGET, and a failing stage does not stop the next. A stage at
# its limit gets SIGINT first: pytest then still prints its summary, and the
# benchmarks have already printed a JSON-PART line per finished part.
#   usage (device):  bash .devwhl/pN/install.sh && STRATA_DEVICE_BUDGET=300 bash benchmarks/device_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/strata-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)
BUDGET=${STRATA_DEVICE_BUDGET:-540}   # seconds this script may use (the call's limit is 600)
TESTS_S=${STRATA_TESTS_S:-$(( BUDGET * 38 / 100 ))} KERNELS_S=${STRATA_KERNELS_S:-$(( BUDGET * 17 / 100 ))}
DECODE_S=${STRATA_DECODE_S:-$(( BUDGET * 33 / 100 ))}
TEST_SELECT=${STRATA_TEST_SELECT:-} DECODE_ARGS=${STRATA_DECODE_ARGS:-}
# strata reads every STRATA_* variable as a config key and rejects unknown ones (seen on the H200:
# "unknown config keys ['device_budget']" in test_generate_with_backend_mlx): none reach the stages
HOST_TURN_S=${STRATA_HOST_TURN_S:-60}
SPEC_S=${STRATA_SPEC_S:-240}  # the speculative stage: run it alone, STRATA_STAGES=speculative
NATIVE_S=${STRATA_NATIVE_S:-200}
STAGES=${STRATA_STAGES:-tests,kernels,host_turn,decode,ncu_moe,ncu}  # the stages to run, comma list
# issue 19's stages (not in the default list): dispatch, decode_context, peers, jit_probe, attend_context, chains, groups, graph_time, graph_forms, walk_check, deferred, l2_probe, launch_cuts, launch_cuts_e2e, launch_cuts_forms, launch_cuts_ncu, host_spy, folded, packed, split_chain, peers_medians, timeline, marks, layer_timeline, split32, split_steps, spread_graph, split_defaults, rank_marks, rank_branchless, included, leaf_constants, handed_on
# the Qwen4-Exp stages (issue 15; not in the default list): qwen4_tests, qwen4_decode, qwen4_seed (the
# reference engine's model, synthetic, 48 layers: 7.8 GB model file + 17 GB experts + a --ple-gb row
# store, in /dev/shm where it holds them, else the temporary directory; pooled random weights build
# in well under a minute; a 1-token prompt: prefill and decode share their kernels' compiles)
QWEN4_SEED_ARGS=${STRATA_QWEN4_SEED_ARGS:---ple-gb 4 --tokens 8 --prompt 1} QWEN4_SEED_S=${STRATA_QWEN4_SEED_S:-300}
# the hybrid stages (issue 14; not in the default list): hybrid_tests, deltanet, hybrid_resident,
# hybrid_stream, ncu_deltanet. Qwen3.5-397B's 60 layers fit neither all-resident (148 GB) nor as a
# /dev/shm file (121 GB) on one H200 machine: the per-layer shape with fewer layers (decode.py says
# why it skips a part that does not fit)
HYBRID_RESIDENT_ARGS=${STRATA_HYBRID_RESIDENT_ARGS:---layers 40 --skip streaming,handshake}
HYBRID_STREAM_ARGS=${STRATA_HYBRID_STREAM_ARGS:---layers 24 --skip resident,handshake}
HYBRID_S=${STRATA_HYBRID_S:-240}
# DeepSeek-V3 (issue 16; not in the default list): mla_tests, mla, mla_variants, deepseek_resident,
# deepseek_stream, ncu_mla. Its 61 layers are ~246 GB all-resident and a 204 GB .experts file: the
# per-layer shape with fewer layers; decode.py prints the per-layer ms and the 61 layers from them
# (16 layers: a 45 GB arena copied from one MoE layer's pool; 8 layers: a 17.6 GB file in /dev/shm)
DEEPSEEK_RESIDENT_ARGS=${STRATA_DEEPSEEK_RESIDENT_ARGS:---layers 16 --tokens 8 --skip streaming,handshake}
DEEPSEEK_STREAM_ARGS=${STRATA_DEEPSEEK_STREAM_ARGS:---layers 8 --tokens 8 --skip resident,handshake}
NGRAM_ARGS=${STRATA_NGRAM_ARGS:---gb 8 --tokens 100 --threads 8 --layer-ms 0,0.5} NGRAM_S=${STRATA_NGRAM_S:-180}
# the doctor's validation on the GPU, bounded (issue 22; not in the default list: STRATA_STAGES=doctor):
# the quick probe's engine cases and the small and demo models all-resident and at three arenas
# each, over one pool of warmed processes (compiles in parallel, runs measured one at a time in
# interleaved rounds), 150 s at most, a JSON-PART line per measured run as it goes
DOCTOR_S=${STRATA_DOCTOR_S:-150}
# dense weights as stored on the GPU (issue 22; STRATA_STAGES=dense): the MLX dense tests (the
# Q8_0 GEMV path within FORWARD, F16 held as stored), then F32 / F16 / Q8_0 dense side by side
DENSE_S=${STRATA_DENSE_S:-150}
unset STRATA_STAGES STRATA_DEVICE_BUDGET STRATA_TESTS_S STRATA_KERNELS_S STRATA_DECODE_S STRATA_TEST_SELECT STRATA_DECODE_ARGS STRATA_HOST_TURN_S STRATA_SPEC_S
unset STRATA_HYBRID_RESIDENT_ARGS STRATA_HYBRID_STREAM_ARGS STRATA_HYBRID_S STRATA_NGRAM_ARGS STRATA_NGRAM_S STRATA_DOCTOR_S STRATA_DENSE_S
unset STRATA_QWEN4_SEED_ARGS STRATA_QWEN4_SEED_S
unset STRATA_NATIVE_S
unset STRATA_DEEPSEEK_RESIDENT_ARGS STRATA_DEEPSEEK_STREAM_ARGS
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
stage() {  # stage NAME LIMIT_S CMD...: run with min(LIMIT, time left - 5), log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  case ",$STAGES," in *",$name,"*) ;; *) echo "== $name not selected" >> "$OUT/summary.log"; return ;; esac
  local l; l=$(left); (( l - 5 < limit )) && limit=$(( l - 5 ))
  if (( limit < 15 )); then echo "== $name skipped (no time left)" | tee -a "$OUT/summary.log"; return; fi
  echo "== $name (limit ${limit}s) $(date +%T)" | tee -a "$OUT/summary.log"
  timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? after $(( $(date +%s) - START ))s" | tee -a "$OUT/summary.log"
  tail -n 25 "$OUT/$name.log"
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
  python3 -c 'import pytest, hypothesis, gguf; print("pytest", pytest.__version__, "hypothesis", hypothesis.__version__, "gguf ok")'
  df -h /dev/shm | tail -1; nproc; free -g | head -2; which g++ ncu || true
  echo "float32 matmul rel err: strata default $(tf32), MLX_ENABLE_TF32=1 $(tf32 1), =0 $(tf32 0)"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
if ! grep -q "strata default [0-9.e-]*e-0[6-9]" "$OUT/env.log"; then
  echo "== the in-code TF32 default did not take effect: exporting MLX_ENABLE_TF32=0" | tee -a "$OUT/summary.log"
  export MLX_ENABLE_TF32=0
fi

# The engine tests and the launch budget first, then the kernels, then the differential suite
# (ops path on the CUDA device, kernel path through cuda_kernel). `device` profile: few examples,
# no shrinking. -v: one line per test as it ends; -p mlx_agree: a failure's traceback at once.
# The emulated path is CPU-only and already runs in CI: deselected here.
stage tests "$TESTS_S" env PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device python3 -m pytest -v \
  -p no:randomly -p no:cacheprovider -p mlx_agree --tb=short -rfEs --durations=15 \
  tests/test_mlx_engine.py tests/test_mlx_kernels.py tests/test_mlx_compiled.py tests/test_mlx_twins.py \
  tests/test_mlx_native_kernel.py tests/test_gpt_oss_engines.py -k "not emulated" $TEST_SELECT
# every gpu-marked test of the suite, 4 processes at once (not in the default list: STRATA_STAGES=gpu_tests)
stage gpu_tests 280 bash benchmarks/gpu_tests.sh 250  # logs in /tmp/strata-gpu-tests; FAILED lines in the stage log
stage kernels "$KERNELS_S" python3 benchmarks/kernels.py
# the native expert kernel (MLX's affine 4/8-bit and MXFP4 records) vs gather_qmm; not in the
# default list (its log would be a ninth file): STRATA_STAGES=tests,native,ncu_moe
stage native "$NATIVE_S" python3 benchmarks/kernels.py --native
# the streaming host turn by phase (MlxCompute on the GPU; the seed's layer shape, 16 layers)
stage host_turn "$HOST_TURN_S" python3 benchmarks/host_turn.py --backend numpy,mlx --layers 16 --tokens 16 --repeat 3
stage decode "$DECODE_S" python3 benchmarks/decode.py $DECODE_ARGS
# PLE n-gram rows from a row store on this machine's disk, cold page cache (issue 15; not in the
# default list: STRATA_STAGES=ngram_rows): the row cache's ms/token and PLE wait per token
stage ngram_rows "$NGRAM_S" python3 benchmarks/ngram_rows.py $NGRAM_ARGS
# hybrids: the GPU tests (DeltaNet step kernel, gated / partial-rotary attend, the compiled hybrid
# step, hybrid engines vs the reference on the GPU path), the DeltaNet kernels against their bytes,
# the Qwen3.5-397B per-layer shape decoding all-resident and streaming
stage hybrid_tests "$HYBRID_S" env PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device python3 -m pytest -v \
  -p no:randomly -p no:cacheprovider -p mlx_agree --tb=short -rfEs \
  tests/test_mlx_deltanet_kernel.py tests/test_mlx_compiled.py::test_compiled_decode_matches_uncompiled_on_a_hybrid \
  tests/test_hybrid_engines.py -k "not emulated"
stage deltanet 120 python3 benchmarks/deltanet.py
# Qwen4-Exp (issue 15; not in the default list): the MLX twin (ops) and the numpy engines against
# the reference on the GPU, then decode ms/token and bytes/token of a scaled qwen4 shape per engine
stage qwen4_tests 240 env PYTHONPATH="tests:${PYTHONPATH:-}" python3 -m pytest -v -p no:cacheprovider --tb=short \
  -rfEs tests/test_mlx_qwen4.py tests/test_qwen4_engines.py tests/test_qwen4_reference.py tests/test_qwen4_ple_rows.py \
  tests/test_bench_qwen4_seed.py tests/test_mlx_qwen4_ple_rows.py tests/test_mlx_hyper_compute.py \
  tests/test_bench_pooled_random.py
stage qwen4_decode 180 python3 benchmarks/qwen4_decode.py --tokens 16
stage qwen4_seed "$QWEN4_SEED_S" python3 benchmarks/decode.py --shape qwen4-seed $QWEN4_SEED_ARGS
stage hybrid_resident "$HYBRID_S" python3 benchmarks/decode.py --shape qwen3.5-397b $HYBRID_RESIDENT_ARGS
stage hybrid_stream "$HYBRID_S" python3 benchmarks/decode.py --shape qwen3.5-397b $HYBRID_STREAM_ARGS
# DeepSeek-V3: the MLA kernels' GPU tests (and the latent model through the engines), the kernels
# against their bytes at its attention shape, its per-layer shape decoding all-resident and streaming
# (the kernel file's gpu-marked tests only: its others run the C++ emulator, which CI covers)
stage mla_tests "$HYBRID_S" bash -c 'export PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device
  python3 -m pytest -v -p no:randomly -p no:cacheprovider -p mlx_agree --tb=short -rfEs --durations=5 -m gpu \
    tests/test_mlx_mla_kernel.py
  python3 -m pytest -v -p no:randomly -p no:cacheprovider -p mlx_agree --tb=short -rfEs \
    tests/test_mlx_mla.py tests/test_sigmoid_engines.py -k "not emulated"'
stage mla 120 python3 benchmarks/mla.py
stage mla_variants 60 python3 benchmarks/mla.py --variants
stage deepseek_resident "$HYBRID_S" python3 benchmarks/decode.py --shape deepseek-v3 $DEEPSEEK_RESIDENT_ARGS
stage deepseek_stream "$HYBRID_S" python3 benchmarks/decode.py --shape deepseek-v3 $DEEPSEEK_STREAM_ARGS
if command -v ncu >/dev/null; then
  # the expert kernel's 64-token launches (one per block shape), with the sections that say why
  # (occupancy, warp stall reasons, issue slots); then every kernel of one decoded 2-layer token
  # (the prompt's 14 launches skipped)
  # then the native kernel (MLX's affine 4/8-bit and MXFP4 records) and gather_qmm on the same
  # experts, every kernel's GPU time (gather_qmm's kernel names vary: none filtered; the NCU lines
  # of kernels.py --ncu native say which launches are which)
  stage ncu_moe 170 bash -c 'ncu --clock-control none -k regex:strata_moe_slots --launch-skip 3 --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
    python3 benchmarks/kernels.py --ncu moe
  echo "== native (MLX types) vs gather_qmm"
  ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,launch__grid_size,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 benchmarks/kernels.py --ncu native'
  stage ncu 75 ncu --clock-control none -k 'regex:strata_' --launch-skip 14 --metrics \
    gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 benchmarks/kernels.py --ncu decode
  # the DeltaNet step's GPU time (3 launches) and a decoded DeltaNet mixer (GEMV, step, GEMV)
  stage ncu_deltanet 75 ncu --clock-control none -k 'regex:strata_(deltanet_step|dense_gemv)' --metrics \
    gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 benchmarks/deltanet.py --ncu
  # the MLA kernels' GPU time at 512, 2048, 8192 positions (query, attend, output; the NCU lines
  # give each launch's bytes) and a decoded MLA mixer
  stage ncu_mla 75 ncu --clock-control none -k 'regex:strata_(mla_|dense_gemv)' --metrics \
    gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 benchmarks/mla.py --ncu
fi
# the prompt path (issue 19): tok/s at the seed shape against the decode kernels' forward,
# per-layer parts, the grouped GEMMs (first calls JIT-compile MLX's CUDA kernels: reported apart),
# then its GPU tests. Not in the default list: STRATA_STAGES=prompt
stage prompt 300 bash -c 'python3 benchmarks/prompt.py --mlx --lengths 128,512,2048 --repeat 3;
  PYTHONPATH="tests:${PYTHONPATH:-}" python3 -m pytest -q -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs \
  tests/test_mlx_prompt.py tests/test_mlx_q2_mma.py -k "not emulated"'
# issue 19, a prompt layer's launches besides the tile kernel (not in the default list:
# STRATA_STAGES=prompt_rows): the whole 2048-token prompt per kernel-flag variant in one process
# (prompt_probe.py FLAGS), one layer's kernels by ncu (every flag on), the row kernels' GPU tests
stage prompt_rows 170 bash -c 'timeout 58 python3 benchmarks/prompt_probe.py --lengths 2048 --forms q2tiles \
  --repeat 2 --budget-s 50 --variants all,none,-topk,-weights,-sort,-norm,-qkv,-oproj,+qkv1;
  timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum --csv python3 benchmarks/prompt_probe.py --ncu \
  --lengths 2048 --forms q2tiles 2>&1 | python3 benchmarks/ncu_summary.py;
  PYTHONPATH="tests:${PYTHONPATH:-}" timeout 50 python3 -m pytest -q -p no:randomly -p no:cacheprovider -p mlx_agree \
  -rfEs -m gpu tests/test_mlx_pair_sort.py tests/test_mlx_prompt_rows.py'
# issue 19's prompt probe (not in the default list: STRATA_STAGES=prompt_probe): whole prompts per
# grouped form (first calls apart), a synchronised per-layer pass, one layer's steps alone, then
# each kernel's GPU time of one layer under ncu (benchmarks/ncu_summary.py)
stage prompt_probe 150 bash -c 'timeout 95 python3 benchmarks/prompt_probe.py --lengths 512,2048 --repeat 2 --budget-s 88;
  timeout 45 ncu --clock-control none --metrics gpu__time_duration.sum --csv python3 benchmarks/prompt_probe.py --ncu \
  --lengths 2048 --forms q2tiles,padded 2>&1 | python3 benchmarks/ncu_summary.py'
# issue 19's tile-kernel bodies (not in the default list: STRATA_STAGES=q2_tiles_forms): each body of the
# Q2_0 tile kernel (q2_tiles.TileForm) timed and bit-compared on one layer's launches, then ncu's L1
# and tensor-pipe share of each, then whole prompts per body
stage q2_tiles_forms 200 bash -c 'timeout 40 python3 benchmarks/q2_tiles_forms.py;
  timeout 60 ncu --clock-control none -k regex:strata_q2_tiles --metrics gpu__time_duration.sum,\
l1tex__throughput.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active,\
launch__registers_per_thread --csv python3 benchmarks/prompt_probe.py --ncu --lengths 2048 --forms q2tiles --tile-forms best,bregdeep;
  timeout 90 python3 benchmarks/prompt_probe.py --lengths 2048 --forms q2tiles --tile-forms best,bregdeep,breg2,rows --repeat 2 --budget-s 80'
# issue 19 (not in the default list): custom-kernel dispatch factors, compiled decode against the
# context (split attention vs one block per head, graph views), strata vs mlx-lm on one shape
# (mlx-lm's wheel installed for the benchmark only, --no-deps: peers.py loads its model files alone).
# STRATA_STAGES=dispatch,decode_context,peers
stage dispatch 60 python3 benchmarks/dispatch.py
stage decode_context 150 python3 benchmarks/decode_context.py --contexts 8,2048 --forms split,one_block --also 8/no_views
stage peers 240 python3 benchmarks/peers.py
# the issue's targets judged over the hosts' noise (STRATA_STAGES=peers_medians): each side in 5 fresh
# processes, alternating, medians and ranges (mlx-lm's wheel in .whl, on PYTHONPATH)
stage peers_medians 540 python3 benchmarks/peers.py --tokens 16 --processes 5
# issue 19, the decode expert step's forms (not in the default list: STRATA_STAGES=experts19): each
# form's two launches under ncu (GPU time, DRAM bytes, registers, warps active), then decode at
# context 8 with today's defaults (first and last), the step as before and the vector-load forms
stage experts19 120 bash -c 'ncu --clock-control none -k regex:strata_moe --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active --csv python3 benchmarks/kernels.py --ncu experts 2>&1 | python3 benchmarks/_ncu_table.py &&
  python3 benchmarks/decode_context.py --contexts 8 --forms split,before_experts19,vector_loads,split --tokens 32'
# issue 19: the decode attention alone by form and context (wall time of a 48-layer chain), then
# ncu's GPU time of its launches: the split in two launches (attend_split) vs the three before.
# STRATA_STAGES=attend_context
stage attend_context 90 bash -c 'timeout 40 python3 benchmarks/attend_context.py --contexts 8,256,2048 \
  --forms project,split,split_chunks; timeout 45 ncu --clock-control none -k "regex:strata_(attend|merge|dense_gemv)" \
  --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum python3 benchmarks/attend_context.py --ncu \
  --contexts 2048 --forms split,split_chunks 2>&1 | python3 benchmarks/_ncu_table.py'
# issue 19, greedy tokens chosen on the device (STRATA_STAGES=pipelined): generate's loop pipelined
# beside the host loop at contexts 8 and 2048 (decode_context's generate row), then peers' decode rows
stage pipelined 200 bash -c 'timeout 70 python3 benchmarks/decode_context.py --contexts 8 --forms split --also 2048/split \
  --tokens 32; timeout 120 python3 benchmarks/peers.py --rows decode --tokens 16'
# issue 19: first-call JIT costs (decode step, prompts of 128/512/2048/1000, a per-layer breakdown)
# in a first process on an empty MLX PTX cache and in a second one on what the first left there.
# STRATA_STAGES=jit_probe
stage jit_probe 130 env MLX_PTX_CACHE_DIR="$(mktemp -d)" python3 benchmarks/jit_probe.py
# speculative windows vs T = 1 on MLX (resident: compiled decode vs windows; streaming at the
# window's smallest arena and at half the experts), then the speculation tests on the GPU build.
# Not in the default list: STRATA_STAGES=speculative
stage speculative "$SPEC_S" bash -c 'python3 benchmarks/speculative.py --backend mlx --repeat 3 &&
  PYTHONPATH="tests:${PYTHONPATH:-}" python3 -m pytest -q -p no:cacheprovider tests/test_speculative_generate.py'
# issue 19, decode at context 8 in chained launches (STRATA_STAGES=chains): the chains' GPU tests,
# a layer's kernels by ncu in each chain form (the experts' chain among them), the host's share and
# the GPU's drain in one process per form, decode_context alternating
stage chains 420 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 140 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_phases.py tests/test_mlx_attend_project.py \
  tests/test_moe_chain.py;
  timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum --csv python3 benchmarks/kernels.py --ncu chains \
  2>&1 | python3 benchmarks/ncu_summary.py | grep -v "^| [0-9]";
  timeout 110 python3 benchmarks/host_cost.py --layers 48 --tokens 48 --no-env --forms chain_experts,unrouted,unchained;
  timeout 110 python3 benchmarks/decode_context.py --contexts 8 --forms split,chain_experts \
  --also 8/split,8/chain_experts --tokens 64'
# issue 19, decode at context 8 with the chain's QKV GEMV walked KV group by group (STRATA_STAGES=groups):
# its GPU tests, a layer's kernels by ncu in each chain form, the host's share and the GPU's drain,
# decode_context alternating the default and the walk, then peers' decode rows with the walk on
stage groups 540 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 90 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_phases.py;
  timeout 70 ncu --clock-control none --metrics gpu__time_duration.sum --csv python3 benchmarks/kernels.py --ncu chains \
  2>&1 | python3 benchmarks/ncu_summary.py | grep -v "^| [0-9]";
  timeout 100 python3 benchmarks/host_cost.py --layers 48 --tokens 48 --no-env --forms qkv_groups,groups_pf16;
  timeout 110 python3 benchmarks/decode_context.py --contexts 8 --forms split,qkv_groups \
  --also 8/split,8/qkv_groups,8/groups_pf16 --tokens 64;
  timeout 120 python3 -c "import runpy, sys; from strata.mlx_backend.kernels import attend_project as a
a.QKV_BY_GROUP = True; sys.argv = [\"peers.py\", \"--rows\", \"decode\", \"--tokens\", \"16\"]
runpy.run_path(\"benchmarks/peers.py\", run_name=\"__main__\")"'
# issue 19, decode at context 8: a token's GPU time inside MLX's CUDA graphs against its kernels' own
# (STRATA_STAGES=graph_time): ncu by graph and by kernel over the same 8 steps, the default and the
# plain chain, each form's wall time back to back, then every peers.py row
stage graph_time 480 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 60 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_phases.py;
  for f in default plain_chain; do for mode in graph node; do
    timeout 90 ncu --profile-from-start off --graph-profiling $mode --clock-control none --metrics gpu__time_duration.sum \
      --csv python3 benchmarks/graph_time.py --steps 8 --form $f 2>&1 | python3 benchmarks/graph_time.py --sum --steps 8 \
      --label "$f/$mode" | grep -v "^==PROF==\|^==WARNING=="; done;
    timeout 60 python3 benchmarks/graph_time.py --steps 48 --form $f; done;
  timeout 170 python3 benchmarks/peers.py --tokens 16'
# the same by graph for the default and the plain chain alternating, three times each, then by graph
# and by kernel for the forms of 5 and 2 launches a layer (what a launch boundary costs on the GPU)
# (STRATA_STAGES=graph_forms)
stage graph_forms 540 bash -c 'run() { timeout 90 ncu --profile-from-start off --graph-profiling $2 --clock-control none \
    --metrics gpu__time_duration.sum --csv python3 benchmarks/graph_time.py --steps 8 --form $1 2>&1 \
    | python3 benchmarks/graph_time.py --sum --steps 8 --label "$1/$2" | grep -v "^==PROF==\|^==WARNING==\|^JSON {\"bench\": \"graph_time\", \"form"; }
  for i in 1 2 3; do run default graph; run plain_chain graph; done
  for f in unchained chain_experts; do run $f graph; run $f node; done'
# the walk as the default, checked end to end (STRATA_STAGES=walk_check): the GPU tests of the chain,
# the attention launch and the compiled step, decode at contexts 8 and 2048 (and the plain chain at
# 8) in one process, the host's share of a token
stage walk_check 420 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 150 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_phases.py tests/test_mlx_attend_project.py \
  tests/test_mlx_compiled.py;
  timeout 130 python3 benchmarks/decode_context.py --contexts 8,2048 --forms split --also 8/plain_chain,8/split --tokens 32;
  timeout 100 python3 benchmarks/host_cost.py --layers 48 --tokens 48 --no-env --forms plain_chain'
# graph nodes cut from a decoded token, each off until these run: a layer's down step run by the
# next layer's launch (moe_decode.DEFER_DOWN), the top k ranked once as the attention launch's last
# phase (moe_decode.RANK_ONCE), the greedy selection as one launch (greedy.PICK_KERNEL); all three:
# the form all_cuts. Three calls back to back, each stage sized to one call (a cut-off call returns
# no log): STRATA_STAGES=launch_cuts (their GPU tests, which decide whether any may become a
# default, then ncu by graph for the default and all_cuts, alternating), launch_cuts_forms (ncu by
# graph for each cut alone, by kernel for the default and all_cuts), launch_cuts_ncu (each chain
# form's kernels by ncu, the host's share)
graph_time_run() { timeout 55 ncu --profile-from-start off --graph-profiling $2 --clock-control none \
    --metrics gpu__time_duration.sum --csv python3 benchmarks/graph_time.py --steps 8 --form $1 2>&1 \
    | python3 benchmarks/graph_time.py --sum --steps 8 --label "$1/$2" | grep -v "^==PROF==\|^==WARNING==\|^JSON {\"bench\": \"graph_time\", \"form"; }
export -f graph_time_run
stage launch_cuts 420 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 150 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_phases.py tests/test_route_rank.py \
  tests/test_greedy_pick.py tests/test_mlx_greedy.py;
  for i in 1 2; do graph_time_run default graph; graph_time_run all_cuts graph; done'
# the cuts end to end (STRATA_STAGES=launch_cuts_e2e): decode at context 8, the default and all_cuts
# twice each, alternating, in one process (compiled step, generate's pipelined and host loops)
stage launch_cuts_e2e 240 timeout 230 python3 benchmarks/decode_context.py --contexts 8 --forms split,all_cuts \
  --also 8/split,8/all_cuts --tokens 32
stage launch_cuts_forms 420 bash -c 'for f in deferred ranked ranked_deferred pick; do graph_time_run $f graph; done;
  graph_time_run default node; graph_time_run all_cuts node'
stage launch_cuts_ncu 420 bash -c 'timeout 180 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 benchmarks/kernels.py --ncu chains 2>&1 | python3 benchmarks/ncu_summary.py | tail -n 80;
  timeout 150 python3 benchmarks/host_cost.py --layers 48 --tokens 48 --no-env --forms deferred,ranked_deferred,all_cuts'
# where the host's time goes in a decoded token (STRATA_STAGES=host_spy; py-spy's wheel carried in
# .whl and installed beside gguf's): py-spy's native profile of host_cost's back-to-back pushes and of
# generate's own loops at context 8 (decode_context), each summarised by spy_summary.py. py-spy
# stops itself when its child exits (a timeout on py-spy instead loses the profile: nothing written;
# --subprocesses: the child is timeout, python its child),
# at 250 samples a second (at 997 native unwinding fell a minute behind)
stage host_spy 400 bash -c 'SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy);
  $SPY record --subprocesses --native --format raw -r 250 -o "$OUT/host_cost.raw" -- \
    timeout 110 python3 benchmarks/host_cost.py --layers 48 --tokens 1000 --no-env --default-only | tail -n 4;
  python3 benchmarks/spy_summary.py "$OUT/host_cost.raw" --within measure --within async_eval --top 40;
  $SPY record --subprocesses --native --format raw -r 250 -o "$OUT/generate.raw" -- \
    timeout 110 python3 benchmarks/decode_context.py --contexts 8 --forms split --tokens 300 | tail -n 3;
  python3 benchmarks/spy_summary.py "$OUT/generate.raw" --within generate_loops --within PipelinedGreedySteps.advance --top 40'
# a launch's unread outputs folded into one buffer (STRATA_STAGES=folded; folded_outputs.FOLD_OUTPUTS,
# on by default here): its GPU tests and those of the launches it touches, then the host's share
# and decode at context 8 with it off (the form unfolded) and on, alternating in one process each
stage folded 400 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 150 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_folded_outputs.py tests/test_phases.py \
  tests/test_mlx_moe_decode.py tests/test_route_rank.py tests/test_mlx_compiled.py;
  timeout 110 python3 benchmarks/host_cost.py --layers 48 --tokens 64 --no-env --forms unfolded | tail -n 6;
  timeout 120 python3 benchmarks/decode_context.py --contexts 8 --forms split,unfolded --also 8/split,8/unfolded \
    --tokens 32 | grep -v "^JSON"'
# the expert step handing h on in gate/up's folded buffer (STRATA_STAGES=packed; moe_decode.PACK_EXPERT_STEP,
# on since this ran): its GPU tests, then the host's share and decode at context 8 with it off (the form
# unpacked) and on, alternating in one process each
stage packed 420 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 120 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_folded_outputs.py tests/test_mlx_moe_decode.py;
  timeout 100 python3 benchmarks/host_cost.py --layers 48 --tokens 64 --no-env --forms unpacked | tail -n 6;
  timeout 110 python3 benchmarks/decode_context.py --contexts 8 --forms unpacked,split --also 8/unpacked,8/split \
    --tokens 32 | grep -v "^JSON"'
# past SPLIT_FROM the QKV GEMV, the split attention, its merge and the router as one launch
# (STRATA_STAGES=split_chain; attend_split.CHAIN_SPLIT, then off: no gain measured end to end; on since the
# spread sum, and this stage's forms are then the same): its GPU tests
# with the packed step's, then decode at 8 and 2048 without it and with it (the form split_chain),
# alternating in one process, then ncu by graph and by kernel over 8 steps at 2048, each form
stage split_chain 540 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 120 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_mlx_attend_split.py tests/test_folded_outputs.py;
  timeout 130 python3 benchmarks/decode_context.py --contexts 8,2048 --forms split,split_chain \
    --also 2048/split,2048/split_chain,8/split --tokens 32 | grep -v "^JSON";
  for f in default split_chain; do for mode in graph node; do
    timeout 70 ncu --profile-from-start off --graph-profiling $mode --clock-control none --metrics gpu__time_duration.sum \
      --csv python3 benchmarks/graph_time.py --steps 8 --context 2048 --form $f 2>&1 \
      | python3 benchmarks/graph_time.py --sum --steps 8 --label "2048/$f/$mode" | grep -v "^==PROF==\|^==WARNING=="; done; done'
# where a chained launch's time goes (STRATA_STAGES=timeline): the chain GPU tests, then each block's
# ticket, wait met and end by phase (phases.stamping) over 12 layers' launches back to back, at
# context 8 and (the split chain) 2048
stage timeline 240 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 100 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_phases.py;
  timeout 120 python3 benchmarks/chain_timeline.py --contexts 8,2048 --forms default,split_chain --layers 12'
# ... with thread 0's cycles at places inside the walk, the attention and the split attention
# (STRATA_STAGES=marks: chain_timeline.py --marks)
stage marks 150 timeout 140 python3 benchmarks/chain_timeline.py --contexts 8,2048 --forms default,split_chain \
  --layers 12 --marks
# whole decoded layers (STRATA_STAGES=layer_timeline): the chain and the expert step's two launches
# each stamped, with marks, and the gaps between launches, at 8 and 2048 (written when the default past
# SPLIT_FROM was the six launches, which have no chain: the split chain's form there; both the same now)
stage layer_timeline 200 timeout 190 python3 benchmarks/chain_timeline.py --contexts 8,2048 \
  --forms default,split_chain --layers 12 --layer --marks
# the split attention's step (STRATA_STAGES=split_steps; the marks put its time in
# its cached-rows loop): 5 rows a warp step (a 33-position split in one step: POSITIONS_PER_STEP) and a
# step's scores summed at once (SPREAD), each off when this ran (SPREAD on since): the split attention's GPU tests (the
# spread sum bit for bit), the split chain's timeline with marks in each form, then decode at 8 and
# 2048 in the forms alternating in one process
stage split_steps 560 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 120 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_mlx_attend_split.py;
  timeout 120 python3 benchmarks/chain_timeline.py --contexts 2048 \
    --forms split_chain,split_chain_pb5,split_chain_spread,split_chain_pb5_spread,split_chain --layers 12 --marks \
    | grep -v "^JSON";
  timeout 250 python3 benchmarks/decode_context.py --contexts 8,2048 \
    --forms split,split_pb5,split_spread,split_chain,split_chain_pb5_spread \
    --also 2048/split,2048/split_pb5,2048/split_spread,2048/split_chain,2048/split_chain_pb5_spread --tokens 32 \
    | grep -v "^JSON"'
# the split attention's steps by graph (STRATA_STAGES=spread_graph): ncu's GPU time a token inside
# MLX's graphs at 2048 for the six-launch split and the split chain, each with and without the
# spread sum and 5 rows a step, and the default at 8; then each form's wall time back to back
stage spread_graph 560 bash -c 'run() { timeout 60 ncu --profile-from-start off --graph-profiling graph --clock-control none \
    --metrics gpu__time_duration.sum --csv python3 benchmarks/graph_time.py --steps 8 --form $1 --context $2 2>&1 \
    | python3 benchmarks/graph_time.py --sum --steps 8 --label "$1@$2" | grep -v "^==PROF==\|^==WARNING=="; }
  run default 8; for f in split split_spread split_pb5_spread split_chain split_chain_spread split_chain_pb5_spread; do run $f 2048; done
  for f in split_pb5_spread split_chain_pb5_spread split_chain_spread; do timeout 50 python3 benchmarks/graph_time.py --steps 48 --form $f --context 2048; done'
# the split chain with the spread sum as the defaults, checked (STRATA_STAGES=split_defaults): the GPU
# tests of the split attention, the chains, the float16 cache and the compiled step (the speed:
# spread_graph's ncu by graph, and peers_medians)
stage split_defaults 220 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 210 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_mlx_attend_split.py tests/test_phases.py \
  tests/test_mlx_kv_f16.py tests/test_mlx_compiled.py'
# where the gate/up launch's ranking goes (STRATA_STAGES=rank_marks; the layer's timeline had it at
# ~10.8 kcycles before a block's loads): whole layers at 8 with the ranking's marks (z staged, the
# warps' sorts, the count), against the top k ranked once in the chain and no ranking at all
stage rank_marks 120 timeout 110 python3 benchmarks/chain_timeline.py --contexts 8 --forms default,unranked,ranked,default \
  --layers 12 --layer --marks
# the ranking's compares without short circuits (STRATA_STAGES=rank_branchless; decode_routing.py says
# why): the GPU tests of the expert step and its rankings, whole layers at 8 with the ranking's
# marks, then decode at 8 back to back
stage rank_branchless 300 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 130 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_mlx_moe_decode.py tests/test_route_rank.py \
  tests/test_moe_chain.py;
  timeout 90 python3 benchmarks/chain_timeline.py --contexts 8 --forms default,default --layers 12 --layer --marks \
    | grep -v "^JSON" | grep -A3 "moe_gateup:\|outputs bit";
  timeout 60 python3 benchmarks/graph_time.py --steps 48'
# CUDA sources handed to MLX as includes of files named by their content (STRATA_STAGES=included;
# included_source.py says why): the GPU tests of the two forms and of the decode launches, then the
# host's share, decode at 8 and generate's loop with them inline (the form inline_sources) and
# included, alternating in one process each, then decode at 8 back to back in each form
stage included 470 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 150 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_included_source.py tests/test_folded_outputs.py \
  tests/test_mlx_moe_decode.py tests/test_mlx_compiled.py;
  timeout 100 python3 benchmarks/host_cost.py --layers 48 --tokens 64 --no-env --forms inline_sources | tail -n 6;
  timeout 110 python3 benchmarks/decode_context.py --contexts 8 --forms split,inline_sources --also 8/split,8/inline_sources \
    --tokens 32 | grep -v "^JSON";
  for f in inline_sources default; do timeout 45 python3 benchmarks/graph_time.py --steps 48 --form $f | tail -n 2; done'
# the kernels' constants as leaves (STRATA_STAGES=leaf_constants; launch.LEAF_CONSTANTS says why): the
# GPU tests of the compiled step and the expert step, then the host's share, decode at 8 and
# generate's loop with them made lazily (the form lazy_constants) and as leaves, alternating in one
# process each, then decode at 8 back to back in each form
stage leaf_constants 470 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 120 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_mlx_compiled.py tests/test_mlx_moe_decode.py \
  tests/test_mlx_greedy.py;
  timeout 110 python3 benchmarks/host_cost.py --layers 48 --tokens 64 --no-env --forms lazy_constants | tail -n 6;
  timeout 120 python3 benchmarks/decode_context.py --contexts 8 --forms split,lazy_constants --also 8/split,8/lazy_constants \
    --tokens 32 | grep -v "^JSON";
  for f in lazy_constants default; do timeout 45 python3 benchmarks/graph_time.py --steps 48 --form $f | tail -n 2; done'
# the attention launch handing h and z on in its folded buffer (STRATA_STAGES=handed_on;
# moe_decode.HAND_ON says why): the GPU tests of the fold, the packing and the hand-on, then the
# host's share, decode at 8 and generate's loop with them as arrays (the form unhanded) and handed
# on, alternating in one process each, then decode at 8 back to back in each form
stage handed_on 400 bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device timeout 100 python3 -m pytest -q \
  -p no:randomly -p no:cacheprovider -p mlx_agree -rfEs -m gpu tests/test_folded_outputs.py tests/test_mlx_compiled.py;
  timeout 90 python3 benchmarks/host_cost.py --layers 48 --tokens 64 --no-env --forms unhanded | tail -n 6;
  timeout 110 python3 benchmarks/decode_context.py --contexts 8 --forms split,unhanded --also 8/split,8/unhanded \
    --tokens 32 | grep -v "^JSON";
  for f in unhanded default; do timeout 45 python3 benchmarks/graph_time.py --steps 48 --form $f | tail -n 2; done'
# the split chain at 2048 with 32 splits (STRATA_STAGES=split32): its first two phases then take 224 of
# the 264 block slots (2 an SM), not 352, so the merge blocks start, and load W_o, during the
# attention; its timeline against 64 splits twice, decode at 2048 in the three forms alternating,
# then where the split attention's warps stall (ncu's source counters, one launch at 2048)
stage split32 560 bash -c 'timeout 80 python3 benchmarks/chain_timeline.py --contexts 2048 \
    --forms split_chain,split_chain_ns32,split_chain,split_chain_ns32 --layers 12 | grep -v "^JSON";
  timeout 170 python3 benchmarks/decode_context.py --contexts 8,2048 --forms split,split_chain,split_chain_ns32 \
    --also 2048/split,2048/split_chain,2048/split_chain_ns32 --tokens 32 | grep -v "^JSON";
  timeout 90 ncu --clock-control none -k regex:strata_attend_split --launch-skip 2 --launch-count 1 \
    --section WarpStateStats --section SourceCounters \
    python3 benchmarks/attend_context.py --ncu --contexts 2048 --forms split 2>&1 | grep -v "^==PROF==" | tail -n 70'
# issue 19: does a matrix asked into L2 make the decode GEMV over it faster (STRATA_STAGES=l2_probe):
# the QKV-shaped GEMV cold, warm, after a bulk / line prefetch and after a demand read, by ncu with
# no cache flush between kernels
stage l2_probe 120 bash -c 'ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv \
  python3 benchmarks/l2_probe.py 2>&1 | python3 benchmarks/ncu_summary.py | grep -v "binary_vs\|copy_s"'
stage doctor "$DOCTOR_S" python3 benchmarks/doctor_validate.py --backend mlx --quick --remeasure \
  --models small,demo --arenas 0.15,0.3,0.6 --budget-s $(( DOCTOR_S - 30 )) --case-timeout 30 \
  --cache-dir /tmp/strata-doctor-cache
stage dense "$DENSE_S" bash -c 'PYTHONPATH="tests:${PYTHONPATH:-}" HYPOTHESIS_PROFILE=device python3 -m pytest -v \
  -p no:randomly -p no:cacheprovider -p mlx_agree --tb=short -rfEs tests/test_mlx_dense.py -k "not emulated";
  python3 benchmarks/dense_stored.py --backend mlx --shape demo --hidden 1024 --layers 8 --tokens 32 --case-timeout 40'
echo "== done after $(( $(date +%s) - START ))s" | tee -a "$OUT/summary.log"
