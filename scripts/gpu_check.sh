#!/usr/bin/env bash
# Everything q12drv checks on a GPU, in one command (the H200 test machine has no network:
# nothing is installed, the checkout runs from PYTHONPATH). Logs go to $OUT (default /tmp/q12drv-gpu).
#
#   scripts/gpu_check.sh            # doctor, GPU tests, demo, 10k-pass soak, sanitizer, benchmark
#   Q12_SKIP_BENCH=1 Q12_SKIP_SANITIZE=1 Q12_SKIP_SOAK=1 scripts/gpu_check.sh
#   Q12_BENCH_SECTIONS=gdn,attention scripts/gpu_check.sh   # only those gpu_compare.py sections (no host profile)
#   Q12_PYTEST_ARGS="-k conv1d" scripts/gpu_check.sh         # a subset of the GPU tests
#   Q12_SKIP_BENCH=1 scripts/gpu_check.sh; Q12_SKIP_TESTS=1 Q12_SKIP_SOAK=1 Q12_SKIP_SANITIZE=1 scripts/gpu_check.sh
#                                   # the whole check in two runs of under 10 minutes each (tests, then benchmarks)
# The commit the logs and the bench JSON name is Q12_COMMIT where set, else git's HEAD here: a copied tree's git
# metadata may be stale, so pass Q12_COMMIT=$(git rev-parse --short HEAD) from the checkout the tree came from.
# Comparators that are not on the machine travel as wheels in .whl/ (git-ignored; see bench/README.md)
# and are installed into /tmp/site without the network; only the benchmark sees them (the GPU tests compare
# against transformers' torch code, which transformers swaps for fla-core's kernels where fla-core imports).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/q12drv-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 Q12DRV_CACHE_DIR=${Q12DRV_CACHE_DIR:-/tmp/q12drv-cubin}
status=()
BENCH_PATH=$PYTHONPATH
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && BENCH_PATH=$PYTHONPATH:/tmp/site
  # nvidia-cuda-nvdisasm's binary, for the doctor's SASS columns and tests/test_sass.py (q12drv.tools.sass looks on PATH)
  [ -x /tmp/site/nvidia/cu13/bin/nvdisasm ] && export PATH=$PATH:/tmp/site/nvidia/cu13/bin
fi
step() {  # step NAME LOG SECONDS COMMAND...   (each step has its own time limit)
  local name=$1 log=$2 limit=$3; shift 3
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  status+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$log")")
  tail -n 25 "$OUT/$log"
}
{ date -u; echo "commit ${Q12_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -c "import cuda.bindings, cuda.core, numpy, torch; print('cuda-bindings', cuda.bindings.__version__, 'cuda-core', cuda.core.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"; } 2>&1
# at most 8 files come back from the H200 machine: one log per step and the bench JSON (the plot is
# drawn from the JSON afterwards: python3 bench/plot_staging_curve.py bench.json -o bench/staging_curve.png)
step doctor doctor.log 60 python3 -m q12drv doctor --driver cuda
if [ -z "${Q12_SKIP_TESTS:-}" ]; then
  per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout=120)  # where pytest-timeout is installed
  step gpu-tests gpu_tests.log 300 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider $per_test ${Q12_PYTEST_ARGS:-}
  step demo demo.log 40 python3 -m q12drv demo --driver cuda
fi
if [ -z "${Q12_SKIP_SOAK:-}" ] && [ -f scripts/gpu_soak.py ]; then
  step soak soak.log 60 python3 scripts/gpu_soak.py --passes 10000 --driver cuda
fi
if [ -z "${Q12_SKIP_SANITIZE:-}" ] && [ -f scripts/sanitize.sh ]; then
  # the per-tool logs stay on the machine; the PASS/FAIL lines come back in sanitize.log
  step sanitize sanitize.log 150 env OUT=/tmp/q12drv-sanitize Q12_SANITIZE_TIMEOUT="${Q12_SANITIZE_TIMEOUT:-30}" bash scripts/sanitize.sh
fi
if [ -z "${Q12_SKIP_BENCH:-}" ] && [ -f bench/gpu_compare.py ]; then
  # host-side profile first (cProfile of staging and the 8 x 128 step), into the bench log
  : >"$OUT/bench.log"
  [ -z "${Q12_BENCH_SECTIONS:-}" ] && timeout 60 python3 bench/profile_host.py --reps 200 --top 25 >"$OUT/bench.log" 2>&1
  step bench bench.log.tmp 420 env PYTHONPATH="$BENCH_PATH" python3 bench/gpu_compare.py --budget-s ${Q12_BENCH_BUDGET:-300} --out "$OUT/bench.json" \
    ${Q12_BENCH_SECTIONS:+--sections "$Q12_BENCH_SECTIONS"}
  cat "$OUT/bench.log.tmp" >>"$OUT/bench.log" && rm -f "$OUT/bench.log.tmp"
  if [ -z "${Q12_BENCH_SECTIONS:-}" ] && [ -f bench/breakdown.py ]; then  # where the step's and staging's time goes
    step breakdown bench.log.tmp 90 python3 bench/breakdown.py --driver cuda
    cat "$OUT/bench.log.tmp" >>"$OUT/bench.log" && rm -f "$OUT/bench.log.tmp"
    # every op's device time through pytest-benchmark (its JSON is what --benchmark-compare reads)
    step kernels bench.log.tmp 120 env Q12DRV_DRIVER=cuda python3 -m pytest bench/test_kernels.py -q -p no:cacheprovider \
      --benchmark-json "$OUT/kernels.json" --benchmark-columns=median,iqr,rounds
    cat "$OUT/bench.log.tmp" >>"$OUT/bench.log" && rm -f "$OUT/bench.log.tmp"
  fi
fi
echo "==== summary ($(date -u +%FT%TZ))"
printf '%s\n' "${status[@]}"
