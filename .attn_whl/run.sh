#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -c "import cuda.core, cuda.bindings; print('cuda.core', cuda.core.__version__, 'bindings', cuda.bindings.__version__)"
export PYTHONPATH=.:$PYTHONPATH
export Q12_ATTN_CUBIN=.attn_whl/base.cubin
timeout ${TEST_T:-300} python3 -m pytest tests/gpu/test_attention_gpu.py -q -x -p no:cacheprovider ${PYTEST_ARGS} 2>&1 | tee $OUT/test.log | tail -30
if [ -n "$BENCH" ]; then timeout ${BENCH_T:-200} python3 tests/gpu/_attn_bench_tmp.py 2>&1 | tee $OUT/bench.log; fi
if [ -n "$NCU" ]; then
  echo NCU
  ONLY="d128 fresh" NO_SDPA=1 VARIANTS="" timeout 200 ncu --clock-control none -k q12_attn_prefill_d128 -s 1 -c 1 --section WarpStateStats --section ComputeWorkloadAnalysis --section SpeedOfLight --section Occupancy python3 tests/gpu/_attn_bench_tmp.py 2>&1 | grep -v "^==PROF==" | tee $OUT/ncu.log | tail -80
fi
