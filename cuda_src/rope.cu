// rope.cu: RoPE / MRoPE (NeoX pairing) in place on packed Q [T, Hq, D] and K [T, Hkv, D], bf16.
//
// Math (per token t, per frequency j < half = rotary_dim / 2; dims >= rotary_dim untouched):
//   inv_freq[j] = 1 / fl32(theta ^ e_j), e_j = fl32(2j / rotary_dim)   (HF's fp32 chain; the power
//                 is evaluated in double and rounded once to fp32, so host and device agree),
//                 or the caller's table (scaled RoPE: RopeTable below)
//   angle      = fl32((float)pos_{s(j)}[t] * inv_freq[j])
//   (c, s)     = sincosf(angle) * attention_factor                      (precise, |angle| ~ 1e6; the factor is
//                                                                        1 without a table)
//   x1 = x[j], x2 = x[j + half]:
//   x1' = fma(x1, c, -(x2 * s)),  x2' = fma(x2, c, x1 * s)              (fp32, one bf16 rounding)
// Position stream s(j) in {0 = T, 1 = H, 2 = W}, read as q12_positions(m, s(j))[t]:
//   mrope_mode 0: plain RoPE, always T (positions_h / positions_w are never read)
//   mrope_mode 1: chunked sections (Qwen2-VL): T for j < sec_t, H for j < sec_t + sec_h, else W
//   mrope_mode 2: interleaved (Qwen3-VL, Qwen3.5): H if j%3==1 && j < 3*sec_h,
//                 W if j%3==2 && j < 3*sec_w, else T
// HF rounds cos/sin to bf16 before multiplying; this kernel keeps them fp32 (more accurate).
//
// Work split: a "unit" = (token, head, vec_pairs = 8 consecutive pairs): two 16-byte loads
// (x[j0..j0+7] and x[half+j0..]), 8 rotations, two 16-byte stores; only the rotary dims are touched.
// Every warp works alone (no CTA-wide barrier in the loop): it takes G consecutive tokens per
// iteration (G = max(1, 32 * units_per_lane / units_per_token), capped by its share of the angle
// buffer) and walks the tokens with a grid stride over warps, so any grid covers T = m.total_tokens.
// Per iteration a lane
//   1. issues the loads of its first units_per_lane units (units lane, lane + 32, ...: 6 x 16 B in
//      flight; their (token, head, pair) split is loop-invariant, computed once per thread, so
//      the loop has no integer division),
//   2. meanwhile computes the G * half angles of the warp's tokens (positions read once per
//      (token, frequency), sincosf once per (token, frequency), shared by all Hq + Hkv heads)
//      into the warp's slice of shared memory, __syncwarp,
//   3. rotates and stores its units; units past 32 * units_per_lane (more than 96 units per token,
//      e.g. Qwen2-VL's 32 heads x rd 128) follow in batches of units_per_lane (mapped by division).
// With many warps per SM at different phases, loads, sincosf and stores overlap.
// A warp's slice holds smem_angles / warps_per_block angles; when half exceeds it (only blocks of
// more than 256 threads with rotary_dim > 2 * 4096 / warps), each unit computes its own sincosf
// (same bits, slower).
// When the layout does not allow 16-byte accesses (rotary_dim % 16, head_dim % 8 or a pointer
// not 16-byte aligned) a unit is one pair with 2-byte accesses: same math, same results.
// Cache hints: loads ld.global.L1::no_allocate (each element is read once; the kernel works in
// place, so not the read-only .nc path); plain write-back stores (attention and the KV write
// read Q and K next).
// __launch_bounds__(512, 1): <= 128 registers a thread, so 512-thread blocks launch and
// Q12_ROPE_CTAS_PER_SM = 2 CTAs of Q12_ROPE_THREADS = 256 threads are resident per SM, which the
// host's persistent grid (rope.geometry()) assumes (16 warps per SM; ptxas takes 112 registers).
// Everything is per token (no cross-token arithmetic): a stream's rows come out identical
// whether it runs batched or alone, whatever the grid or block size.
//
// Host/device contract (q12drv/kernels/rope.py CONTRACTS, passed as -D by registry.compile_defines and
// checked below against rope_config()): Q12_ROPE_THREADS, Q12_ROPE_CTAS_PER_SM, Q12_ROPE_MAX_THREADS,
// Q12_ROPE_MAX_ROTARY_DIM, Q12_ROPE_SMEM_ANGLES, Q12_ROPE_UNITS_PER_LANE, Q12_ROPE_VEC_PAIRS.
// What was tried instead and what it measured: docs/kernels/rope.md.
#include "common/q12_meta.cuh"

// The kernel's configuration: every number its code and the host's launch geometry use.
struct RopeConfig {
    int max_threads;     // __launch_bounds__: the largest block
    int min_blocks;      // __launch_bounds__: resident CTAs of max_threads per SM
    int max_half;        // frequencies the per-CTA tables hold (rotary_dim <= 2 * max_half)
    int smem_angles;     // cos (and sin) floats per CTA, split evenly among its warps
    int units_per_lane;  // units a lane loads before it rotates any (Qwen3-Next: 72 units per token, one round)
    int vec_pairs;       // pairs in a unit of the 16-byte path
};
__host__ __device__ constexpr RopeConfig rope_config() { return {512, 1, 512, 4096, 3, 8}; }

#if !defined(Q12_ROPE_THREADS) || !defined(Q12_ROPE_CTAS_PER_SM) || !defined(Q12_ROPE_MAX_THREADS) ||  \
    !defined(Q12_ROPE_MAX_ROTARY_DIM) || !defined(Q12_ROPE_SMEM_ANGLES) || !defined(Q12_ROPE_UNITS_PER_LANE) || \
    !defined(Q12_ROPE_VEC_PAIRS) || !defined(Q12_ROPE_TABLE_FREQS) || !defined(Q12_ROPE_TABLE_BYTES)
#error "compile through q12drv (registry.compile_defines): it passes the host's Q12_ROPE_* contract defines"
#endif
static_assert(Q12_ROPE_MAX_THREADS == rope_config().max_threads, "rope.MAX_THREADS differs from the launch bounds");
static_assert(Q12_ROPE_THREADS % 32 == 0 && Q12_ROPE_THREADS <= rope_config().max_threads,
              "rope.THREADS must be whole warps within the launch bounds");
static_assert(Q12_ROPE_THREADS * Q12_ROPE_CTAS_PER_SM <= rope_config().max_threads * rope_config().min_blocks,
              "rope's persistent grid assumes more resident threads per SM than the launch bounds guarantee");
static_assert(Q12_ROPE_MAX_ROTARY_DIM == 2 * rope_config().max_half, "rope.MAX_ROTARY_DIM differs from the tables");
static_assert(Q12_ROPE_SMEM_ANGLES == rope_config().smem_angles, "rope's angle buffer differs from the kernel's");
static_assert(Q12_ROPE_UNITS_PER_LANE == rope_config().units_per_lane,
              "rope's units per lane differ from the kernel's");
static_assert(Q12_ROPE_VEC_PAIRS == rope_config().vec_pairs && rope_config().vec_pairs * 2 == 16,
              "rope's unit is 8 bf16 pairs (two 16-byte accesses)");
static_assert(Q12_ROPE_TABLE_FREQS <= rope_config().max_half, "a frequency table longer than the per-CTA tables");

// Scaled rotary embeddings (linear, NTK, YaRN, llama3, longrope, ...): a caller-given table of inverse
// frequencies and the factor cos and sin are multiplied by (transformers' attention_scaling). size 0: no table
// (inv_freq from theta, factor 1); else size == rotary_dim / 2. Mirrored by q12drv.kernels.rope.RopeTableC.
struct RopeTable {
    float inv_freq[Q12_ROPE_TABLE_FREQS];
    float attention_factor;
    int size;
};
static_assert(sizeof(RopeTable) == Q12_ROPE_TABLE_BYTES, "RopeTable differs from the host mirror");

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
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d.x), "r"(d.y), "r"(d.z), "r"(d.w)
                 : "memory");
}
__device__ __forceinline__ void st_out(bf16* p, bf16 v) {
    const unsigned short u = __bfloat16_as_ushort(v);
    asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(u) : "memory");
}

// cos/sin of frequency j of token t, times the table's attention factor af (1 without a table: exact), the one
// formula every path calls.
__device__ __forceinline__ void angle_cs(const Q12Meta& m, long long t, int j, const float* s_inv,
                                         const unsigned char* s_axis, float af, float& c, float& s) {
    const unsigned int p = __ldg(q12_positions(m, s_axis[j]) + t);
    const float ang = __uint2float_rn(p) * s_inv[j];
    sincosf(ang, &s, &c);
    c *= af;
    s *= af;
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
    ld_na(d.a, row);
    ld_na(d.b, row + half);
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
                                         int half, const float* s_inv, const unsigned char* s_axis, float af) {
    constexpr int vw = VEC ? rope_config().vec_pairs : 1;
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
            for (int e = 0; e < vw; ++e) angle_cs(m, t, mp.jj() + e, s_inv, s_axis, af, cs[e], sn[e]);
            rotate_store<VEC>(d, cs, sn, row, half);
        }
    }
}

template <bool VEC>
__device__ __forceinline__ void rope_warps(const Q12Meta& m, bf16* __restrict__ q, bf16* __restrict__ k, int hq,
                                           int hkv, int head_dim, int half, const float* s_inv,
                                           const unsigned char* s_axis, float af, float* s_cos, float* s_sin) {
    constexpr int vw = VEC ? rope_config().vec_pairs : 1;
    constexpr int upl = rope_config().units_per_lane;
    const int total_tokens = (int)m.total_tokens;
    const int upc = half / vw;  // units per head
    const int upt = (hq + hkv) * upc;
    const int warps = (int)blockDim.x >> 5;
    const int warp = (int)threadIdx.x >> 5;
    const int lane = (int)threadIdx.x & 31;
    if (warp >= warps) return;  // a partial trailing warp (the host never launches so)
    const int cap = rope_config().smem_angles / warps;  // this warp's angles
    if (half > cap) {
        rope_direct<VEC>(m, q, k, hq, hkv, head_dim, half, s_inv, s_axis, af);
        return;
    }
    int g = (32 * upl) / upt;
    if (g < 1) g = 1;
    if (g > cap / half) g = cap / half;
    const int n_units = g * upt;
    const int n_angles = g * half;
    float* w_cos = s_cos + warp * cap;
    float* w_sin = s_sin + warp * cap;
    const long long q_tok = (long long)hq * head_dim, k_tok = (long long)hkv * head_dim;

    // Loop-invariant split of this lane's first upl units, and of its first angle.
    UnitMap mp[upl];
#pragma unroll
    for (int p = 0; p < upl; ++p) mp[p] = map_unit(lane + 32 * p, n_units, upt, upc, vw, hq, head_dim);
    const int a_tg0 = lane / half, a_j0 = lane - (lane / half) * half;
    const int a_dtg = 32 / half, a_dj = 32 - (32 / half) * half;

    const long long gw = (long long)blockIdx.x * warps + warp;
    const long long step = (long long)gridDim.x * warps * g;
    for (long long t0 = gw * g; t0 < total_tokens; t0 += step) {
        // 1. loads of the first upl units (in flight while the angles are computed)
        UnitData<VEC> d[upl];
#pragma unroll
        for (int p = 0; p < upl; ++p) {
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
                    angle_cs(m, t0 + tg, j, s_inv, s_axis, af, c, s);
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
        // 3. rotate and store
#pragma unroll
        for (int p = 0; p < upl; ++p) {
            if (mp[p].valid() && t0 + mp[p].tg() < total_tokens) {
                float cs[vw], sn[vw];
                unit_cs<VEC>(mp[p].tg(), mp[p].jj(), half, w_cos, w_sin, cs, sn);
                rotate_store<VEC>(d[p], cs, sn, mp[p].row(q, k, t0 + mp[p].tg(), q_tok, k_tok), half);
            }
        }
#pragma unroll 1
        for (int ub = 32 * upl; ub < n_units; ub += 32 * upl) {
            UnitMap mq[upl];
            UnitData<VEC> e[upl];
#pragma unroll
            for (int p = 0; p < upl; ++p) {
                mq[p] = map_unit(ub + lane + 32 * p, n_units, upt, upc, vw, hq, head_dim);
                if (mq[p].valid() && t0 + mq[p].tg() < total_tokens)
                    load_unit_na<VEC>(e[p], mq[p].row(q, k, t0 + mq[p].tg(), q_tok, k_tok), half);
            }
#pragma unroll
            for (int p = 0; p < upl; ++p) {
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

}  // namespace

extern "C" __global__ __launch_bounds__(rope_config().max_threads, rope_config().min_blocks) void q12_rope(
    Q12Meta m, bf16* __restrict__ q, bf16* __restrict__ k, int num_q_heads, int num_kv_heads, int head_dim,
    int rotary_dim, float theta, int mrope_mode, int sec_t, int sec_h, int sec_w, const __grid_constant__ RopeTable table) {
    __shared__ float s_inv[rope_config().max_half];
    __shared__ unsigned char s_axis[rope_config().max_half];
    __shared__ __align__(16) float s_cos[rope_config().smem_angles];
    __shared__ __align__(16) float s_sin[rope_config().smem_angles];

    if (rotary_dim <= 0 || num_q_heads + num_kv_heads <= 0) return;
    const int half = rotary_dim >> 1;
    // The host validates these; a bad launch fails loudly instead of writing garbage.
    if ((rotary_dim & 1) || rotary_dim > head_dim || half > rope_config().max_half || mrope_mode < 0 ||
        mrope_mode > 2 || num_q_heads < 0 || num_kv_heads < 0 || (table.size != 0 && table.size != half)) {
        __trap();
    }
    // Per-CTA tables: inverse frequencies (the caller's table, or HF's fp32 chain from theta with the power in
    // double) and the section map.
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        if (table.size) {
            s_inv[j] = table.inv_freq[j];
        } else {
            const float e = (float)(2 * j) / (float)rotary_dim;
            const float p = (float)pow((double)theta, (double)e);
            s_inv[j] = 1.0f / p;
        }
        s_axis[j] = (unsigned char)rope_axis(j, mrope_mode, sec_t, sec_h, sec_w);
    }
    __syncthreads();

    const float af = table.size ? table.attention_factor : 1.0f;
    const unsigned long long addr_bits = (unsigned long long)q | (unsigned long long)k;
    const bool vec = (rotary_dim & 15) == 0 && (head_dim & 7) == 0 && (addr_bits & 15ull) == 0;
    if (vec) {
        rope_warps<true>(m, q, k, num_q_heads, num_kv_heads, head_dim, half, s_inv, s_axis, af, s_cos, s_sin);
    } else {
        rope_warps<false>(m, q, k, num_q_heads, num_kv_heads, head_dim, half, s_inv, s_axis, af, s_cos, s_sin);
    }
}
