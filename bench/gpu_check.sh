#!/usr/bin/env bash
# One GPU, one go, in under 8 minutes: the CUDA tests, bench/gpu.py's rows and bench/gpu_largest.py's search.
#
#   bash bench/gpu_check.sh [OUT_DIR]       # default bench/results; `make bench-gpu` runs it
#
# On a lent GPU machine (Python 3.12 with torch, no network) first make the wheels it lacks here with
# `bash tools/gpu_wheels.sh` and carry `.whl`: this script installs them under /tmp/site when `.whl/` exists.
#
# Stages, each run even after one failed (the script fails if any did), each `timeout` 15 s above its own limit:
# 1. tests/test_cuda.py, stopped at 150 s; its output in OUT_DIR/test_cuda.log (each figure as it is measured).
# 2. bench/gpu.py's rows, the offload_param ones first, for what the tests left of BENCH_GPU_TESTS_ROWS_S (240):
#    a row not finished then is recorded as not run (each takes ~15-60 s on an H100, so not all ten fit;
#    `python bench/gpu.py` runs them all). Into OUT_DIR/gpu_check.json (not gpu.json, whose table on the
#    benchmarks page keeps the full set), its output in OUT_DIR/gpu.log.
# 3. bench/gpu_largest.py --budget-s BENCH_GPU_LARGEST_S (210), into OUT_DIR/gpu_largest.json (each try written
#    as it ends) and OUT_DIR/gpu_largest.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
mkdir -p "$out"
if [ -x .venv/bin/python ]; then py=${GPU_PY:-.venv/bin/python}; else py=${GPU_PY:-python3}; fi
if [ -d .whl ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
rows=${BENCH_GPU_ROWS:-zero3_offload_param,zero3_offload_all,zero3_offload,zero3_bf16,torch,zero2_offload,zero2_bf16,zero2_fp16,zero1_bf16,zero0_bf16}
rows_s=${BENCH_GPU_TESTS_ROWS_S:-240}
largest_s=${BENCH_GPU_LARGEST_S:-210}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
grep -E 'MemTotal|MemAvailable' /proc/meminfo || true  # the host memory bench/gpu_largest.py plans with
"$py" -c "import torch, zeroshard; print('torch', torch.__version__, 'zeroshard', zeroshard.__version__)" || exit 1
rc=0
start=$(date +%s)
timeout -k 5 150 "$py" -m pytest -s -q -p no:cacheprovider --durations=0 tests/test_cuda.py 2>&1 |
    tee "$out/test_cuda.log" || rc=1
left=$((rows_s - $(date +%s) + start))
timeout -k 5 $((left + 15)) "$py" bench/gpu.py --rows "$rows" --time-limit-s "$left" --out "$out/gpu_check.json" 2>&1 |
    tee "$out/gpu.log" || rc=1
timeout -k 5 $((largest_s + 15)) "$py" bench/gpu_largest.py --budget-s "$largest_s" --out "$out/gpu_largest.json" 2>&1 |
    tee "$out/gpu_largest.log" || rc=1
exit $rc
