#!/usr/bin/env bash
# compute-sanitizer over one small prefill step (scripts/sanitize_step.py: Q12Pass with RoPE and MRoPE,
# the KV write, attention D 64, 128 and 256 (the wgmma and the mma.sync kernels), the short convolution
# at widths 2, 3 and 4, every GDN kernel at d64 and d128 and the device-side metadata expansion: every
# kernel q12drv ships; 3 ragged streams, batched and per stream, guard bands around every buffer):
# memcheck (with --leak-check full), racecheck, initcheck, synccheck, each with --error-exitcode 9.
# Prints one PASS/FAIL line per tool; full logs under $OUT (default /tmp/q12drv-sanitize).
# Exit status 0 when every tool passes.
#
#   scripts/sanitize.sh
#   Q12_SANITIZE_TOOLS="memcheck initcheck" scripts/sanitize.sh     # a subset
#   Q12_SANITIZE_LEAKS=0 scripts/sanitize.sh                         # memcheck without the leak check
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/q12drv-sanitize}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 Q12DRV_CACHE_DIR=${Q12DRV_CACHE_DIR:-/tmp/q12drv-cubin}
SAN=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
PY=${PYTHON:-python3}
LIMIT=${Q12_SANITIZE_TIMEOUT:-40}  # per tool; gpu_check.sh passes 30 and gives the whole script 150 s
fail=0
if [ ! -x "$SAN" ]; then
  echo "compute-sanitizer not found at $SAN (set COMPUTE_SANITIZER)"
  exit 1
fi

# NVRTC compiles on the host: do it once outside the sanitizer, the sanitized runs load the cached cubins.
t0=$SECONDS
STEP=(scripts/sanitize_step.py --driver "${Q12_SANITIZE_DRIVER:-cuda}")
if $PY "${STEP[@]}" --compile-only >"$OUT/compile.log" 2>&1 && $PY "${STEP[@]}" >"$OUT/plain.log" 2>&1; then
  echo "plain      PASS ($((SECONDS - t0)) s) $(tail -n 1 "$OUT/plain.log")"
else
  echo "plain      FAIL ($((SECONDS - t0)) s): the step fails without the sanitizer"
  tail -n 20 "$OUT/compile.log" "$OUT/plain.log" 2>/dev/null
  exit 1
fi

for tool in ${Q12_SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
  extra=()
  if [ "$tool" = memcheck ] && [ "${Q12_SANITIZE_LEAKS:-1}" = 1 ]; then extra=(--leak-check full); fi
  t0=$SECONDS
  timeout "$LIMIT" "$SAN" --tool "$tool" --error-exitcode 9 ${extra[@]+"${extra[@]}"} \
    $PY "${STEP[@]}" >"$OUT/$tool.log" 2>&1
  rc=$?
  summary=$(grep -E "(ERROR|RACECHECK|LEAK) SUMMARY" "$OUT/$tool.log" | sed 's/^=* *//' | paste -sd ';' -)
  step=$(grep -E "^sanitize_step:" "$OUT/$tool.log" | tail -n 1)
  if [ "$rc" -eq 0 ]; then
    printf '%-10s PASS (%s s) %s | %s\n' "$tool" "$((SECONDS - t0))" "${summary:-no summary}" "$step"
  else
    why="rc=$rc"
    [ "$rc" -eq 9 ] && why="rc=9: the sanitizer reported errors"
    [ "$rc" -eq 1 ] && why="rc=1: the step's own checks failed"
    [ "$rc" -eq 124 ] && why="rc=124: timed out after ${LIMIT} s"
    printf '%-10s FAIL (%s s) %s | %s | %s\n' "$tool" "$((SECONDS - t0))" "$why" "${summary:-no summary}" "$step"
    grep -E "^=+ +(Invalid|Uninitialized|Race|Barrier|Error|Leaked|Program hit|Saved host backtrace)" "$OUT/$tool.log" | head -n 8
    fail=1
  fi
done
exit $fail
