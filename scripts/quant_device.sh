#!/usr/bin/env bash
# The quantized forms' whole GPU check in one call of under 6 minutes (for the lent H200):
#   bash scripts/quant_device.sh OUTDIR
# run from the repository root with .flashinfer carried (benchmarks/flashinfer_headers.py
# writes it: FlashInfer's headers, under 200 KB). In order, each under its own time limit,
# each writing its log to OUTDIR as it goes, each step going on when one before failed:
#   0. (in the background, from the start) nvcc builds benchmarks/flashinfer_quant.cu
#   1. GPU tests (pytest -n 8): the quantized forms (with their CPU tests: another torch here),
#      then tests/test_gpu_grid.py with the time left but 85 s, while
#   2. compute-sanitizer memcheck and racecheck of tests/sanitize_quant_grid.py run beside them,
#      and so does a compile-only pass of the benchmark (torch.compile and NVRTC caches)
#   3. benchmarks/quant.py (ours, FlashInfer, torch.compile, copy floor) with the time left
# then a short summary. TOTAL_S (default 345) bounds the whole; QUANT_TESTS_S, SANITIZE_S and
# WARM_S the steps.
set -uo pipefail
out=${1:?usage: bash scripts/quant_device.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TOTAL_S=${TOTAL_S:-345}
nvidia-smi --query-gpu=name,driver_version,compute_cap,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"

# -- 0. FlashInfer's kernels, built while the tests run
NVCC=$(command -v nvcc || true)
for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
  [ -z "$NVCC" ] && [ -x "$c" ] && NVCC=$c
done
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
fi_lib=""
if [ -n "$NVCC" ] && [ -f .flashinfer/include/flashinfer/norm_rms.cuh ]; then
  fi_lib=$PWD/.flashinfer/libfiquant.so
  ( timeout 240 "$NVCC" -O3 -std=c++17 -arch="sm_${cc:-90}" -shared -Xcompiler -fPIC -I.flashinfer/include \
      benchmarks/flashinfer_quant.cu -o "$fi_lib" ) >"$out/flashinfer_build.log" 2>&1 &
  build_pid=$!
  echo "== 0. building FlashInfer $(cat .flashinfer/include/VERSION 2>/dev/null) with $NVCC (sm_${cc:-90}) in the background"
else
  build_pid=""
  echo "== 0. no FlashInfer peer: nvcc=${NVCC:-not found}, headers $( [ -d .flashinfer ] && echo present || echo 'missing (carry .flashinfer)')"
fi

# The sanitizer (one process, mostly CPU-side instrumentation) and a compile-only pass of the
# benchmark (its kernels into torch.compile's and CuPy's on-disk caches, so that step 3 only
# times) run beside the tests.
echo "== 2. sanitizer and the benchmark's compiles, in the background ($SECONDS s)"
( SANITIZE_GRIDS=sanitize_quant_grid SANITIZE_TOOLS="memcheck racecheck" SANITIZE_LOG_DIR="$out/sanitize" \
    timeout -k 10 "${SANITIZE_S:-200}" bash scripts/sanitize.sh ) >"$out/sanitize.log" 2>&1 &
sanitize_pid=$!
timeout -k 10 "${WARM_S:-200}" python3 benchmarks/quant.py --out "$out" --warm-only >"$out/quant_warm.log" 2>&1 &
warm_pid=$!

echo "== 1. quant tests ($SECONDS s)"
timeout -k 10 "${QUANT_TESTS_S:-150}" python3 -m pytest -v -n 8 -rs -p no:cacheprovider --durations=10 \
  tests/test_gpu_quant.py tests/test_torch_ops_quant.py tests/test_reference_quant.py \
  tests/test_bad_inputs_quant.py tests/test_plan_quant.py tests/test_kernel_abi.py 2>&1 \
  | tee "$out/tests.log" | grep -v "PASSED" | tail -40
left=$(( TOTAL_S - 85 - SECONDS ))     # what the grid tests may take, keeping 85 s for the benchmark
echo "== 1b. tests/test_gpu_grid.py ($SECONDS s; limit ${left} s)"
if [ "$left" -gt 20 ]; then
  timeout -k 10 "$left" python3 -m pytest -q -n 8 -rs -p no:cacheprovider tests/test_gpu_grid.py 2>&1 \
    | tee "$out/grid_tests.log" | grep -v "PASSED" | tail -15
else
  echo "no time left for the grid tests" | tee "$out/grid_tests.log"
fi
wait "$sanitize_pid"
echo "== 2. sanitizer done ($SECONDS s)"
tail -12 "$out/sanitize.log"
wait "$warm_pid"
echo "benchmark compiles: $(tail -1 "$out/quant_warm.log")"

if [ -n "$build_pid" ]; then
  wait "$build_pid"
  [ -f "$fi_lib" ] || { echo "FlashInfer build failed (tail of $out/flashinfer_build.log):"; tail -5 "$out/flashinfer_build.log"; fi_lib=""; }
fi
left=$(( TOTAL_S - SECONDS - 15 ))
echo "== 3. benchmark ($SECONDS s; budget ${left} s)"
if [ "$left" -gt 20 ]; then
  timeout -s INT -k 10 $(( left + 5 )) python3 benchmarks/quant.py --out "$out" --budget-s $(( left - 15 )) \
    --repeats 5 --target-us 1000 ${fi_lib:+--flashinfer "$fi_lib"} 2>&1 | tee "$out/quant_bench.log" | tail -45
else
  echo "no time left for the benchmark"
fi

echo "== summary ($SECONDS s)"
for log in tests grid_tests; do
  echo "$log: $(grep -E '^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$out/$log.log" | tail -1)"
  grep -E "^FAILED|^ERROR" "$out/$log.log" | head -10
done
for f in "$out"/sanitize/sanitize_quant_grid.*.log; do
  [ -f "$f" ] || continue
  echo "sanitizer $(basename "$f" .log): $(grep -E 'ERROR SUMMARY' "$f" | tail -1 | sed -E 's/^=+ *//'); \
$(grep -E '^sanitize_quant_grid:' "$f" | tail -1)"
done
echo "benchmark: $(grep -c . "$out/quant.csv" 2>/dev/null || echo 0) lines in $out/quant.csv"
