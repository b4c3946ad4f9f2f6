#!/usr/bin/env bash
# The whole GPU check in one go (for the lent H200): GPU tests, compute-sanitizer, host cost.
#   bash scripts/gpu_suite.sh OUTDIR
set -uo pipefail
out=${1:-gpu_suite_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
timeout ${TESTS_S:-330} python3 -m pytest -q -n 8 -rs --durations=15 tests 2>&1 | tee "$out/tests.log" | grep -v "^SKIPPED.*CPU\|PASSED" | tail -60
SANITIZE_LOG_DIR="$out/sanitize" timeout ${SANITIZE_S:-200} bash scripts/sanitize.sh 2>&1 | tee "$out/sanitize.log" | tail -12
timeout 60 python3 benchmarks/host_overhead.py --out "$out/host_overhead.json" 2>&1 | tee "$out/host_overhead.log" | tail -20
