// launch_overhead.cu: empty kernels for the launch-latency benchmarks (bench/inputs.py LAUNCH_CASES:
// bench/test_launch.py, gpu_compare.py's launch section, breakdown.py); no product code uses them.
// Compiled from here with cuda_src/ on the include path (nvrtc.compile_source(..., source_dir=)).
//
// The same parameter shapes as cuda-python's launch-latency matrix: no argument, one pointer,
// 6 x u64 + 2 x i32, 16 pointers, the Q12Meta struct by value (what every q12drv kernel takes)
// and a 2048-byte struct.
#include "common/q12_meta.cuh"

struct Q12BenchBig {
    unsigned long long v[256];
};

extern "C" __global__ void q12_bench_empty() {}

extern "C" __global__ void q12_bench_ptr1(const unsigned long long* a0) {}

extern "C" __global__ void q12_bench_args8(const unsigned long long* a0, const unsigned long long* a1, const unsigned long long* a2, const unsigned long long* a3, const unsigned long long* a4, const unsigned long long* a5, int n0, int n1) {}

extern "C" __global__ void q12_bench_args16(const float* a0, const float* a1, const float* a2, const float* a3, const float* a4, const float* a5, const float* a6, const float* a7, const float* a8, const float* a9, const float* a10, const float* a11, const float* a12, const float* a13, const float* a14, const float* a15) {}

extern "C" __global__ void q12_bench_meta(Q12Meta m) {}

extern "C" __global__ void q12_bench_big(Q12BenchBig s) {}
