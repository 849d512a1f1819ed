// gdn_norm.cuh: the l2 normalisation both Gated DeltaNet kernels apply to q and k rows
// (k^ = k / sqrt(sum k^2 + 1e-6), fp32), for rows spread over SEGS lanes of 8 bf16 each.
#pragma once
#include <cuda_bf16.h>

// x[0..7] = the 8 bf16 of `raw` as fp32; returns 1 / sqrt(sum of x^2 over the row + 1e-6), the sum taken
// over the SEGS consecutive lanes (a power of two dividing 32) that hold the row's segments. FAST: rsqrtf (the
// hardware's, within 2 ulp) instead of the correctly rounded 1 / sqrtf (about 20 instructions more, a branch to a
// slow path among them); the "wgmma" pair's precompute takes it, whose scales meet bf16 products.
template <int SEGS, bool FAST = false>
__device__ __forceinline__ float gdn_row_inv_norm(const uint4& raw, float* x) {
    const __nv_bfloat162* pr = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(pr[i]);
        x[2 * i] = f.x;
        x[2 * i + 1] = f.y;
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(x[i], x[i], ss);
#pragma unroll
    for (int off = SEGS / 2; off >= 1; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if constexpr (FAST) return rsqrtf(ss + 1e-6f);
    else return 1.0f / sqrtf(ss + 1e-6f);
}
