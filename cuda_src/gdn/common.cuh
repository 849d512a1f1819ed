// gdn/common.cuh: what every Gated DeltaNet kernel shares: the entries' parameter list and the l2 normalisation of
// the q and k rows.
#pragma once
#include "common/q12_meta.cuh"

// Every GDN entry takes these parameters (the host packs them once per entry from this text,
// q12drv.core.launch.parse_signatures): the metadata, the per-stream state pointers, q, k [T, Hk, d] bf16, v, o
// [T, Hv, d] bf16, g, beta [T, Hv] fp32, the head counts and the workspace (a two-pass schedule's records; NULL
// and unread where the kernel keeps everything on chip).
#define GDN_PARAMS                                                                                                \
    Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q,                 \
        const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g,                      \
        const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads,                   \
        unsigned char* __restrict__ workspace
// The same parameters as a kernel body (a __forceinline__ template every entry calls) takes them, and the
// arguments an entry passes on.
#define GDN_BODY_PARAMS                                                                                           \
    const Q12Meta &m, const unsigned long long *__restrict__ h_state_ptrs, const bf16 *__restrict__ q,          \
        const bf16 *__restrict__ k, const bf16 *__restrict__ v, const float *__restrict__ g,                      \
        const float *__restrict__ beta, bf16 *__restrict__ o, int num_k_heads, int num_v_heads,                   \
        unsigned char *__restrict__ workspace
#define GDN_ARGS m, h_state_ptrs, q, k, v, g, beta, o, num_k_heads, num_v_heads, workspace

// x[0..7] = the 8 bf16 of `raw` as fp32; returns 1 / sqrt(sum of x^2 over the row + 1e-6) (k^ = k * that, fp32),
// the sum taken over the SEGS consecutive lanes (a power of two dividing 32) that hold the row's segments. FAST:
// rsqrtf (the hardware's, within 2 ulp) instead of the correctly rounded 1 / sqrtf (about 20 instructions more, a
// branch to a slow path among them): the wgmma path's precompute takes it, whose scales meet bf16 products.
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
