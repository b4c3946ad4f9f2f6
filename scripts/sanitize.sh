#!/usr/bin/env bash
# Runs every grid of scripts/sanitize/ (*_grid.py: one per op family) under compute-sanitizer's
# memcheck, racecheck and initcheck and prints one summary line per tool and grid; exits non-zero
# if any tool or grid failed.
#
#     scripts/sanitize.sh                 # from anywhere; needs a GPU and compute-sanitizer
#     SANITIZE_LOG_DIR=dir scripts/sanitize.sh   # keep the full logs there (default: a temp dir)
#     SANITIZE_GRIDS=backward_grid scripts/sanitize.sh   # some grids only (their names)
#     SANITIZE_TOOLS="memcheck racecheck" scripts/sanitize.sh     # some tools only
#     SANITIZE_QUICK=1 scripts/sanitize.sh   # every tool on the grids' --quick form
#     PYTHON=python3.12 SANITIZER_FLAGS="..." scripts/sanitize.sh
#
# racecheck runs the grid with --quick (it instruments every shared-memory access and is
# the slow one). --report-api-errors no: CUDA API calls that fail are already Python
# exceptions in the grid (a non-zero exit here), and CuPy's own probing calls would
# otherwise count as sanitizer errors.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
SAN=$(command -v compute-sanitizer || true)
if [ -z "$SAN" ]; then
    for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
        [ -x "$c" ] && SAN=$c && break
    done
fi
if [ -z "$SAN" ]; then
    echo "sanitize: compute-sanitizer not found (PATH, /usr/local/cuda/bin)" >&2
    exit 2
fi
LOG_DIR=${SANITIZE_LOG_DIR:-$(mktemp -d)}
mkdir -p "$LOG_DIR"
echo "sanitize: $("$SAN" --version | tail -1); logs in $LOG_DIR"

api_flag=""
"$SAN" --help 2>/dev/null | grep -q -- "--report-api-errors" && api_flag="--report-api-errors no"

status=0
summary=()
all_grids=$(cd scripts/sanitize && ls *_grid.py | sed 's/\.py$//' | tr '\n' ' ')
for grid_name in ${SANITIZE_GRIDS:-$all_grids}; do
script=$grid_name
if [ ! -f "scripts/sanitize/$script.py" ]; then
    echo "sanitize: no grid scripts/sanitize/$script.py" >&2
    summary+=("$grid_name: FAIL (no such grid)"); status=1
    continue
fi
for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck}; do
    quick=""
    { [ "$tool" = racecheck ] || [ "${SANITIZE_QUICK:-0}" = 1 ]; } && quick="--quick"
    log="$LOG_DIR/$grid_name.$tool.log"
    start=$(date +%s)
    # shellcheck disable=SC2086  # the unquoted ones are flag lists (or nothing) on purpose
    "$SAN" --tool "$tool" --error-exitcode 1 $api_flag ${SANITIZER_FLAGS:-} \
        "$PY" "scripts/sanitize/$script.py" $quick >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    errors=$(grep -E "ERROR SUMMARY" "$log" | tail -1 | sed -E 's/^=+ *//')
    grid=$(grep -E "^$script:" "$log" | tail -1)
    if [ "$rc" -eq 0 ]; then verdict=PASS; else verdict="FAIL (exit $rc)"; status=1; fi
    summary+=("$grid_name $tool: $verdict; ${errors:-no sanitizer summary}; ${grid:-grid did not finish}; ${secs}s")
    if [ "$rc" -ne 0 ]; then
        echo "---- $grid_name $tool: first reports ($log) ----"
        grep -E "^=+ |WRONG|Error|error" "$log" | head -40
    fi
done
done
printf '%s\n' "${summary[@]}"
exit $status
