#!/usr/bin/env bash
# The GPU check in one script (short or full), run from the repository root on a machine
# with a CUDA GPU:
#
#     bash scripts/gpu_check.sh OUTDIR
#
# In order, each step under its own time limit, each writing its log to OUTDIR as it goes:
#   1. tests      the test suite, GPU tests included: pytest -q -n 8 -rs --durations=15 tests
#                 (the source tree first on PYTHONPATH)                 -> OUTDIR/tests.log
#   2. sanitize   compute-sanitizer memcheck / racecheck / initcheck of the grids in
#                 scripts/sanitize/ (scripts/sanitize.sh)               -> OUTDIR/sanitize.log, OUTDIR/sanitize/
#   3. host       per-call host cost (benchmarks/host_overhead.py)      -> OUTDIR/host_overhead.{json,log}
#   4. reports    only with REPORTS=1: each committed report of benchmarks/results/ re-made with
#                 the command docs/performance.md publishes for it (report_command below),
#                 --out OUTDIR/reports --name <report>  -> OUTDIR/reports/, OUTDIR/report_<name>.log
# then a summary: the GPU, pytest's summary line, one line per sanitizer tool and grid, and
# each step's exit status. Exits non-zero when a step that ran failed.
#
# Environment (all optional):
#   SKIP_TESTS=1 SKIP_SANITIZE=1 SKIP_HOST=1   leave a step out
#   REPORTS=1                    run step 4 too; REPORT_NAMES="forward quant" picks reports (default:
#                                all nine; quant and qk_rope add --flashinfer .flashinfer where it exists)
#   REPORT_ARGS="--quick"        extra options for every report
#   TESTS_S=330 SANITIZE_S=300 HOST_S=60 REPORT_S=600   time limits in seconds (per step; per report)
#   PYTEST_ARGS="-n 4"           replaces "-n 8"; TEST_PATHS="tests/gpu" replaces "tests"
#   SANITIZE_GRIDS, SANITIZE_TOOLS  passed on to scripts/sanitize.sh
# e.g. a short check: SKIP_SANITIZE=1 SKIP_HOST=1 bash scripts/gpu_check.sh out
#      the full one:  REPORTS=1 bash scripts/gpu_check.sh out
set -uo pipefail
out=${1:?usage: bash scripts/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
status=0
steps=()

step() {   # step NAME RC: records a step's exit status (124: past its time limit)
    local verdict="ok"
    [ "$2" -eq 124 ] && verdict="TIMED OUT"
    [ "$2" -ne 0 ] && [ "$2" -ne 124 ] && verdict="FAILED (exit $2)"
    [ "$2" -ne 0 ] && status=1
    steps+=("$1: $verdict")
}

if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
else
    echo "nvidia-smi not found" | tee "$out/gpu.txt"
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    echo "== tests ($SECONDS s)"
    # shellcheck disable=SC2086  # PYTEST_ARGS and TEST_PATHS are lists on purpose
    timeout -k 10 "${TESTS_S:-330}" "$PY" -m pytest -q ${PYTEST_ARGS:--n 8} -rs -p no:cacheprovider \
        --durations=15 ${TEST_PATHS:-tests} >"$out/tests.log" 2>&1
    rc=$?
    grep -v "PASSED\|^SKIPPED.*no CUDA GPU" "$out/tests.log" | tail -60
    step tests "$rc"
fi

if [ "${SKIP_SANITIZE:-0}" != 1 ]; then
    echo "== sanitize ($SECONDS s)"
    SANITIZE_LOG_DIR="$out/sanitize" timeout -k 10 "${SANITIZE_S:-300}" bash scripts/sanitize.sh \
        >"$out/sanitize.log" 2>&1
    rc=$?
    tail -12 "$out/sanitize.log"
    step sanitize "$rc"
fi

if [ "${SKIP_HOST:-0}" != 1 ]; then
    echo "== host cost ($SECONDS s)"
    timeout -k 10 "${HOST_S:-60}" "$PY" benchmarks/host_overhead.py --out "$out/host_overhead.json" \
        >"$out/host_overhead.log" 2>&1
    rc=$?
    tail -20 "$out/host_overhead.log"
    step host "$rc"
fi

# The sub-command and options of each committed report, as docs/performance.md publishes them.
report_command() {
    local flashinfer=""
    [ -d .flashinfer/include ] && flashinfer="--flashinfer .flashinfer"
    case "$1" in
        forward)    echo "forward --dtypes bf16,fp16 --modes graph,cold --compile static" ;;
        backward)   echo "backward --dtypes bf16,fp16 --modes graph,cold" ;;
        quant)      echo "quant --dtypes bf16 --modes graph $flashinfer" ;;
        gated)      echo "gated" ;;
        qk_rope)    echo "qk_rope $flashinfer" ;;
        layer_norm) echo "layer_norm" ;;
        e2e)        echo "e2e --repeats 3 --agree-tokens 512" ;;
        e2e_qwen3)  echo "e2e --model qwen3 --repeats 3 --agree-tokens 512" ;;
        train)      echo "train" ;;
        *)          return 1 ;;
    esac
}

if [ "${REPORTS:-0}" = 1 ]; then
    mkdir -p "$out/reports"
    for name in ${REPORT_NAMES:-forward backward quant gated qk_rope layer_norm e2e e2e_qwen3 train}; do
        echo "== report $name ($SECONDS s)"
        if ! command=$(report_command "$name"); then
            echo "no such report: $name"
            step "report $name" 2
            continue
        fi
        # SIGINT at the limit: a report saves what it measured
        # shellcheck disable=SC2086  # the command and REPORT_ARGS are lists of options on purpose
        timeout -s INT -k 20 "${REPORT_S:-600}" "$PY" -m cupy_rmsnorm.bench $command --out "$out/reports" \
            --name "$name" ${REPORT_ARGS:-} >"$out/report_$name.log" 2>&1
        rc=$?
        tail -20 "$out/report_$name.log"
        step "report $name" "$rc"
    done
fi

echo "== summary ($SECONDS s; logs in $out)"
cat "$out/gpu.txt"
if [ -f "$out/tests.log" ] && [ "${SKIP_TESTS:-0}" != 1 ]; then
    line=$(grep -E "^=*.*[0-9]+ (passed|failed|skipped|errors?)\b.* in [0-9.]+s" "$out/tests.log" | tail -1)
    echo "tests: ${line:-no pytest summary line (see tests.log)}"
fi
if [ -f "$out/sanitize.log" ] && [ "${SKIP_SANITIZE:-0}" != 1 ]; then
    lines=$(grep -E "^[a-z_]+ (memcheck|racecheck|initcheck): |^[a-z_]+: FAIL|^sanitize: " "$out/sanitize.log")
    echo "${lines:-sanitize: no summary lines (see sanitize.log)}"
fi
printf '%s\n' "${steps[@]}"
exit $status
