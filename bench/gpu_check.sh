#!/usr/bin/env bash
# The prepared GPU check: CUDA tests, linkbench, and the real-scale benchmark, in < 5 minutes.
# Installs nothing (the GPU machine has python 3.12, torch 2.11, transformers 5.17, no
# FastAPI): the package runs from this source tree. Writes everything under $OUT and prints a
# short table last. Usage: OUT=/some/dir bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== CUDA tests"
timeout 100 python -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider > "$OUT/cuda_tests.txt" 2>&1
echo "pytest exit $?" >> "$OUT/cuda_tests.txt"
tail -3 "$OUT/cuda_tests.txt"

echo "== linkbench"
timeout 45 python -m pagedexperts.cli linkbench > "$OUT/linkbench.txt" 2>&1
cat "$OUT/linkbench.txt"

echo "== real-scale benchmark"
timeout 150 python bench/gpu_bench.py --out "$OUT" > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench exit $?" >> "$OUT/gpu_bench.log"
tail -2 "$OUT/gpu_bench.log"
echo
cat "$OUT/summary.md" 2>/dev/null || echo "no summary (see $OUT/gpu_bench.log)"
