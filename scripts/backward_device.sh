#!/usr/bin/env bash
# The backward's whole GPU check in one call of under 10 minutes (for the lent H200):
#   bash scripts/backward_device.sh OUTDIR
# with run(carry=[".whl"]) so that the liger-kernel wheel in .whl/ comes along. In order,
# each under its own time limit, each writing its log to OUTDIR as it goes:
#   1. GPU tests of the backward and of the torch integration (pytest -n 8)   ~1.5-3 min (limit 180 s)
#   2. compute-sanitizer memcheck / racecheck / initcheck of the backward grid  ~1-3 min (limit 180 s)
#   3. benchmarks/train_llama.py (HF Llama 4 x 1024, 100 AdamW steps, twice)   ~0.5-1 min (limit 100 s)
#   4. python -m cupy_rmsnorm.bench backward with the time left of TOTAL_S=570 (shapes past its budget are skipped)
set -uo pipefail
out=${1:?usage: bash scripts/backward_device.sh OUTDIR}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "note: no .whl/*.whl here: Liger is left out of the benchmark"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TOTAL_S=${TOTAL_S:-570}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"

echo "== 1. tests ($SECONDS s)"
timeout -k 10 "${TESTS_S:-180}" python3 -m pytest -q -n 8 -rs -p no:cacheprovider --durations=10 \
  tests/test_gpu_backward.py tests/test_torch_gpu.py tests/test_torch_ops.py 2>&1 \
  | tee "$out/tests.log" | grep -v "PASSED" | tail -40

echo "== 2. sanitizer ($SECONDS s)"
SANITIZE_GRIDS=sanitize_backward_grid SANITIZE_LOG_DIR="$out/sanitize" \
  timeout -k 10 "${SANITIZE_S:-180}" bash scripts/sanitize.sh 2>&1 | tee "$out/sanitize.log" | tail -12

echo "== 3. training ($SECONDS s)"
timeout -k 10 "${TRAIN_S:-100}" python3 benchmarks/train_llama.py --out "$out" 2>&1 | tee "$out/train_llama.log" | tail -16

left=$(( TOTAL_S - SECONDS - 40 ))
echo "== 4. benchmark ($SECONDS s; budget ${left} s)"
if [ "$left" -gt 30 ]; then
  timeout -s INT -k 10 $(( left + 30 )) python3 -m cupy_rmsnorm.bench backward --out "$out" --budget-s "$left" --repeats 5 --target-us 1500 2>&1 \
    | tee "$out/backward_bench.log" | tail -40
else
  echo "no time left for the benchmark"
fi
echo "== done ($SECONDS s)"
