#!/usr/bin/env bash
# Issue 19's decode probe on a GPU machine with MLX's CUDA build (<= 90 s): the custom-kernel
# dispatch factors (benchmarks/dispatch.py), then compiled decode at contexts 8 and 2048 with the
# split attention, with one block per head, and without the graph views (decode_context.py).
# Logs land in $OUT (else ./out).    usage: bash benchmarks/decode_probe.sh
set -uo pipefail
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, "cuda", mx.cuda.is_available())'; } > "$OUT/env.log" 2>&1
timeout -s INT -k 5 28 python3 benchmarks/dispatch.py --quick > "$OUT/dispatch.log" 2>&1
echo "dispatch rc=$? after $(( $(date +%s) - START ))s" >> "$OUT/env.log"
left=$(( 85 - ($(date +%s) - START) ))
timeout -s INT -k 3 "$left" python3 benchmarks/decode_context.py --contexts 8,2048 --forms split --tokens 10 \
  --also 2048/one_block,8/no_views,2048/split_ch64,2048/split_ch32,2048/kv16 > "$OUT/decode_context.log" 2>&1
echo "decode_context rc=$? after $(( $(date +%s) - START ))s" >> "$OUT/env.log"
