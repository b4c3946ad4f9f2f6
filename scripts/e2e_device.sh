#!/usr/bin/env bash
# The whole-model benchmark on the lent H200 in one call (about 4-5 minutes at the default
# sizes: 8 layers x 4096, prompt 128, 64 new tokens, 5 interleaved rounds, eager and compiled):
#   bash scripts/e2e_device.sh OUTDIR [more e2e options, e.g. --modes eager]
# with run(carry=[".whl"]) so that the liger-kernel wheel in .whl/ comes along (without it
# the liger variant is reported as skipped). Writes OUTDIR/h200_e2e.{json,csv,md}, e2e.log
# and gpu.txt; the table is the last lines of the output.
set -uo pipefail
out=${1:?usage: bash scripts/e2e_device.sh OUTDIR [e2e options]}
shift
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "note: no .whl/*.whl here: the liger variant will be skipped"
fi
# this source tree first: the cupy_rmsnorm under test
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
# --budget-s: no compile or round starts that would end past it; SIGINT at the timeout
# still saves what was measured (each mode's results are written as soon as it ends).
timeout -s INT -k 20 "${E2E_S:-320}" python3 -m cupy_rmsnorm.bench e2e --out "$out" --name "${NAME:-h200}" \
  --budget-s "${BUDGET_S:-270}" "$@" 2>&1 | tee "$out/e2e.log"
