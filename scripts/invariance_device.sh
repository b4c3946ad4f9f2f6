#!/usr/bin/env bash
# Batch invariance's whole GPU check in one call of under 6 minutes (for the lent H200):
#   bash scripts/invariance_device.sh OUTDIR
# run from the repository root with _base_inv carried: the previous kernels and launcher
# (the tree at 70ca186: `mkdir _base_inv && git archive 70ca186 cupy_rmsnorm kernels
# pyproject.toml | tar -x -C _base_inv`; ignored by git). In order, each under its own time
# limit, each writing its logs to OUTDIR as it goes, each step going on when one before failed:
#   1. GPU tests (pytest -n 8): batch invariance, the forward grid and special inputs, while
#   2. compute-sanitizer memcheck / racecheck / initcheck of tests/sanitize_grid.py runs beside
#      them, and so does a one-repeat pass of the benchmark (torch.compile's and NVRTC's caches)
#   3. the forward benchmark (graph mode; F.rms_norm and torch.compile; a subset of the standard
#      grid plus cluster and streamed shapes), new and old trees in turns (new, old, new, old)
#      while time is left, then scripts/compare_bench.py: new / old per shape
# TOTAL_S (default 345) bounds the whole; TESTS_S, SANITIZE_S and WARM_S the steps.
set -uo pipefail
out=${1:?usage: bash scripts/invariance_device.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
TOTAL_S=${TOTAL_S:-345}
nvidia-smi --query-gpu=name,driver_version,compute_cap,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
{ git log -1 --format="new tree: %h %s" 2>/dev/null || echo "new tree: (no git here)"; } | tee "$out/versions.txt"

# -- 3's shapes and runner: the new tree from the repository root, the old one from _base_inv
# (python -m puts the working folder first on the path, so each run imports its own package)
SHAPES=(1,32,256,4096,16384x4096 1,1024,4096x8192 4096x512,1024,255,4095 256x5120 1,32x32768 1024x65536)
bench() {   # bench NAME FOLDER SECONDS [more options]
  local name=$1 folder=$2 secs=$3
  shift 3
  ( cd "$folder" && timeout -s INT -k 10 "$secs" python3 -m cupy_rmsnorm.bench --modes graph --dtypes bf16,fp16 \
      --peers F.rms_norm,torch_compile --shapes "${SHAPES[@]}" --no-first-call --no-chart \
      --out "$out/bench" --name "$name" "$@" ) >"$out/bench_$name.log" 2>&1
  echo "$name: $(grep -E '^[0-9]+ measurements' "$out/bench_$name.log" | tail -1)"
}

echo "== 2. sanitizer and the benchmark's compiles, in the background ($SECONDS s)"
( export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  SANITIZE_GRIDS=sanitize_grid SANITIZE_LOG_DIR="$out/sanitize" timeout -k 10 "${SANITIZE_S:-200}" bash scripts/sanitize.sh
) >"$out/sanitize.log" 2>&1 &
sanitize_pid=$!
# torch.compile's and NVRTC's on-disk caches, so that the timed runs below spend their time timing
bench warm . "${WARM_S:-190}" --repeats 1 >"$out/bench_warm.txt" 2>&1 &
warm_pid=$!

echo "== 1. tests ($SECONDS s)"
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout -s INT -k 15 "${TESTS_S:-190}" \
  python3 -m pytest -q -n 8 -rs -p no:cacheprovider --durations=15 \
  tests/test_gpu_invariance.py tests/test_gpu_special_inputs.py tests/test_gpu_grid.py 2>&1 \
  | tee "$out/tests.log" | grep -v "PASSED" | tail -40
wait "$sanitize_pid"
echo "== 2. sanitizer done ($SECONDS s)"
tail -8 "$out/sanitize.log"
wait "$warm_pid"
echo "benchmark compiles: $(cat "$out/bench_warm.txt")"

# -- 3. benchmark, new and old in turns while time is left (each of the first two gets half)
if [ -d _base_inv/cupy_rmsnorm ] && [ -d _base_inv/kernels ]; then
  runs=(new old new2 old2)
  for i in 0 1 2 3; do
    name=${runs[$i]}
    left=$(( TOTAL_S - SECONDS - 10 ))
    cap=$(( i == 0 ? left / 2 : left ))
    cap=$(( cap < 120 ? cap : 120 ))
    if [ "$cap" -lt 30 ]; then
      echo "== 3. no time left for the $name run ($left s)"
      break
    fi
    folder=$([ "${name#old}" != "$name" ] && echo _base_inv || echo .)
    echo "== 3. benchmark $name from $folder ($SECONDS s; at most $cap s)"
    bench "$name" "$folder" "$cap"
  done
  news=$(ls "$out"/bench/new*.json 2>/dev/null)
  olds=$(ls "$out"/bench/old*.json 2>/dev/null)
  if [ -n "$news" ] && [ -n "$olds" ]; then
    # shellcheck disable=SC2086  # lists of files
    python3 scripts/compare_bench.py --base $olds --new $news --out "$out/compare.md" | tail -45
  fi
else
  echo "== 3. no _base_inv/ here (carry it): no benchmark to compare"
fi

echo "== summary ($SECONDS s)"
echo "tests: $(grep -E '(passed|failed|error).* in [0-9.]+s' "$out/tests.log" | tail -1)"
grep -E "^FAILED|^ERROR" "$out/tests.log" | head -15
grep -E "^sanitize_grid (memcheck|racecheck|initcheck):" "$out/sanitize.log"
[ -f "$out/compare.md" ] && tail -1 "$out/compare.md"
