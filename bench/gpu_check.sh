#!/usr/bin/env bash
# The prepared GPU check: CUDA tests, linkbench and the real-scale benchmark, under 8 minutes
# (phase limits 100 + 30 + 310 s, plus at most 10 s each past a limit: 470 s). gpu_bench includes the
# decode_host phase (bench/gpu_decode.py): at K = 40 and 92 (and resident), batch 1 and 4,
# decode tok/s eager and with every decode step replayed from a CUDA graph (generation.graphs,
# beside eager in the same row, both under the random router), host syncs per decode step
# (set_sync_debug_mode), and host time per MoE layer-step. The CUDA tests include
# tests/test_cuda_graphs.py (captured == eager logits, no sync in replay, repage invalidates).
#
#   bash bench/gpu_check.sh --prepare           here, before the device run: copy the real
#                                               routing traces into .gpu_traces/ (git-ignored)
#   OUT=/dir bash bench/gpu_check.sh            on the GPU machine; the run tool must carry
#                                               .gpu_traces (carry: [".gpu_traces"])
#   OUT=/dir bash bench/gpu_check.sh --dry-run  on CPU, same phases at tiny sizes (in the suite)
#
# PYTHON (default python) names the interpreter. Exit status 1 if any phase failed.
# Installs nothing (the GPU machine has python 3.12, torch 2.11, transformers 5.17, no FastAPI):
# the package runs from this source tree. Each phase writes $OUT/<phase>.txt as it runs
# (PYTHONUNBUFFERED) and appends its exit code and seconds to $OUT/phases.txt; a phase past its
# limit gets SIGINT (timeout -s INT), then SIGKILL 10 s later, and the next phase still runs.
# gpu_bench rewrites $OUT/gpu_bench.json after each of its own phases.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
STATUS=0
TRACES=${TRACES:-../shared/data/traces}
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .gpu_traces
  cp "$TRACES"/*.jsonl .gpu_traces/ || { echo "no traces in $TRACES" >&2; exit 1; }
  grep -qx '.gpu_traces/' .git/info/exclude 2>/dev/null || grep -qx '.gpu_traces/' .gitignore \
    || echo "warning: .gpu_traces/ is not ignored" >&2
  ls -l .gpu_traces
  exit 0
fi
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
: > "$OUT/phases.txt"

phase() {  # phase NAME LIMIT_S COMMAND...: run, keep its output, record exit code and time
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit} s)"
  timeout -s INT -k 10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  [ "$rc" = 0 ] || STATUS=1
  echo "$name exit $rc, $((SECONDS - start)) s" | tee -a "$OUT/phases.txt"
  tail -n 4 "$OUT/$name.txt"
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
  ls .gpu_traces 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "$DRY" = 1 ]; then
  phase cuda_tests 60 "$PY" -m pytest -q -m cuda tests/test_cuda.py tests/test_cuda_graphs.py tests/test_formats.py -p no:cacheprovider
  phase linkbench 30 "$PY" -m pagedexperts.cli linkbench
  phase gpu_bench 180 "$PY" bench/gpu_bench.py --dry-run --out "$OUT" --traces tests/data/synthetic_trace.npz
else
  [ -n "$(ls .gpu_traces/*.jsonl 2>/dev/null)" ] || echo "WARNING: no .gpu_traces (run --prepare here and carry it): the modelled table will be empty"
  phase cuda_tests 100 "$PY" -m pytest -q -m cuda tests/test_cuda.py tests/test_cuda_graphs.py tests/test_formats.py -p no:cacheprovider
  phase linkbench 30 "$PY" -m pagedexperts.cli linkbench
  phase gpu_bench 310 "$PY" bench/gpu_bench.py --out "$OUT"
fi
echo
cat "$OUT/summary.md" 2>/dev/null || echo "no summary (see $OUT/gpu_bench.txt and $OUT/gpu_bench.json)"
exit $STATUS
