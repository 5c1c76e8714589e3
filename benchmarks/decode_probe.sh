#!/usr/bin/env bash
# Issue 19's decode probe on a GPU machine with MLX's CUDA build (PROBE_S, default 85 s): the custom-kernel
# dispatch factors (benchmarks/dispatch.py), then compiled decode at contexts 8 and 2048 with the
# split attention, with one block per head, and without the graph views (decode_context.py), then
# strata vs mlx-lm (peers.py) when mlx-lm is importable and time is left.
# Logs land in $OUT (else ./out). PROBE_S: the whole run's seconds (default 85; the first compiled step
# JIT-compiles every kernel, ~28 s on the H200).    usage: [PROBE_S=240] bash benchmarks/decode_probe.sh
set -uo pipefail
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, "cuda", mx.cuda.is_available())'; } > "$OUT/env.log" 2>&1
timeout -s INT -k 5 28 python3 benchmarks/dispatch.py --quick > "$OUT/dispatch.log" 2>&1
echo "dispatch rc=$? after $(( $(date +%s) - START ))s" >> "$OUT/env.log"
left=$(( ${PROBE_S:-85} - ($(date +%s) - START) ))
timeout -s INT -k 3 "$left" python3 benchmarks/decode_context.py --contexts 8,2048 --forms split --tokens 10 \
  --also 2048/one_block,8/no_views,2048/split_ch64,2048/split_ch32,2048/kv16 > "$OUT/decode_context.log" 2>&1
echo "decode_context rc=$? after $(( $(date +%s) - START ))s" >> "$OUT/env.log"
# strata vs mlx-lm where mlx-lm is installed and the budget leaves room (PROBE_S >= ~300)
left=$(( ${PROBE_S:-85} - ($(date +%s) - START) ))
if (( left > 60 )) && python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("mlx_lm") is None)'; then
  timeout -s INT -k 3 "$left" python3 benchmarks/peers.py > "$OUT/peers.log" 2>&1
  echo "peers rc=$? after $(( $(date +%s) - START ))s" >> "$OUT/env.log"
fi
# context 8 under MLX's other launch modes (read when MLX starts: a process each): CUDA graphs off,
# and one graph per token (400 nodes)
for e in MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=400; do
  left=$(( ${PROBE_S:-85} - ($(date +%s) - START) ))
  (( left > 50 )) || break
  env "$e" timeout -s INT -k 3 "$left" python3 benchmarks/decode_context.py --contexts 8 --forms split --tokens 10 \
    > "$OUT/decode_context_${e%%=*}.log" 2>&1
  echo "decode_context $e rc=$? after $(( $(date +%s) - START ))s" >> "$OUT/env.log"
done
