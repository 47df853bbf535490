#!/usr/bin/env bash
# The prepared GPU check, in order of value, within 6 minutes: phase limits 140 + 70 + 45 + 45 + 30 + 30 =
# 360 s (each phase gets SIGINT at its limit, SIGKILL 5 s later; the env probe takes a few s):
#   cuda_tests       the CUDA tests (tests/paging/test_cuda.py host- and device-planned exactness, no sync,
#                    the page-lock fallback; tests/generation/test_cuda_graphs.py captured == eager, no sync in
#                    replay, the grouped_mm capability rule, one stream for warm-up and capture, the
#                    server's KV-row decode steps captured per bucket == eager, no sync in replay;
#                    tests/formats/test_fp8_mxfp4.py's CUDA cases; tests/paging/test_cuda_beyond_k.py: in-place reads of
#                    the mapped host store == waves == all resident, captured == eager at batch 8)
#   captured_decode  gpu_bench --phases captured: decode tok/s with every step replayed from a CUDA
#                    graph, paged at K = 40 and 92 and resident, batch 1 and 4, beside eager
#                    generate, on a 4-layer Qwen3-30B-A3B-shaped model with random bf16 weights
#   fused            gpu_fused: the same 4-layer shapes in GPTQ int4 (K = 92) and block FP8 (K = 40),
#                    decode tok/s at batch 1 and 4, --experts-implementation fused (CUDA graphs) vs
#                    grouped_mm over the dequantizing path (eager: its packed slots cannot be captured)
#   beyond_k         gpu_beyond_k: the same shapes (2 layers), int4 K = 92 and FP8 K = 40, fused,
#                    --beyond-k waves vs in-place at batch 1, 4, 8, 16, 32, decode tok/s captured
#                    (CUDA graphs, every batch) and eager, with waves/step and rows read in place per
#                    token (sets the --beyond-k default: waves until this has run)
#   micro            gpu_micro (about 20 s): decide us at K = 40 and 92, page-in at count 0, 1, 8
#                    (GB/s of the GPU's reads of the mapped host store), one quantized layer-step
#   rest             gpu_bench --phases rest: modes (resident, offload, paged), eager decode with
#                    syncs and host time per layer-step, miss costs on the model's decide path,
#                    the layer split and the modelled 48-layer tok/s
# Every benchmark row records the decide path that ran (rt.decide) and the torch and triton versions.
#
#   bash bench/gpu_check.sh --prepare           here, before the device run: copy the real
#                                               routing traces into .gpu_traces/ (git-ignored)
#   OUT=/dir bash bench/gpu_check.sh            on the GPU machine; the run tool must carry
#                                               .gpu_traces (carry: [".gpu_traces"])
#   OUT=/dir bash bench/gpu_check.sh --dry-run  anywhere: print the phases, their limits and
#                                               commands; runs nothing (tests/project/test_gpu_guards.py)
#
# PYTHON (default python3) names the interpreter. Exit status 1 if any phase failed. Installs
# nothing (the GPU image has python 3.12, torch 2.11, triton 3.6, transformers 5.17, no FastAPI):
# the package runs from this source tree. Each phase writes $OUT/<phase>.txt as it runs
# (PYTHONUNBUFFERED) and appends its exit code and seconds to $OUT/phases.txt; the benchmarks
# rewrite their JSON after each of their own parts, so a phase cut at its limit keeps what finished.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
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
  if [ "$DRY" = 1 ]; then
    echo "   $*"
    return
  fi
  timeout -s INT -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  [ "$rc" = 0 ] || STATUS=1
  echo "$name exit $rc, $((SECONDS - start)) s" | tee -a "$OUT/phases.txt"
  tail -n 4 "$OUT/$name.txt"
}

if [ "$DRY" = 0 ]; then
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>&1
    "$PY" -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
    "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -n 1
    ls .gpu_traces 2>&1
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  [ -n "$(ls .gpu_traces/*.jsonl 2>/dev/null)" ] || echo "WARNING: no .gpu_traces (run --prepare here and carry it): the modelled table will be empty"
fi

phase cuda_tests 140 "$PY" -m pytest -q -m cuda tests/paging/test_cuda.py tests/generation/test_cuda_graphs.py \
  tests/paging/test_cuda_beyond_k.py tests/formats/test_fp8_mxfp4.py -p no:cacheprovider
phase captured_decode 70 "$PY" bench/gpu_bench.py --phases captured --out "$OUT"
phase fused 45 "$PY" bench/gpu_fused.py --out "$OUT"
phase beyond_k 45 "$PY" bench/gpu_beyond_k.py --out "$OUT"
phase micro 30 "$PY" bench/gpu_micro.py --out "$OUT"
phase rest 30 "$PY" bench/gpu_bench.py --phases rest --out "$OUT"

if [ "$DRY" = 1 ]; then
  echo "dry run: nothing ran"
  exit 0
fi
echo
for f in gpu_bench_captured.md gpu_fused.md gpu_beyond_k.md gpu_micro.md gpu_bench_rest.md; do
  cat "$OUT/$f" 2>/dev/null || echo "no $f (see $OUT/*.txt and the JSON files)"
done
exit $STATUS
