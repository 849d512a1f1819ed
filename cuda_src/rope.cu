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
// x[half+j0..]), 8 rotations, two 16-byte stores; only the rotary dims are touched. Every warp
// works alone (no CTA-wide barrier in the loop): it takes G consecutive tokens per iteration
// (G = max(1, 32 * ROPE_UPL / units_per_token), capped by its share of the angle buffer) and
// walks the tokens with a grid stride over warps, so any grid covers T = m.total_tokens. Per
// iteration a lane
//   1. issues the loads of its first ROPE_UPL units (units lane, lane + 32, ...: 6 x 16 B in
//      flight; their (token, head, pair) split is loop-invariant, computed once per thread, so
//      the loop has no integer division),
//   2. meanwhile computes the G * half angles of the warp's tokens (positions read once per
//      (token, frequency), sincosf once per (token, frequency), shared by all Hq + Hkv heads)
//      into the warp's slice of shared memory, __syncwarp,
//   3. rotates and stores its units; units past 32 * ROPE_UPL (more than 128 units per token,
//      e.g. Qwen2-VL's 32 heads x rd 128) follow in batches of ROPE_UPL (mapped by division).
// With many warps per SM at different phases, loads, sincosf and stores overlap.
// A warp's slice holds ROPE_SMEM_ANGLES / warps_per_block angles; when half
// exceeds it (only blocks of more than 256 threads with rotary_dim > 2 * 4096 / warps), each
// unit computes its own sincosf (same bits, slower).
// When the layout does not allow 16-byte accesses (rotary_dim % 16, head_dim % 8 or a pointer
// not 16-byte aligned) a unit is one pair with 2-byte accesses: same math, same results.
// Cache hints: loads ld.global.L1::no_allocate (each element is read once; the kernel works in
// place, so not the read-only .nc path); plain write-back stores (attention and the KV write
// read Q and K next), or st.global.cs with -DROPE_STORE_CS=1.
// __launch_bounds__(512, 1): <= 128 registers so 512-thread blocks launch; the new kernel takes
// about 112 (below that ptxas spills), so 2 CTAs of 256 threads are resident per SM and
// rope.geometry() sizes a persistent grid of that many (16 warps per SM).
// Variant knobs (A/B builds, tests/gpu/rope_variants.py; every build gives the same bits):
// ROPE_UPL (units per lane per round, 3), ROPE_STORE_CS, ROPE_ANGLES_FIRST=1 (angles before the
// loads instead of overlapping them), ROPE_MAX_THREADS / ROPE_MIN_BLOCKS (the launch bounds,
// 512 / 1; e.g. 256 / 3 caps registers at 80 for 3 CTAs of 256 per SM). Registers on sm_90
// (NVRTC 13): UPL 1: 72, 2: 90, 3: 112, 5: 128; UPL 2 at (256, 3): 80, all without spills.
// -DROPE_LEGACY=1 compiles the previous kernel (CTA-wide token groups, two __syncthreads per
// iteration, 2 units prefetched per thread; <= 85 registers, 3 CTAs of 256 per SM) for A/B runs.
// Everything is per token (no cross-token arithmetic): a stream's rows come out identical
// whether it runs batched or alone, whatever the grid or block size.
// Measured on the H200 (tests/GPU.md session 2, 4 runs; 64k tokens, cold L2): Hq 16, Hkv 2, D 256,
// rotary_dim 64: 103-118 us = 61-69% of the floor (302 MB at 4.23 TB/s), legacy 123-138 us, eager torch
// 2.1 ms; a contiguous D2D copy of the same byte count takes 79-88 us, so moving 128 bytes out of every
// 512 costs about a fifth. Full rotary (Hq 32, Hkv 8, D 128, rd 128): 355-382 us = 83-89%. All variants
// (ROPE_ANGLES_FIRST, ROPE_UPL 2/5, 512 threads, 3-4 CTAs/SM, streaming stores) land within the
// +-10% run-to-run spread of each other.
#include "common/q12_meta.cuh"

#ifndef ROPE_LEGACY
#define ROPE_LEGACY 0
#endif
#ifndef ROPE_STORE_CS
#define ROPE_STORE_CS 0
#endif
#ifndef ROPE_ANGLES_FIRST
#define ROPE_ANGLES_FIRST 0
#endif
#ifndef ROPE_MAX_THREADS
#define ROPE_MAX_THREADS 512
#endif
#ifndef ROPE_MIN_BLOCKS
#define ROPE_MIN_BLOCKS 1
#endif
#define ROPE_MAX_HALF 512  // rotary_dim <= 1024
#if ROPE_LEGACY
#define ROPE_SMEM_ANGLES 2048  // G * half angles per iteration
#define ROPE_PREFETCH 2        // units per thread loaded before the angle phase
#else
#define ROPE_SMEM_ANGLES 4096  // cos (and sin) floats per CTA, split evenly among its warps
#ifndef ROPE_UPL
#define ROPE_UPL 3  // units a lane loads before it rotates any (Qwen3-Next: 72 units per token, one round)
#endif
#endif

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

#if ROPE_LEGACY
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

#endif

#if !ROPE_LEGACY
__device__ __forceinline__ void ld_na(uint4& d, const bf16* p) {
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(d.x), "=r"(d.y), "=r"(d.z), "=r"(d.w)
                 : "l"(p));
}
__device__ __forceinline__ void ld_na(bf16& d, const bf16* p) {
    unsigned short u;
    asm volatile("ld.global.L1::no_allocate.u16 %0, [%1];" : "=h"(u) : "l"(p));
    d = __ushort_as_bfloat16(u);
}
__device__ __forceinline__ void st_out(bf16* p, const uint4& d) {
#if ROPE_STORE_CS
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d.x), "r"(d.y), "r"(d.z), "r"(d.w)
                 : "memory");
#else
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d.x), "r"(d.y), "r"(d.z), "r"(d.w)
                 : "memory");
#endif
}
__device__ __forceinline__ void st_out(bf16* p, bf16 v) {
    const unsigned short u = __bfloat16_as_ushort(v);
#if ROPE_STORE_CS
    asm volatile("st.global.cs.u16 [%0], %1;" ::"l"(p), "h"(u) : "memory");
#else
    asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(u) : "memory");
#endif
}

// cos/sin of frequency j of token t (the one formula; every path calls it).
__device__ __forceinline__ void angle_cs(const Q12Meta& m, long long t, int j, const float* s_inv,
                                         const unsigned char* s_axis, float& c, float& s) {
    const unsigned int p = __ldg(q12_positions(m, s_axis[j]) + t);
    const float ang = __uint2float_rn(p) * s_inv[j];
    sincosf(ang, &s, &c);
}

// Where unit u of a warp's token group lives, packed in two registers: ct = (token in group << 16)
// | first pair index jj (ct = -1: no such unit), off = element offset of x1 inside the token's Q
// rows (off >= 0) or ~offset inside its K rows (off < 0).
struct UnitMap {
    int ct;
    int off;
    __device__ __forceinline__ int tg() const { return ct >> 16; }
    __device__ __forceinline__ int jj() const { return ct & 0xffff; }
    __device__ __forceinline__ bool valid() const { return ct >= 0; }
    __device__ __forceinline__ bf16* row(bf16* q, bf16* k, long long t, long long q_tok, long long k_tok) const {
        return off >= 0 ? q + t * q_tok + off : k + t * k_tok + ~off;
    }
};

__device__ __forceinline__ UnitMap map_unit(int u, int n_units, int upt, int upc, int vw, int hq, int head_dim) {
    UnitMap mp;
    if (u >= n_units) {
        mp.ct = -1;
        mp.off = 0;
        return mp;
    }
    const int tg = u / upt;
    const int r = u - tg * upt;
    const int h = r / upc;
    const int jj = (r - h * upc) * vw;
    mp.ct = (tg << 16) | jj;
    mp.off = h < hq ? h * head_dim + jj : ~((h - hq) * head_dim + jj);
    return mp;
}

template <bool VEC>
__device__ __forceinline__ void load_unit_na(UnitData<VEC>& d, const bf16* row, int half) {
    if constexpr (VEC) {
        ld_na(d.a, row);
        ld_na(d.b, row + half);
    } else {
        ld_na(d.a, row);
        ld_na(d.b, row + half);
    }
}

// Rotate one unit with its cos/sin (vw values each) and store it.
template <bool VEC>
__device__ __forceinline__ void rotate_store(const UnitData<VEC>& d, const float* cs, const float* sn, bf16* row,
                                             int half) {
    if constexpr (VEC) {
        uint4 oa, ob;
        oa.x = rot_pack(d.a.x, d.b.x, cs[0], sn[0], cs[1], sn[1], ob.x);
        oa.y = rot_pack(d.a.y, d.b.y, cs[2], sn[2], cs[3], sn[3], ob.y);
        oa.z = rot_pack(d.a.z, d.b.z, cs[4], sn[4], cs[5], sn[5], ob.z);
        oa.w = rot_pack(d.a.w, d.b.w, cs[6], sn[6], cs[7], sn[7], ob.w);
        st_out(row, oa);
        st_out(row + half, ob);
    } else {
        float y1, y2;
        rotate(__bfloat162float(d.a), __bfloat162float(d.b), cs[0], sn[0], y1, y2);
        st_out(row, __float2bfloat16_rn(y1));
        st_out(row + half, __float2bfloat16_rn(y2));
    }
}

// cos/sin of the unit's vw frequencies from the warp's table.
template <bool VEC>
__device__ __forceinline__ void unit_cs(int tg, int jj, int half, const float* w_cos, const float* w_sin, float* cs,
                                        float* sn) {
    if constexpr (VEC) {
        const float4* c4 = reinterpret_cast<const float4*>(w_cos + tg * half + jj);
        const float4* s4 = reinterpret_cast<const float4*>(w_sin + tg * half + jj);
        const float4 c0 = c4[0], c1 = c4[1], s0 = s4[0], s1 = s4[1];
        cs[0] = c0.x; cs[1] = c0.y; cs[2] = c0.z; cs[3] = c0.w;
        cs[4] = c1.x; cs[5] = c1.y; cs[6] = c1.z; cs[7] = c1.w;
        sn[0] = s0.x; sn[1] = s0.y; sn[2] = s0.z; sn[3] = s0.w;
        sn[4] = s1.x; sn[5] = s1.y; sn[6] = s1.z; sn[7] = s1.w;
    } else {
        cs[0] = w_cos[tg * half + jj];
        sn[0] = w_sin[tg * half + jj];
    }
}

// The rare case of a warp slice too small for one token's angles: one unit at a time, each
// computing its own vw sincosf (same formula, same bits). Kept out of line and simple.
template <bool VEC>
__device__ __forceinline__ void rope_direct(const Q12Meta& m, bf16* q, bf16* k, int hq, int hkv, int head_dim,
                                         int half, const float* s_inv, const unsigned char* s_axis) {
    constexpr int vw = VEC ? 8 : 1;
    const int total_tokens = (int)m.total_tokens;
    const int upc = half / vw;
    const int upt = (hq + hkv) * upc;
    const int warps = (int)blockDim.x >> 5;
    const int lane = (int)threadIdx.x & 31;
    const long long q_tok = (long long)hq * head_dim, k_tok = (long long)hkv * head_dim;
    for (long long t = (long long)blockIdx.x * warps + ((int)threadIdx.x >> 5); t < total_tokens;
         t += (long long)gridDim.x * warps) {
#pragma unroll 1
        for (int u = lane; u < upt; u += 32) {
            const UnitMap mp = map_unit(u, upt, upt, upc, vw, hq, head_dim);
            bf16* row = mp.row(q, k, t, q_tok, k_tok);
            UnitData<VEC> d;
            load_unit_na<VEC>(d, row, half);
            float cs[vw], sn[vw];
            for (int e = 0; e < vw; ++e) angle_cs(m, t, mp.jj() + e, s_inv, s_axis, cs[e], sn[e]);
            rotate_store<VEC>(d, cs, sn, row, half);
        }
    }
}

template <bool VEC>
__device__ __forceinline__ void rope_warps(const Q12Meta& m, bf16* __restrict__ q, bf16* __restrict__ k, int hq,
                                           int hkv, int head_dim, int half, const float* s_inv,
                                           const unsigned char* s_axis, float* s_cos, float* s_sin) {
    constexpr int vw = VEC ? 8 : 1;
    const int total_tokens = (int)m.total_tokens;
    const int upc = half / vw;  // units per head
    const int upt = (hq + hkv) * upc;
    const int warps = (int)blockDim.x >> 5;
    const int warp = (int)threadIdx.x >> 5;
    const int lane = (int)threadIdx.x & 31;
    if (warp >= warps) return;  // a partial trailing warp (the host never launches so)
    const int cap = ROPE_SMEM_ANGLES / warps;  // this warp's angles
    if (half > cap) {
        rope_direct<VEC>(m, q, k, hq, hkv, head_dim, half, s_inv, s_axis);
        return;
    }
    int g = (32 * ROPE_UPL) / upt;
    if (g < 1) g = 1;
    if (g > cap / half) g = cap / half;
    const int n_units = g * upt;
    const int n_angles = g * half;
    float* w_cos = s_cos + warp * cap;
    float* w_sin = s_sin + warp * cap;
    const long long q_tok = (long long)hq * head_dim, k_tok = (long long)hkv * head_dim;

    // Loop-invariant split of this lane's first ROPE_UPL units, and of its first angle.
    UnitMap mp[ROPE_UPL];
#pragma unroll
    for (int p = 0; p < ROPE_UPL; ++p) mp[p] = map_unit(lane + 32 * p, n_units, upt, upc, vw, hq, head_dim);
    const int a_tg0 = lane / half, a_j0 = lane - (lane / half) * half;
    const int a_dtg = 32 / half, a_dj = 32 - (32 / half) * half;

    const long long gw = (long long)blockIdx.x * warps + warp;
    const long long step = (long long)gridDim.x * warps * g;
    for (long long t0 = gw * g; t0 < total_tokens; t0 += step) {
#if ROPE_ANGLES_FIRST
        // 2. the group's angles, once per (token, frequency)
        {
            int tg = a_tg0, j = a_j0;
#pragma unroll 1
            for (int i = lane; i < n_angles; i += 32) {
                if (t0 + tg < total_tokens) {
                    float c, s;
                    angle_cs(m, t0 + tg, j, s_inv, s_axis, c, s);
                    w_cos[i] = c;
                    w_sin[i] = s;
                }
                tg += a_dtg;
                j += a_dj;
                if (j >= half) {
                    j -= half;
                    ++tg;
                }
            }
            __syncwarp();
        }
        // 1. loads of the first ROPE_UPL units (after the angles: fewer live registers)
        UnitData<VEC> d[ROPE_UPL];
#pragma unroll
        for (int p = 0; p < ROPE_UPL; ++p) {
            if (mp[p].valid() && t0 + mp[p].tg() < total_tokens)
                load_unit_na<VEC>(d[p], mp[p].row(q, k, t0 + mp[p].tg(), q_tok, k_tok), half);
        }
#else
        // 1. loads of the first ROPE_UPL units (in flight while the angles are computed)
        UnitData<VEC> d[ROPE_UPL];
#pragma unroll
        for (int p = 0; p < ROPE_UPL; ++p) {
            if (mp[p].valid() && t0 + mp[p].tg() < total_tokens)
                load_unit_na<VEC>(d[p], mp[p].row(q, k, t0 + mp[p].tg(), q_tok, k_tok), half);
        }
        // 2. the group's angles, once per (token, frequency)
        {
            int tg = a_tg0, j = a_j0;
#pragma unroll 1
            for (int i = lane; i < n_angles; i += 32) {
                if (t0 + tg < total_tokens) {
                    float c, s;
                    angle_cs(m, t0 + tg, j, s_inv, s_axis, c, s);
                    w_cos[i] = c;
                    w_sin[i] = s;
                }
                tg += a_dtg;
                j += a_dj;
                if (j >= half) {
                    j -= half;
                    ++tg;
                }
            }
            __syncwarp();
        }
#endif
        // 3. rotate and store
#pragma unroll
        for (int p = 0; p < ROPE_UPL; ++p) {
            if (mp[p].valid() && t0 + mp[p].tg() < total_tokens) {
                float cs[vw], sn[vw];
                unit_cs<VEC>(mp[p].tg(), mp[p].jj(), half, w_cos, w_sin, cs, sn);
                rotate_store<VEC>(d[p], cs, sn, mp[p].row(q, k, t0 + mp[p].tg(), q_tok, k_tok), half);
            }
        }
#pragma unroll 1
        for (int ub = 32 * ROPE_UPL; ub < n_units; ub += 32 * ROPE_UPL) {
            UnitMap mq[ROPE_UPL];
            UnitData<VEC> e[ROPE_UPL];
#pragma unroll
            for (int p = 0; p < ROPE_UPL; ++p) {
                mq[p] = map_unit(ub + lane + 32 * p, n_units, upt, upc, vw, hq, head_dim);
                if (mq[p].valid() && t0 + mq[p].tg() < total_tokens)
                    load_unit_na<VEC>(e[p], mq[p].row(q, k, t0 + mq[p].tg(), q_tok, k_tok), half);
            }
#pragma unroll
            for (int p = 0; p < ROPE_UPL; ++p) {
                if (mq[p].valid() && t0 + mq[p].tg() < total_tokens) {
                    float cs[vw], sn[vw];
                    unit_cs<VEC>(mq[p].tg(), mq[p].jj(), half, w_cos, w_sin, cs, sn);
                    rotate_store<VEC>(e[p], cs, sn, mq[p].row(q, k, t0 + mq[p].tg(), q_tok, k_tok), half);
                }
            }
        }
        __syncwarp();  // every lane is done with the angles before they are overwritten
    }
}
#endif

}  // namespace

extern "C" __global__ __launch_bounds__(ROPE_MAX_THREADS, ROPE_MIN_BLOCKS) void q12_rope(Q12Meta m, bf16* __restrict__ q, bf16* __restrict__ k, int num_q_heads, int num_kv_heads, int head_dim, int rotary_dim, float theta, int mrope_mode, int sec_t, int sec_h, int sec_w) {
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
    const bool vec = (rotary_dim & 15) == 0 && (head_dim & 7) == 0 && (addr_bits & 15ull) == 0;
#if ROPE_LEGACY
    if (vec) {
        rope_body<true>(m, q, k, num_q_heads, num_kv_heads, head_dim, half, mrope_mode, s_inv, s_axis, s_cos,
                        s_sin);
    } else {
        rope_body<false>(m, q, k, num_q_heads, num_kv_heads, head_dim, half, mrope_mode, s_inv, s_axis, s_cos,
                         s_sin);
    }
#else
    if (vec) {
        rope_warps<true>(m, q, k, num_q_heads, num_kv_heads, head_dim, half, s_inv, s_axis, s_cos, s_sin);
    } else {
        rope_warps<false>(m, q, k, num_q_heads, num_kv_heads, head_dim, half, s_inv, s_axis, s_cos, s_sin);
    }
#endif
}
