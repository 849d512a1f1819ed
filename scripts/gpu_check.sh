#!/usr/bin/env bash
# Everything q12drv checks on a GPU, in one command (the H200 test machine has no network:
# nothing is installed, the checkout runs from PYTHONPATH). Logs go to $OUT (default /tmp/q12drv-gpu).
#
#   scripts/gpu_check.sh            # doctor, GPU tests, demo, sanitizer, 10k-pass soak, benchmark
#   Q12_SKIP_BENCH=1 Q12_SKIP_SANITIZE=1 Q12_SKIP_SOAK=1 scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/q12drv-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 Q12DRV_CACHE_DIR=${Q12DRV_CACHE_DIR:-/tmp/q12drv-cubin}
status=()
step() {  # step NAME LOG SECONDS COMMAND...   (each step has its own time limit)
  local name=$1 log=$2 limit=$3; shift 3
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  status+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$log")")
  tail -n 25 "$OUT/$log"
}
{ date -u; echo "commit ${Q12_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -c "import cuda.bindings, cuda.core, numpy, torch; print('cuda-bindings', cuda.bindings.__version__, 'cuda-core', cuda.core.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"; } 2>&1
# at most 8 files come back from the H200 machine: one log per step, the bench JSON and the plot
step doctor doctor.log 60 python3 -m q12drv doctor --driver cuda
step gpu-tests gpu_tests.log 150 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider --timeout=90 ${Q12_PYTEST_ARGS:-}
step demo demo.log 40 python3 -m q12drv demo --driver cuda
if [ -z "${Q12_SKIP_SOAK:-}" ] && [ -f scripts/gpu_soak.py ]; then
  step soak soak.log 60 python3 scripts/gpu_soak.py --passes 10000 --driver cuda
fi
if [ -z "${Q12_SKIP_SANITIZE:-}" ] && [ -f scripts/sanitize.sh ]; then
  # the per-tool logs stay on the machine; the PASS/FAIL lines come back in sanitize.log
  step sanitize sanitize.log 150 env OUT=/tmp/q12drv-sanitize Q12_SANITIZE_TIMEOUT="${Q12_SANITIZE_TIMEOUT:-30}" bash scripts/sanitize.sh
fi
if [ -z "${Q12_SKIP_BENCH:-}" ] && [ -f bench/gpu_compare.py ]; then
  step bench bench.log 90 python3 bench/gpu_compare.py --budget-s ${Q12_BENCH_BUDGET:-50} --out "$OUT/bench.json"
  timeout 30 python3 bench/plot_staging_curve.py "$OUT/bench.json" -o "$OUT/staging_curve.png" >>"$OUT/bench.log" 2>&1
fi
echo "==== summary ($(date -u +%FT%TZ))"
printf '%s\n' "${status[@]}"
