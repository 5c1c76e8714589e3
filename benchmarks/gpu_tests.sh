#!/usr/bin/env bash
# benchmarks/gpu_tests.sh [LIMIT]: every test marked gpu, in 4 pytest processes at once, each under
# LIMIT seconds (the first call of each kernel specialisation JIT-compiles on the CPU: processes in
# parallel use the GPU machine's cores; one process took over 240 s, four took 161 s on the H200).
# The files come from pytest's own collection, dealt to the groups largest first; logs in $L
# (default /tmp/strata-gpu-tests). Run from the repository root after the MLX CUDA install.
set -u
LIMIT=${1:-300}; L=${L:-/tmp/strata-gpu-tests}; mkdir -p "$L"
export PYTHONPATH=tests:$PWD HYPOTHESIS_PROFILE=device
python3 -m pytest -q -p no:randomly -p no:cacheprovider --collect-only -m gpu tests/ --ignore=tests/serve \
  2>/dev/null | grep "::" | cut -d: -f1 | sort | uniq -c | sort -rn | awk '{print $2}' > "$L/files"
echo "gpu test files: $(wc -l < "$L/files")"
for i in 0 1 2 3; do awk -v i=$i 'NR % 4 == i' "$L/files" | tr '\n' ' ' > "$L/g$i"; done
for i in 0 1 2 3; do
  ( timeout -s INT -k 10 "$LIMIT" python3 -m pytest -q -p no:randomly -p no:cacheprovider -rfEs --tb=short \
      --durations=6 -m gpu $(cat "$L/g$i") > "$L/group$i.log" 2>&1; echo "group$i rc=$? $(cat "$L/g$i")" >> "$L/groups.rc" ) &
done
wait
cat "$L/groups.rc"; for i in 0 1 2 3; do echo "== group$i"; grep -E "passed|failed|skipped|error|FAILED|ERROR" "$L/group$i.log" | tail -6; done
