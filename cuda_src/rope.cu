// rope.cu: RoPE / MRoPE (NeoX pairing) in place on packed Q [T, Hq, D] and K [T, Hkv, D], bf16.
//
// Math (per token t, per frequency j < half = rotary_dim / 2; dims >= rotary_dim untouched):
//   inv_freq[j] = 1 / fl32(theta ^ e_j), e_j = fl32(2j / rotary_dim)   (HF's fp32 chain; the power
//                 is evaluated in double and rounded once to fp32, so host and device agree)
//   angle      = fl32((float)pos_{s(j)}[t] * inv_freq[j])
//   (c, s)     = sincosf(angle)                                         (precise, |angle| ~ 1e6)
//   x1 = x[j], x2 = x[j + half]:
//   x1' = fma(x1, c, -(x2 * s)),  x2' = fma(x2, c, x1 * s)              (fp32, one bf16 rounding)
// Position stream s(j) in {0 = T, 1 = H, 2 = W}, read as q12_positions(m, s(j))[t]:
//   mrope_mode 0: plain RoPE, always T (positions_h / positions_w are never read)
//   mrope_mode 1: chunked sections (Qwen2-VL): T for j < sec_t, H for j < sec_t + sec_h, else W
//   mrope_mode 2: interleaved (Qwen3-VL, Qwen3.5): H if j%3==1 && j < 3*sec_h,
//                 W if j%3==2 && j < 3*sec_w, else T
// HF rounds cos/sin to bf16 before multiplying; this kernel keeps them fp32 (more accurate).
//
// Work split: a "unit" = (token, head, 8 consecutive pairs): two 16-byte loads (x[j0..j0+7] and
// x[half+j0..]), 8 rotations, two 16-byte stores. The CTA takes G consecutive tokens per
// iteration (G = 2 * blockDim / units_per_token, >= 1, capped by the angle buffer) and walks the
// tokens with a grid stride, so any grid covers T = m.total_tokens. Each thread first loads its
// first 2 units (ROPE_PREFETCH; bytes in flight hide DRAM latency), then phase 1 computes the
// G * half angles once (shared by all Hq + Hkv heads) into shared memory, then phase 2 rotates
// and stores the prefetched units (and any further ones, loaded on the spot). Only the rotary
// dims are touched. When the layout does not allow 16-byte accesses (rotary_dim % 16,
// head_dim % 8 or a pointer not 16-byte aligned) a unit is one pair with 2-byte accesses: same
// math, same results. 72 registers a thread on sm_90: launch with at most 512 threads a block.
// Everything is per token (no cross-token arithmetic): a stream's rows come out identical
// whether it runs batched or alone.
#include "q12_meta.cuh"

#define ROPE_MAX_HALF 512      // rotary_dim <= 1024
#define ROPE_SMEM_ANGLES 2048  // G * half angles per iteration
#define ROPE_PREFETCH 2        // units per thread loaded before the angle phase

namespace {

__device__ __forceinline__ int rope_axis(int j, int mode, int sec_t, int sec_h, int sec_w) {
    if (mode == 1) {
        if (j < sec_t) return 0;
        if (j < sec_t + sec_h) return 1;
        return 2;
    }
    if (mode == 2) {
        const int r = j % 3;
        if (r == 1 && j < 3 * sec_h) return 1;
        if (r == 2 && j < 3 * sec_w) return 2;
        return 0;
    }
    return 0;
}

__device__ __forceinline__ void rotate(float x1, float x2, float c, float s, float& y1, float& y2) {
    y1 = fmaf(x1, c, -(x2 * s));
    y2 = fmaf(x2, c, x1 * s);
}

__device__ __forceinline__ unsigned int rot_pack(unsigned int a, unsigned int b, float c0, float s0, float c1,
                                                 float s1, unsigned int& b_out) {
    // a holds (x1[j], x1[j+1]), b holds (x2[j], x2[j+1]) as bf16x2 (low half = lower index).
    const float2 fa = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&a));
    const float2 fb = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&b));
    float ya0, yb0, ya1, yb1;
    rotate(fa.x, fb.x, c0, s0, ya0, yb0);
    rotate(fa.y, fb.y, c1, s1, ya1, yb1);
    const __nv_bfloat162 ra = __floats2bfloat162_rn(ya0, ya1);
    const __nv_bfloat162 rb = __floats2bfloat162_rn(yb0, yb1);
    b_out = *reinterpret_cast<const unsigned int*>(&rb);
    return *reinterpret_cast<const unsigned int*>(&ra);
}

// One unit's data: 8 pairs as two 16-byte vectors, or one pair.
template <bool VEC>
struct UnitData;
template <>
struct UnitData<true> {
    uint4 a, b;
};
template <>
struct UnitData<false> {
    bf16 a, b;
};

template <bool VEC>
__device__ __forceinline__ void load_unit(UnitData<VEC>& d, const bf16* row, int jj, int half) {
    if constexpr (VEC) {
        d.a = *reinterpret_cast<const uint4*>(row + jj);
        d.b = *reinterpret_cast<const uint4*>(row + half + jj);
    } else {
        d.a = row[jj];
        d.b = row[half + jj];
    }
}

template <bool VEC>
__device__ __forceinline__ void rotate_unit(const UnitData<VEC>& d, const float* cs, const float* sn, int half,
                                            bf16* row, int jj) {
    if constexpr (VEC) {
        uint4 oa, ob;
        oa.x = rot_pack(d.a.x, d.b.x, cs[0], sn[0], cs[1], sn[1], ob.x);
        oa.y = rot_pack(d.a.y, d.b.y, cs[2], sn[2], cs[3], sn[3], ob.y);
        oa.z = rot_pack(d.a.z, d.b.z, cs[4], sn[4], cs[5], sn[5], ob.z);
        oa.w = rot_pack(d.a.w, d.b.w, cs[6], sn[6], cs[7], sn[7], ob.w);
        *reinterpret_cast<uint4*>(row + jj) = oa;
        *reinterpret_cast<uint4*>(row + half + jj) = ob;
    } else {
        float y1, y2;
        rotate(__bfloat162float(d.a), __bfloat162float(d.b), cs[0], sn[0], y1, y2);
        row[jj] = __float2bfloat16_rn(y1);
        row[half + jj] = __float2bfloat16_rn(y2);
    }
}

template <bool VEC>
__device__ __forceinline__ void rope_body(const Q12Meta& m, bf16* __restrict__ q, bf16* __restrict__ k, int hq,
                                          int hkv, int head_dim, int half, int mode, float* s_inv,
                                          unsigned char* s_axis, float* s_cos, float* s_sin) {
    const int total_tokens = (int)m.total_tokens;
    const int vw = VEC ? 8 : 1;
    const int units_per_head = half / vw;
    const int units_per_token = (hq + hkv) * units_per_head;
    int g = ROPE_PREFETCH * (int)blockDim.x / units_per_token;
    if (g < 1) g = 1;
    if (g > ROPE_SMEM_ANGLES / half) g = ROPE_SMEM_ANGLES / half;
    const int n_angles = g * half;
    const int n_units = g * units_per_token;
    const unsigned int* pos_t = q12_positions(m, 0);
    // positions_h / positions_w are only dereferenced when some s(j) selects them (mode != 0).
    const unsigned int* pos_h = q12_positions(m, 1);
    const unsigned int* pos_w = q12_positions(m, 2);
    long long t0 = (long long)blockIdx.x * g;
    // Unit u of the current token group -> (token in group, first pair index, head row); false
    // past the last token.
    auto locate = [&](int u, int& tg, int& jj, bf16*& row) -> bool {
        tg = u / units_per_token;
        const int r = u - tg * units_per_token;
        const long long t = t0 + tg;
        if (t >= total_tokens) return false;
        const int h = r / units_per_head;
        jj = (r - h * units_per_head) * vw;
        row = h < hq ? q + (t * hq + h) * (long long)head_dim : k + (t * hkv + (h - hq)) * (long long)head_dim;
        return true;
    };

    for (; t0 < total_tokens; t0 += (long long)gridDim.x * g) {
        // Prefetch this thread's first ROPE_PREFETCH units so their loads overlap phase 1.
        int tgp[ROPE_PREFETCH], jjp[ROPE_PREFETCH];
        bf16* rowp[ROPE_PREFETCH];
        bool have[ROPE_PREFETCH];
        UnitData<VEC> pre[ROPE_PREFETCH];
#pragma unroll
        for (int p = 0; p < ROPE_PREFETCH; ++p) {
            const int u = (int)threadIdx.x + p * (int)blockDim.x;
            have[p] = u < n_units && locate(u, tgp[p], jjp[p], rowp[p]);
            if (have[p]) load_unit<VEC>(pre[p], rowp[p], jjp[p], half);
        }
        // Phase 1: angles of the G tokens, once per (token, frequency).
        for (int i = threadIdx.x; i < n_angles; i += blockDim.x) {
            const int tg = i / half;
            const int j = i - tg * half;
            const long long t = t0 + tg;
            if (t < total_tokens) {
                const int ax = s_axis[j];
                const unsigned int p = __ldg(ax == 0 ? pos_t + t : (ax == 1 ? pos_h + t : pos_w + t));
                const float ang = __uint2float_rn(p) * s_inv[j];
                float sv, cv;
                sincosf(ang, &sv, &cv);
                s_cos[i] = cv;
                s_sin[i] = sv;
            }
        }
        __syncthreads();
        // Phase 2: rotate (the prefetched units first).
#pragma unroll
        for (int p = 0; p < ROPE_PREFETCH; ++p) {
            if (have[p]) {
                const int o = tgp[p] * half + jjp[p];
                rotate_unit<VEC>(pre[p], s_cos + o, s_sin + o, half, rowp[p], jjp[p]);
            }
        }
        for (int u = threadIdx.x + ROPE_PREFETCH * blockDim.x; u < n_units; u += blockDim.x) {
            int tg, jj;
            bf16* row;
            if (!locate(u, tg, jj, row)) continue;
            UnitData<VEC> d;
            load_unit<VEC>(d, row, jj, half);
            rotate_unit<VEC>(d, s_cos + tg * half + jj, s_sin + tg * half + jj, half, row, jj);
        }
        __syncthreads();
    }
}

}  // namespace

extern "C" __global__ void q12_rope(Q12Meta m, bf16* __restrict__ q, bf16* __restrict__ k, int num_q_heads, int num_kv_heads, int head_dim, int rotary_dim, float theta, int mrope_mode, int sec_t, int sec_h, int sec_w) {
    __shared__ float s_inv[ROPE_MAX_HALF];
    __shared__ unsigned char s_axis[ROPE_MAX_HALF];
    __shared__ __align__(16) float s_cos[ROPE_SMEM_ANGLES];
    __shared__ __align__(16) float s_sin[ROPE_SMEM_ANGLES];

    if (rotary_dim <= 0 || num_q_heads + num_kv_heads <= 0) return;
    const int half = rotary_dim >> 1;
    // The host validates these; a bad launch fails loudly instead of writing garbage.
    if ((rotary_dim & 1) || rotary_dim > head_dim || half > ROPE_MAX_HALF || mrope_mode < 0 || mrope_mode > 2 ||
        num_q_heads < 0 || num_kv_heads < 0) {
        __trap();
    }
    // Per-CTA tables: inverse frequencies (HF's fp32 chain, power in double) and the section map.
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        const float e = (float)(2 * j) / (float)rotary_dim;
        const float p = (float)pow((double)theta, (double)e);
        s_inv[j] = 1.0f / p;
        s_axis[j] = (unsigned char)rope_axis(j, mrope_mode, sec_t, sec_h, sec_w);
    }
    __syncthreads();

    const unsigned long long addr_bits = (unsigned long long)q | (unsigned long long)k;
    if ((rotary_dim & 15) == 0 && (head_dim & 7) == 0 && (addr_bits & 15ull) == 0) {
        rope_body<true>(m, q, k, num_q_heads, num_kv_heads, head_dim, half, mrope_mode, s_inv, s_axis, s_cos,
                        s_sin);
    } else {
        rope_body<false>(m, q, k, num_q_heads, num_kv_heads, head_dim, half, mrope_mode, s_inv, s_axis, s_cos,
                         s_sin);
    }
}
