// gdn/chunk.cuh: the phases of the chunked (WY) Gated DeltaNet kernels and the records their precompute kernels
// write, shared by gdn/chunked_mma.cu (the fused kernel, the mma.sync two-pass kernels and the wgmma path's
// precompute) and gdn/chunked_wgmma.cu (the sequential kernels on warpgroup MMA). The algebra is in
// gdn/chunked_mma.cu's header.
#pragma once
#include "gdn/common.cuh"

// The chunked kernels' configuration: tokens a chunk, dv columns a CTA of one warpgroup owns (4 warps of 16), threads
// a warpgroup, precompute CTAs an SM (their __launch_bounds__). The host's geometry and sizes take the first three
// (q12drv.kernels.gdn: the contract defines Q12_GDN_CHUNK, Q12_GDN_SLICE, Q12_GDN_THREADS, checked below).
struct ChunkedConfig {
    int chunk, slice, threads, precompute_ctas;
};
__host__ __device__ constexpr ChunkedConfig chunked_config() { return {64, 64, 128, 3}; }
constexpr int GDN_C = chunked_config().chunk;    // tokens per chunk
constexpr int GDN_BV = chunked_config().slice;   // dv columns per CTA (a warpgroup)

#if !defined(Q12_GDN_CHUNK) || !defined(Q12_GDN_SLICE) || !defined(Q12_GDN_THREADS)
#error "compile through q12drv: it passes the host's chunk geometry (-DQ12_GDN_CHUNK=... -DQ12_GDN_SLICE=... -DQ12_GDN_THREADS=...)"
#endif
static_assert(chunked_config().chunk == Q12_GDN_CHUNK && chunked_config().slice == Q12_GDN_SLICE &&
                  chunked_config().threads == Q12_GDN_THREADS,
              "the chunk, the dv slice or the threads a CTA differ from the host's");

namespace gdnc {

__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_t(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    ldsm_x4_t(r0, r1, r2, r3, smem_u32(p));
}

// cp.async with zero fill: `ok` false reads nothing (src must still be a valid address) and writes zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(smem_u32(dst)), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" :: "r"(smem_u32(dst)), "l"(src), "r"(ok ? 8 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(smem_u32(dst)), "l"(src), "r"(ok ? 4 : 0) : "memory");
}
// Loads the compiler may not keep in a register across the chunk loop (they are re-read where needed:
// the loop holds S^T, V_new and two accumulators, and every register counts).
__device__ __forceinline__ int ld_volatile(const int* p) {
    int r;
    asm volatile("ld.global.s32 %0, [%1];\n" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ unsigned long long ld_volatile(const unsigned long long* p) {
    unsigned long long r;
    asm volatile("ld.global.u64 %0, [%1];\n" : "=l"(r) : "l"(p));
    return r;
}
// Programmatic dependent launch (Hopper; no-ops before sm_90): the wgmma path's precompute lets its sequential
// kernel launch early (pdl_launch_dependents, first thing in each CTA), and the sequential kernel waits for the
// precompute grid's completion and its memory (pdl_wait; then fence.proxy.async.global: the records are read by
// bulk copies, the async proxy) before it copies a record. A kernel launched without the attribute never waits.
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\nfence.proxy.async.global;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Byte offset of row r's 16-byte chunk cg in a [64 x D] bf16 tile in the 128-byte swizzle of wgmma.cuh:
// [D/64][64 rows][128 B], chunk cg % 8 of row r at position (cg % 8) ^ (r % 8).
__device__ __forceinline__ int sw128_off(int r, int cg) {
    return (cg >> 3) * (GDN_C * 128) + r * 128 + (((cg & 7) ^ (r & 7)) << 4);
}

// c += a * b, m16n8k16, bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// hi = bf16(x), lo = bf16(x - hi), for a pair of values. BITS: hi's two values back as fp32 straight from its bits
// (x0's in the low half), a shift and a mask, where through __bfloat1622float2 the pair takes two more byte
// permutes (the same values: the wgmma sequential kernels' chain takes it; the other phases do not, see
// docs/kernels/gdn.md).
template <bool BITS = false>
__device__ __forceinline__ void pack_hilo(float x0, float x1, unsigned& hi, unsigned& lo) {
    if constexpr (BITS) {
        hi = pack(x0, x1);
        lo = pack(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
    } else {
        __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
        const float2 hf = __bfloat1622float2(h);
        __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
        hi = *reinterpret_cast<unsigned*>(&h);
        lo = *reinterpret_cast<unsigned*>(&l);
    }
}

// A fragment (16 x 16, k = 16 columns) from two accumulator n-tiles c0 (columns 0..7), c1 (8..15).
__device__ __forceinline__ void a_from_c(const float* c0, const float* c1, unsigned* a) {
    a[0] = pack(c0[0], c0[1]);
    a[1] = pack(c0[2], c0[3]);
    a[2] = pack(c1[0], c1[1]);
    a[3] = pack(c1[2], c1[3]);
}

template <bool BITS = false>
__device__ __forceinline__ void a_from_c_hilo(const float* c0, const float* c1, unsigned* hi, unsigned* lo) {
    pack_hilo<BITS>(c0[0], c0[1], hi[0], lo[0]);
    pack_hilo<BITS>(c0[2], c0[3], hi[1], lo[1]);
    pack_hilo<BITS>(c1[0], c1[1], hi[2], lo[2]);
    pack_hilo<BITS>(c1[2], c1[3], hi[3], lo[3]);
}

template <int DK>
struct Smem {
    static constexpr int LDK = DK + 8;   // row strides (elements): 16-byte rows shifted by 16 bytes
    static constexpr int LDV = GDN_BV + 8;
    static constexpr int LDP = GDN_C + 8;
    static constexpr int LDD = 24;
    bf16 k[GDN_C * LDK];
    bf16 klo[GDN_C * LDK];
    bf16 q[GDN_C * LDK];      // raw q rows (cp.async), normalised in place
    bf16 kraw[GDN_C * DK];    // raw k rows (cp.async), normalised into k and klo
    bf16 v[2][GDN_C * LDV];   // V slice, then O slice (each warp reuses its own 16 columns); two, alternating
    bf16 a[GDN_C * LDP];      // -A, off-diagonal 16 x 16 blocks (strictly lower)
    bf16 p[GDN_C * LDP];      // P = Q K^T exp(gamma_i - gamma_j) [j <= i]
    bf16 dinv[GDN_C * LDD];   // block b: rows 16b..16b+15, columns 0..15 = (I + A_bb)^-1
    float d[4 * 16 * 17];     // A_bb (fp32, strictly lower)
    float graw[2][GDN_C];     // g, beta of the chunk (double buffer)
    float braw[2][GDN_C];
    float gam[GDN_C];
    float beta[GDN_C];        // braw[buf], copied: a fixed address in the phases that hold the most registers
    float eg[GDN_C];          // exp(gamma)
    float wd[GDN_C];          // exp(gamma_C - gamma)
};

// acc[nt] (16 rows of X = rows 16*mt.., k over DK) x K^T (n = tokens 0 .. 8*NT-1), A from smem rows.
template <int DK, int NT>
__device__ __forceinline__ void rows_times_kt(float (*acc)[4], const bf16* x, const bf16* k, int mt, int lane) {
    constexpr int LDK = DK + 8;
    const int mat = lane >> 3, r = lane & 7;
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
        unsigned a[4];
        ldsm_x4(a[0], a[1], a[2], a[3], x + (16 * mt + (mat & 1) * 8 + r) * LDK + 16 * ks + (mat >> 1) * 8);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            unsigned b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3, k + (16 * np + (mat >> 1) * 8 + r) * LDK + 16 * ks + (mat & 1) * 8);
            mma(acc[2 * np], a, b0, b1);
            mma(acc[2 * np + 1], a, b2, b3);
        }
    }
}

// causal tiles only: n-tiles 0 .. 2*mt+1 (mt is a compile-time constant after unrolling)
template <int DK>
__device__ __forceinline__ void causal_rows_kt(float (*acc)[4], const bf16* x, const bf16* k, int mt, int lane) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    if (mt == 0) rows_times_kt<DK, 2>(acc, x, k, mt, lane);
    else if (mt == 1) rows_times_kt<DK, 4>(acc, x, k, mt, lane);
    else if (mt == 2) rows_times_kt<DK, 6>(acc, x, k, mt, lane);
    else rows_times_kt<DK, 8>(acc, x, k, mt, lane);
}

// acc[8] (this warp's 16 dv rows x 64 tokens) = S^T X^T, X = K or Q rows in smem (k-step ks: St[2 ks], St[2 ks + 1]).
template <int DK>
__device__ __forceinline__ void st_times_xt(float (*acc)[4], const float (*St)[4], const bf16* x, int lane) {
    constexpr int LDK = DK + 8;
    const int mat = lane >> 3, r = lane & 7;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
        unsigned a[4];
        a_from_c(St[2 * ks], St[2 * ks + 1], a);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            unsigned b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3, x + (16 * np + (mat >> 1) * 8 + r) * LDK + 16 * ks + (mat & 1) * 8);
            mma(acc[2 * np], a, b0, b1);
            mma(acc[2 * np + 1], a, b2, b3);
        }
    }
}

// (I + D)^-1 of one 16 x 16 strictly lower fp32 block by forward substitution, column j, into dinv rows.
__device__ __forceinline__ void invert_column(const float* D, bf16* dinv, int j) {
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        float acc = (i == j) ? 1.f : 0.f;
#pragma unroll
        for (int mm = 0; mm < i; ++mm) acc = fmaf(-D[i * 17 + mm], x[mm], acc);
        x[i] = acc;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) dinv[i * 24 + j] = __float2bfloat16_rn(x[i]);
}

// ---- the per-chunk phases, shared by the fused kernel, the precompute kernels (the chunk-local work) and the
//      mma.sync sequential kernel (the state work)

// cp.async of 64 rows of key head kh from x ([T, num_k_heads, DK] bf16) from packed token tok, into dst
// (row stride ld elements); rows >= nv read nothing and land as zeros.
template <int DK>
__device__ __forceinline__ void issue_rows(bf16* dst, int ld, const bf16* __restrict__ x, int nv, int tok,
                                           int num_k_heads, int kh, int tid) {
    constexpr int C = GDN_C, THREADS = 128, SEGS = DK / 8;
#pragma unroll
    for (int p = 0; p < C * SEGS / THREADS; ++p) {
        const int idx = tid + p * THREADS;
        const int row = idx / SEGS, sg = idx % SEGS;
        const bool ok = row < nv;
        const bf16* src = ok ? x + ((long long)(tok + row) * num_k_heads + kh) * DK + sg * 8 : x;
        cp_async16(&dst[row * ld + sg * 8], src, ok);
    }
}

// cp.async of the V slice (columns col0..col0+COLS-1 of value head h, [T, num_v_heads, DV] bf16; COLS: the
// 64-column slice, or DV: the whole rows) of 64 rows from packed token tok into dst (row stride LDV): 8-byte
// pieces (v needs 8-byte alignment only); rows >= nv read nothing and land as zeros.
template <int DV, int BV = GDN_BV, int LDV = GDN_BV + 8>
__device__ __forceinline__ void issue_v_slice(bf16* dst, const bf16* __restrict__ v, int nv, int tok, int num_v_heads,
                                              int h, int col0, int tid) {
    constexpr int C = GDN_C, THREADS = 128;
#pragma unroll
    for (int p = 0; p < C * BV / 4 / THREADS; ++p) {
        const int idx = tid + p * THREADS;
        const int row = idx / (BV / 4), part = idx % (BV / 4);
        const bool ok = row < nv;
        const bf16* src = ok ? v + ((long long)(tok + row) * num_v_heads + h) * DV + col0 + part * 4 : v;
        cp_async8(&dst[row * LDV + part * 4], src, ok);
    }
}

// cp.async of chunk c of (stream b, value head h): (LOAD_K) raw K rows -> kraw, (LOAD_V) the V slice -> vdst,
// (LOAD_GB) g/beta -> graw/braw[buf]; rows >= len read nothing and land as zeros.
template <int DK, int DV, bool LOAD_K, bool LOAD_V, bool LOAD_GB, typename S>
__device__ __forceinline__ void issue_kvgb(S& s, bf16* vdst, const int* cub, int len, int c, int buf,
                                           const bf16* __restrict__ k, const bf16* __restrict__ v,
                                           const float* __restrict__ g, const float* __restrict__ beta,
                                           int num_k_heads, int num_v_heads, int h, int col0, int tid) {
    constexpr int C = GDN_C, THREADS = 128;
    const int nv = min(C, len - c);
    const int tok0 = ld_volatile(cub);
    const int kh = h / (num_v_heads / num_k_heads);
    if (LOAD_K) issue_rows<DK>(s.kraw, DK, k, nv, tok0 + c, num_k_heads, kh, tid);
    if (LOAD_V) issue_v_slice<DV>(vdst, v, nv, tok0 + c, num_v_heads, h, col0, tid);
    if (LOAD_GB) {
#pragma unroll
        for (int p = 0; p < (2 * C + THREADS - 1) / THREADS; ++p) {
            const int t = tid + p * THREADS;
            if (t < 2 * C) {
                const int tt = t % C;
                const bool ok = tt < nv;
                const long long gi = ok ? (long long)(tok0 + c + tt) * num_v_heads + h : 0;
                if (t < C) cp_async4(&s.graw[buf][tt], g + gi, ok);
                else cp_async4(&s.braw[buf][tt], beta + gi, ok);
            }
        }
    }
}

// cp.async of chunk c's raw Q rows -> s.q
template <int DK, typename S>
__device__ __forceinline__ void issue_q(S& s, const int* cub, int len, int c, const bf16* __restrict__ q,
                                        int num_k_heads, int num_v_heads, int h, int tid) {
    const int nv = min(GDN_C, len - c);
    issue_rows<DK>(s.q, DK + 8, q, nv, ld_volatile(cub) + c, num_k_heads, h / (num_v_heads / num_k_heads), tid);
}

// K (kraw -> k hi, klo) and Q (in place) l2-normalised, Q scaled by dk^-1/2: SEGS lanes per row, shuffles.
// K lo's 16-byte segment `seg` of row `row` goes to klo_at(row, seg). NORMS (the wgmma path's precompute, whose
// products take the raw rows, k copied straight to s.k): only each row's scales, to s.rk (1 / |k|) and s.rq
// (dk^-1/2 / |q|), the rows left raw (chunk_gamma<true> folds the scales into the epilogues' exponents; the
// sequential kernel multiplies its products of the raw rows by them).
// Two passes unrolled at a time: a full unroll hoists every row's loads and spills next to S^T.
template <int DK, bool NORMS = false, typename S, class KloAt>
__device__ __forceinline__ void normalise(S& s, KloAt&& klo_at, int tid, int seg, float qscale) {
    constexpr int C = GDN_C, THREADS = 128, SEGS = DK / 8, RPP = THREADS / SEGS, LDK = DK + 8;
#pragma unroll 2
    for (int p = 0; p < C / RPP; ++p) {
        const int row = tid / SEGS + p * RPP;
#pragma unroll
        for (int which = 0; which < 2; ++which) {  // 0: k, 1: q
            const uint4 raw = which ? *reinterpret_cast<const uint4*>(&s.q[row * LDK + seg * 8])
                            : NORMS ? *reinterpret_cast<const uint4*>(&s.k[row * LDK + seg * 8])
                                    : *reinterpret_cast<const uint4*>(&s.kraw[row * DK + seg * 8]);
            float x[8];
            const float inv = gdn_row_inv_norm<SEGS, NORMS>(raw, x);
            if constexpr (NORMS) {
                if (seg == 0) (which ? s.rq : s.rk)[row] = which ? inv * qscale : inv;
                continue;
            }
            uint4 hi, lo;
            unsigned* hp = reinterpret_cast<unsigned*>(&hi);
            unsigned* lp = reinterpret_cast<unsigned*>(&lo);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (which) hp[i] = pack((x[2 * i] * inv) * qscale, (x[2 * i + 1] * inv) * qscale);
                else pack_hilo(x[2 * i] * inv, x[2 * i + 1] * inv, hp[i], lp[i]);
            }
            if (which) {
                *reinterpret_cast<uint4*>(&s.q[row * LDK + seg * 8]) = hi;
            } else {
                *reinterpret_cast<uint4*>(&s.k[row * LDK + seg * 8]) = hi;
                *reinterpret_cast<uint4*>(klo_at(row, seg)) = lo;
            }
        }
    }
}

// exp2 and log2 by the hardware's approximations (ex2.approx: 2 ulp; lg2.approx: about 2^-22 absolute; lg2(0) =
// -inf, ex2(-inf) = 0): the products' epilogue exponents and their elements, rounded to bf16 (or fp32 blocks that
// are, once inverted) after them.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float lg2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// gamma = inclusive cumsum of g (one warp, two tokens per lane), exp(gamma), exp(gamma_C - gamma); beta copied.
// RAW (the wgmma path's precompute, whose products take the raw rows): instead of gamma, the products' epilogue
// exponents, base 2, with the rows' scales folded in (s.rk, s.rq: normalise<NORMS>'s, written before the caller's
// barrier): erk_i = gamma_i log2(e) + log2(beta_i rk_i), erq_i = gamma_i log2(e) + log2(rq_i), ec_j = log2(rk_j) -
// gamma_j log2(e), so that exp2(erk_i + ec_j) = beta_i exp(gamma_i - gamma_j) rk_i rk_j (beta 0 gives -inf: a zero
// row) and exp2(erq_i + ec_j) = exp(gamma_i - gamma_j) rq_i rk_j.
template <bool RAW = false, typename S>
__device__ __forceinline__ void chunk_gamma(S& s, int buf, int lane) {
    constexpr float L2E = 1.4426950408889634f;
    const float g0 = s.graw[buf][2 * lane], g1 = s.graw[buf][2 * lane + 1];
    float incl = g0 + g1;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
    }
    const float excl = incl - (g0 + g1);
    const float ga = excl + g0;
    const float gb = ga + g1;
    const float gC = __shfl_sync(0xffffffffu, gb, 31);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int t = 2 * lane + u;
        const float gam = u ? gb : ga, bt = s.braw[buf][t];
        s.beta[t] = bt;
        s.eg[t] = expf(gam);
        s.wd[t] = expf(gC - gam);
        if constexpr (RAW) {
            const float gl = gam * L2E, lk = lg2(s.rk[t]);
            s.erk[t] = gl + lg2(bt) + lk;
            s.erq[t] = gl + lg2(s.rq[t]);
            s.ec[t] = lk - gl;
        } else {
            s.gam[t] = gam;
        }
    }
}

// (I + D_mt)^-1 of diagonal block mt (s.d's fp32 block, into its dinv rows) by lanes 0..15 of one warp, a column
// each: the warp that wrote the block (the overlapped precompute), after a __syncwarp.
template <typename S>
__device__ __forceinline__ void invert_block(S& s, int mt, int lane) {
    constexpr int LDD = 24;
    if (lane < 16) invert_column(&s.d[mt * 272], &s.dinv[16 * mt * LDD], lane);
}

// The products' epilogue for block row mt, with beta and gamma of the chunk's value head: KK: acc = K K^T
// rows -> -A (strictly lower, off the diagonal block) and the fp32 diagonal block; else acc = Q K^T rows -> P
// (lower, diagonal included). RAW (the wgmma path's precompute: acc of the raw rows): each element is acc times
// exp2 of its row's exponent plus its column's (chunk_gamma<true>: beta, the decay and the rows' scales in one
// ex2.approx, where the others take beta * expf(gamma_i - gamma_j), about 8 instructions more an element); masked
// elements are selected away (their exponent may overflow), -A and P leave as bf16 pairs. The fused kernel and the
// mma two-pass schedule keep expf and the normalised rows (docs/kernels/gdn.md).
template <bool KK, bool RAW = false, typename S>
__device__ __forceinline__ void products_epilogue(S& s, const float (*acc)[4], int mt, int lane) {
    constexpr int LDP = GDN_C + 8;
    const int gq = lane >> 2, tq = lane & 3;
    if constexpr (RAW) {
        const float* re = KK ? s.erk : s.erq;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            if (nt > 2 * mt + 1) break;
            const int j = 8 * nt + 2 * tq;
            const float2 c = *reinterpret_cast<const float2*>(&s.ec[j]);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int i = 16 * mt + gq + 8 * hh;
                const float r = re[i];
                float v0 = ex2(r + c.x) * acc[nt][2 * hh], v1 = ex2(r + c.y) * acc[nt][2 * hh + 1];
                v0 = (KK ? j < i : j <= i) ? v0 : 0.f;
                v1 = (KK ? j + 1 < i : j + 1 <= i) ? v1 : 0.f;
                if (KK && (nt >> 1) == mt) {
                    s.d[mt * 272 + (i & 15) * 17 + (j & 15)] = v0;
                    s.d[mt * 272 + (i & 15) * 17 + (j & 15) + 1] = v1;
                } else {
                    *reinterpret_cast<unsigned*>(&(KK ? s.a : s.p)[i * LDP + j]) = KK ? pack(-v0, -v1) : pack(v0, v1);
                }
            }
        }
    } else {
        const float* bet = s.beta;
    #pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            if (nt > 2 * mt + 1) break;
    #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = 16 * mt + gq + (e >> 1) * 8;
                const int j = 8 * nt + 2 * tq + (e & 1);
                if (KK) {
                    const float val = (j < i) ? bet[i] * expf(s.gam[i] - s.gam[j]) * acc[nt][e] : 0.f;
                    if ((j >> 4) == mt) s.d[mt * 272 + (i & 15) * 17 + (j & 15)] = val;
                    else s.a[i * LDP + j] = __float2bfloat16_rn(-val);
                } else {
                    const float val = (j <= i) ? expf(s.gam[i] - s.gam[j]) * acc[nt][e] : 0.f;
                    s.p[i * LDP + j] = __float2bfloat16_rn(val);
                }
            }
        }
    }
}

// K K^T (rows of the warp's blocks) -> -A blocks and the fp32 diagonal blocks; Q K^T -> P. Warp w takes the K
// rows of 16-token block w and the Q rows of block 3 - w: the causal work balanced over the four warps.
template <int DK, typename S>
__device__ __forceinline__ void local_products(S& s, int warp, int lane) {
    float acc[8][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
        if (mt != warp) continue;
        causal_rows_kt<DK>(acc, s.k, s.k, mt, lane);
        products_epilogue<true>(s, acc, mt, lane);
    }
#pragma unroll
    for (int mq = 0; mq < 4; ++mq) {
        if (3 - mq != warp) continue;
        causal_rows_kt<DK>(acc, s.q, s.k, mq, lane);
        products_epilogue<false>(s, acc, mq, lane);
    }
}

// (I + A_bb)^-1 of the four diagonal blocks, one column per thread.
template <int DK, typename S>
__device__ __forceinline__ void invert_diagonal(S& s, int tid) {
    constexpr int LDD = 24;
    for (int cidx = tid; cidx < 64; cidx += 128)
        invert_column(&s.d[(cidx >> 4) * 272], &s.dinv[16 * (cidx >> 4) * LDD], cidx & 15);
}

// Where one chunk's operands of the state step sit in shared memory (row strides as in Smem<DK>).
struct ChunkOps {
    const bf16* k;      // normalised K, bf16 hi [64][LDK]
    const bf16* klo;    // its lo part
    const bf16* q;      // normalised, scaled Q [64][LDK]
    const bf16* a;      // -A off-diagonal blocks [64][LDP]
    const bf16* p;      // P [64][LDP]
    const bf16* dinv;   // diagonal inverses [64][LDD]
    const float* beta;  // [64]
    const float* eg;    // exp(gamma) [64]
    const float* wd;    // exp(gamma_C - gamma) [64]
};

// The state step of one chunk for this warp's 16 dv rows: R^T = beta (V^T - exp(gamma) S^T K^T), the block
// solve V_new^T, O^T = exp(gamma) S^T Q^T + V_new^T P^T into this warp's columns of vo (which held the V
// slice), and S^T = exp(gamma_C) S^T + (V_new^T exp(gamma_C - gamma)) K.
// f(nt, e, token, at) over a warp's [8][4] accumulator tile of a [64 tokens x 16 dv] product (mma C
// layout): element e of token tile nt is token `token`, dv column 16 warp + gq + 8 (e >> 1) of the
// V/O slice, at slice[at] (row stride LDV).
template <int LDV, class F>
__device__ __forceinline__ void each_slice_elem(int warp, int lane, F&& f) {
    const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int cc = 8 * nt + 2 * tq + (e & 1);
            f(nt, e, cc, cc * LDV + 16 * warp + gq + (e >> 1) * 8);
        }
}

// X^T = R^T (I + A)^-T for this warp's 16 rows: block forward substitution over the four 16-token blocks,
// X_b = (R_b + sum_{m<b} X_m (-A_bm)^T) Dinv_b^T (-A's off-diagonal blocks in `a`, row stride 72; the inverted
// diagonal blocks in `dinv`, row stride 24). Rt (R^T, mma C layout) is overwritten.
__device__ __forceinline__ void block_solve(const bf16* a, const bf16* dinv, float (*Rt)[4], float (*X)[4], int lane) {
    constexpr int LDP = GDN_C + 8, LDD = 24;
    const int mat = lane >> 3, r8 = lane & 7;
#pragma unroll
    for (int bi = 0; bi < 4; ++bi) {
        float* y0 = Rt[2 * bi];
        float* y1 = Rt[2 * bi + 1];
#pragma unroll
        for (int mm = 0; mm < bi; ++mm) {
            unsigned ahi[4], alo[4], b0, b1, b2, b3;
            a_from_c_hilo(X[2 * mm], X[2 * mm + 1], ahi, alo);
            ldsm_x4(b0, b1, b2, b3, &a[(16 * bi + (mat >> 1) * 8 + r8) * LDP + 16 * mm + (mat & 1) * 8]);
            mma(y0, ahi, b0, b1);
            mma(y1, ahi, b2, b3);
            mma(y0, alo, b0, b1);
            mma(y1, alo, b2, b3);
        }
        unsigned ahi[4], alo[4], b0, b1, b2, b3;
        a_from_c_hilo(y0, y1, ahi, alo);
        ldsm_x4(b0, b1, b2, b3, &dinv[(16 * bi + (mat >> 1) * 8 + r8) * LDD + (mat & 1) * 8]);
#pragma unroll
        for (int e = 0; e < 4; ++e) X[2 * bi][e] = X[2 * bi + 1][e] = 0.f;
        mma(X[2 * bi], ahi, b0, b1);
        mma(X[2 * bi + 1], ahi, b2, b3);
        mma(X[2 * bi], alo, b0, b1);
        mma(X[2 * bi + 1], alo, b2, b3);
    }
}

template <int DK>
__device__ __forceinline__ void state_step(const ChunkOps& c, float (*St)[4], bf16* vo, int warp, int lane) {
    constexpr int C = GDN_C, LDK = DK + 8, LDV = GDN_BV + 8, LDP = C + 8, NTS = DK / 8;
    const int gq = lane >> 2, tq = lane & 3;
    const int mat = lane >> 3, r8 = lane & 7;
    const float* bet = c.beta;
    const bf16* vb = vo;
    float X[8][4];   // V_new^T (this warp's dv rows x 64 tokens)
    {
        float Rt[8][4];
        st_times_xt<DK>(Rt, St, c.k, lane);
        each_slice_elem<LDV>(warp, lane, [&](int nt, int e, int cc, int at) {
            Rt[nt][e] = bet[cc] * (__bfloat162float(vb[at]) - c.eg[cc] * Rt[nt][e]);
        });
        block_solve(c.a, c.dinv, Rt, X, lane);
    }
    // ---- O^T = exp(gamma) S^T Q^T + V_new^T P^T, into this warp's columns of vo
    {
        float Ot[8][4];
        st_times_xt<DK>(Ot, St, c.q, lane);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) Ot[nt][e] *= c.eg[8 * nt + 2 * tq + (e & 1)];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            unsigned ahi[4], alo[4];
            a_from_c_hilo(X[2 * kk], X[2 * kk + 1], ahi, alo);
#pragma unroll
            for (int np = kk; np < 4; ++np) {   // P[c][c'] = 0 for c' > c: token pairs np >= kk only
                unsigned b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3, &c.p[(16 * np + (mat >> 1) * 8 + r8) * LDP + 16 * kk + (mat & 1) * 8]);
                mma(Ot[2 * np], ahi, b0, b1);
                mma(Ot[2 * np + 1], ahi, b2, b3);
                mma(Ot[2 * np], alo, b0, b1);
                mma(Ot[2 * np + 1], alo, b2, b3);
            }
        }
        __syncwarp();
        each_slice_elem<LDV>(warp, lane, [&](int nt, int e, int, int at) { vo[at] = __float2bfloat16_rn(Ot[nt][e]); });
    }
    // ---- S^T = exp(gamma_C) S^T + (V_new^T exp(gamma_C - gamma)) K
    {
        const float egC = c.eg[C - 1];
#pragma unroll
        for (int j = 0; j < NTS; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) St[j][e] *= egC;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            float x0[4], x1[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                x0[e] = X[2 * kk][e] * c.wd[16 * kk + 2 * tq + (e & 1)];
                x1[e] = X[2 * kk + 1][e] * c.wd[16 * kk + 8 + 2 * tq + (e & 1)];
            }
            unsigned ahi[4], alo[4];
            a_from_c_hilo(x0, x1, ahi, alo);
#pragma unroll
            for (int np = 0; np < DK / 16; ++np) {
                unsigned b0, b1, b2, b3;
                const int off = (16 * kk + (mat & 1) * 8 + r8) * LDK + 16 * np + (mat >> 1) * 8;
                ldsm_x4_t(b0, b1, b2, b3, &c.k[off]);
                mma(St[2 * np], ahi, b0, b1);
                mma(St[2 * np + 1], ahi, b2, b3);
                mma(St[2 * np], alo, b0, b1);
                mma(St[2 * np + 1], alo, b2, b3);
                ldsm_x4_t(b0, b1, b2, b3, &c.klo[off]);
                mma(St[2 * np], ahi, b0, b1);
                mma(St[2 * np + 1], ahi, b2, b3);
            }
        }
    }
}

// S^T fragments of this lane (dv rows bv0, bv0 + 8): St[j] covers dk columns 8j..8j+7:
// [0] (bv0, 8j+2t) [1] (bv0, 8j+2t+1) [2],[3] bv0+8.
template <int DK, int DV>
__device__ __forceinline__ void load_state(float (*St)[4], const float* state, int bv0, int tq) {
#pragma unroll
    for (int j = 0; j < DK / 8; ++j) {
        const int kr = 8 * j + 2 * tq;
        St[j][0] = state[kr * DV + bv0];
        St[j][1] = state[(kr + 1) * DV + bv0];
        St[j][2] = state[kr * DV + bv0 + 8];
        St[j][3] = state[(kr + 1) * DV + bv0 + 8];
    }
}

template <int DK, int DV>
__device__ __forceinline__ void store_state(const float (*St)[4], float* out, int bv0, int tq) {
#pragma unroll
    for (int j = 0; j < DK / 8; ++j) {
        const int kr = 8 * j + 2 * tq;
        out[kr * DV + bv0] = St[j][0];
        out[(kr + 1) * DV + bv0] = St[j][1];
        out[kr * DV + bv0 + 8] = St[j][2];
        out[(kr + 1) * DV + bv0 + 8] = St[j][3];
    }
}

// o rows of valid tokens from this CTA's O slice: 8-byte pieces (o needs 8-byte alignment only).
template <int DV>
__device__ __forceinline__ void store_o_at(bf16* __restrict__ o, const bf16* ob, int tok0, int len, int c0,
                                           int num_v_heads, int h, int col0, int tid) {
    constexpr int C = GDN_C, BV = GDN_BV, THREADS = 128, LDV = GDN_BV + 8;
    const int nt_valid = min(C, len - c0);
#pragma unroll
    for (int p = 0; p < C * BV / 4 / THREADS; ++p) {
        const int idx = tid + p * THREADS;
        const int row = idx / (BV / 4), part = idx % (BV / 4);
        if (row < nt_valid)
            *reinterpret_cast<uint2*>(o + ((long long)(tok0 + c0 + row) * num_v_heads + h) * DV + col0 + part * 4) =
                *reinterpret_cast<const uint2*>(&ob[row * LDV + part * 4]);
    }
}
template <int DV>
__device__ __forceinline__ void store_o(bf16* __restrict__ o, const bf16* ob, const int* cub, int len, int c0,
                                        int num_v_heads, int h, int col0, int tid) {
    store_o_at<DV>(o, ob, ld_volatile(cub), len, c0, num_v_heads, h, col0, tid);
}

// ---- the precompute kernels' records, in the workspace (q12drv.kernels.gdn sizes it; byte offsets, every record
//      16-byte aligned).
// The mma two-pass schedule: n x ceil(chunk_len / 64) x Hk K records, then n x ceil(chunk_len / 64) x Hv V records.
// K record of one (stream, key head, chunk), shared by the value heads of that key head: normalised K hi, K lo,
// Q [64][DK] bf16, row-major.
template <int DK>
struct KRec {
    static constexpr int K = 0, KLO = GDN_C * DK * 2, Q = 2 * GDN_C * DK * 2, BYTES = 3 * GDN_C * DK * 2;
};
// V record of one (stream, value head, chunk): -A, P [64][64] bf16, the diagonal inverses [64][16] bf16, beta,
// exp(gamma), exp(gamma_C - gamma) [64] fp32.
struct VRec {
    static constexpr int A = 0, P = GDN_C * GDN_C * 2, DINV = 2 * GDN_C * GDN_C * 2, BETA = DINV + GDN_C * 16 * 2,
                         EG = BETA + GDN_C * 4, WD = EG + GDN_C * 4, BYTES = WD + GDN_C * 4;
};
// The wgmma two-pass schedule: n x ceil(chunk_len / 64) x Hv T records (no K record: its sequential kernel reads the
// raw k and q rows from the inputs), one per (stream, value head, chunk): T = (I + A)^-1 and P, each a [64][64] bf16
// swizzled tile, then [64] fp32 beta, EK = exp(gamma) rk, EQ = exp(gamma) rq and WK = exp(gamma_C - gamma) rk (rk,
// rq: the rows' scales of normalise<NORMS>; the sequential kernel multiplies the products of the raw k and q rows by
// them), then exp(gamma_C) and 12 zero bytes: a byte image of the wgmma sequential kernel's stage from its T tile on.
struct TRec {
    static constexpr int T = 0, P = GDN_C * GDN_C * 2, BETA = 2 * GDN_C * GDN_C * 2, EK = BETA + GDN_C * 4,
                         EQ = EK + GDN_C * 4, WK = EQ + GDN_C * 4, EGC = WK + GDN_C * 4, BYTES = EGC + 16;
};

// cp.async of 64 rows of key head kh from k and from q ([T, num_k_heads, DK] bf16) from packed token tok into two
// [64 x DK] tiles in the 128-byte swizzle (sw128_off); TILES: bit 0 k's, bit 1 q's (the wide CTA of two warpgroups
// gives each one tile). Thread tid (0..127) copies segment tid % SEGS of rows
// tid / SEGS + p * 128 / SEGS, so its destinations step by a fixed number of bytes (row % 8 is the same for all);
// a rolled loop (unrolled, its 2 x 64 / (128 / SEGS) addresses stay live beside S^T and spill). Rows >= nv read
// nothing and land as zeros.
template <int DK, int TILES = 3>
__device__ __forceinline__ void issue_kq_sw128(unsigned char* ktile, unsigned char* qtile, const bf16* __restrict__ k,
                                               const bf16* __restrict__ q, int nv, int tok, int num_k_heads, int kh,
                                               int tid) {
    constexpr int C = GDN_C, THREADS = 128, SEGS = DK / 8, RPP = THREADS / SEGS;
    const int row0 = tid / SEGS, sg = tid % SEGS;
    const long long step = (long long)RPP * num_k_heads * DK;   // elements from one row of this thread's to the next
    const long long at = ((long long)(tok + row0) * num_k_heads + kh) * DK + sg * 8;
    const int dst = sw128_off(row0, sg);
    const int rows = nv > row0 ? (nv - row0 + RPP - 1) / RPP : 0;   // this thread's rows below nv
#pragma unroll 1
    for (int p = 0; p < C / RPP; ++p) {
        const bool ok = p < rows;
        const long long e = ok ? at + p * step : 0;
        if (TILES & 1) cp_async16(ktile + dst + p * RPP * 128, k + e, ok);
        if (TILES & 2) cp_async16(qtile + dst + p * RPP * 128, q + e, ok);
    }
}

template <int DK>
__device__ __forceinline__ unsigned char* krec_at(unsigned char* ws, const Q12Meta& m, int b, int ci, int kh,
                                                  int num_k_heads) {
    const int nchunks = ((int)m.chunk_len + GDN_C - 1) / GDN_C;
    return ws + (((long long)b * nchunks + ci) * num_k_heads + kh) * KRec<DK>::BYTES;
}
template <int DK>
__device__ __forceinline__ unsigned char* vrec_at(unsigned char* ws, const Q12Meta& m, int b, int ci, int h,
                                                  int num_k_heads, int num_v_heads) {
    const int nchunks = ((int)m.chunk_len + GDN_C - 1) / GDN_C;
    const long long kblock = (long long)m.batch_size * nchunks * num_k_heads * KRec<DK>::BYTES;
    return ws + kblock + (((long long)b * nchunks + ci) * num_v_heads + h) * VRec::BYTES;
}
// Record (stream b, chunk ci, value head h) of a workspace of n x ceil(chunk_len / 64) x Hv records of RB bytes (the
// wgmma path's: TRec, or the overlapped schedule's, gdn/chunked_wgmma.cu).
template <int RB>
__device__ __forceinline__ unsigned char* rec_at(unsigned char* ws, const Q12Meta& m, int b, int ci, int h,
                                                 int num_v_heads) {
    const int nchunks = ((int)m.chunk_len + GDN_C - 1) / GDN_C;
    return ws + (((long long)b * nchunks + ci) * num_v_heads + h) * RB;
}
__device__ __forceinline__ unsigned char* trec_at(unsigned char* ws, const Q12Meta& m, int b, int ci, int h,
                                                  int num_v_heads) {
    return rec_at<TRec::BYTES>(ws, m, b, ci, h, num_v_heads);
}
// The precompute kernels' shared memory: Smem<DK> without what they do not need (V/O slices; K lo goes
// straight to the K record) and with raw K sharing its bytes with -A and P (raw K is read by the
// normalisation, -A and P are first written after it; the wgmma path's raw k rows land in k itself), plus the
// rows' scales of normalise<NORMS> and the epilogue exponents of chunk_gamma<true> (both the wgmma path's):
// 64,000 B at d128, 3 CTAs/SM.
template <int DK>
struct PrepSmem {
    static constexpr int LDK = DK + 8, LDP = GDN_C + 8, LDD = 24;
    bf16 k[GDN_C * LDK];
    bf16 q[GDN_C * LDK];
    union {
        bf16 kraw[GDN_C * DK];
        struct {
            bf16 a[GDN_C * LDP];
            bf16 p[GDN_C * LDP];
        };
    };
    bf16 dinv[GDN_C * LDD];
    float d[4 * 16 * 17];
    float graw[2][GDN_C];
    float braw[2][GDN_C];
    float gam[GDN_C];
    float erk[GDN_C];         // (the wgmma path's) the products' epilogue exponents (chunk_gamma<true>)
    float erq[GDN_C];
    float ec[GDN_C];
    float beta[GDN_C];
    float eg[GDN_C];
    float wd[GDN_C];
    float rk[GDN_C];
    float rq[GDN_C];
};

// -A and P (s.a, s.p: [64][LDP] bf16 each) zeroed by the group, so that every byte of the records is defined: the
// products' epilogues write only the blocks on and below the diagonal (the solve's, P's causal ones). At an item's
// start; the overlapped precompute again before each later value head (its T tiles take s.a's and s.p's bytes after
// the solve, and left in P's upper blocks they would be the next value head's P record).
template <typename S>
__device__ __forceinline__ void zero_ap(S& s, int tid) {
    constexpr int LDP = GDN_C + 8;
    static_assert(sizeof(s.a) == GDN_C * LDP * 2 && sizeof(s.p) == sizeof(s.a), "-A and P: [64][LDP] bf16 each");
    uint4 *a = reinterpret_cast<uint4*>(s.a), *p = reinterpret_cast<uint4*>(s.p);
    for (int i = tid; i < GDN_C * LDP / 8; i += 128) a[i] = p[i] = make_uint4(0, 0, 0, 0);
}

// One precompute item, by a CTA of 128 threads on its PrepSmem<DK>: chunk ci of (stream b, key head kh), which has
// len tokens: (WG false) its K record, K K^T and Q K^T once, then each value head's V record (its beta and gamma
// scale the products in the epilogues): the mma two-pass schedule's records (KRec, VRec). WG: the wgmma two-pass
// schedule's (no K record; TRec: T = (I + A)^-1 from the block solve applied to the identity, the rows' scales
// folded into its per-token factors). It returns after the CTA's last barrier: every record store of the item is
// issued.
template <int DK, int DV, bool WG>
__device__ __forceinline__ void prep_item(const Q12Meta& m, const bf16* __restrict__ q, const bf16* __restrict__ k,
                                          const float* __restrict__ g, const float* __restrict__ beta, int num_k_heads,
                                          int num_v_heads, unsigned char* __restrict__ ws, PrepSmem<DK>& s, int b,
                                          int kh, int ci, int len, int tid) {
    using SM = PrepSmem<DK>;
    constexpr int C = GDN_C, THREADS = 128, SEGS = DK / 8, LDK = SM::LDK, LDP = SM::LDP, LDD = SM::LDD;
    const int lane = tid & 31, warp = tid >> 5;
    const int* cu = q12_cu_seqlens(m);
    const int c0 = ci * C;
    const int group = num_v_heads / num_k_heads;

    // raw K to kraw (WG: straight to s.k, the products take the raw rows), g and beta, raw Q to s.q
    issue_kvgb<DK, DV, !WG, false, true>(s, nullptr, cu + b, len, c0, 0, k, nullptr, g, beta, num_k_heads,
                                         num_v_heads, kh * group, 0, tid);
    if constexpr (WG) issue_rows<DK>(s.k, LDK, k, min(C, len - c0), ld_volatile(cu + b) + c0, num_k_heads, kh, tid);
    issue_q<DK>(s, cu + b, len, c0, q, num_k_heads, num_v_heads, kh * group, tid);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    unsigned char* krec = krec_at<DK>(ws, m, b, ci, kh, num_k_heads);
    bf16* klo = reinterpret_cast<bf16*>(krec + KRec<DK>::KLO);
    normalise<DK, WG>(s, [&](int row, int sg) { return &klo[row * DK + sg * 8]; }, tid, tid % SEGS,
                      1.0f / sqrtf((float)DK));
    __syncthreads();   // raw K read out: its bytes become -A and P
    zero_ap(s, tid);
    if constexpr (!WG)
        for (int idx = tid; idx < 2 * C * SEGS; idx += THREADS) {   // K hi and Q rows to the K record
            const int which = idx / (C * SEGS), rest = idx % (C * SEGS), row = rest / SEGS, sg = rest % SEGS;
            *reinterpret_cast<uint4*>(krec + (which ? KRec<DK>::Q : KRec<DK>::K) + row * (DK * 2) + sg * 16) =
                *reinterpret_cast<const uint4*>((which ? s.q : s.k) + row * LDK + sg * 8);
        }
    // K K^T and Q K^T once for the key head (4 warps: warp w owns K rows of block w, Q rows of block 3 - w);
    // each value head scales them by its own beta and gamma in the epilogues
    float acck[8][4], accq[8][4];
    causal_rows_kt<DK>(acck, s.k, s.k, warp, lane);
    causal_rows_kt<DK>(accq, s.q, s.k, 3 - warp, lane);
    for (int j = 0; j < group; ++j) {
        const int h = kh * group + j;
        if (j > 0) cp_async_wait_all();   // this value head's g and beta, copied while the previous head computed
        __syncthreads();
        if (warp == 0) chunk_gamma<WG>(s, j & 1, lane);
        __syncthreads();
        if (j + 1 < group) {   // the next value head's g and beta into the other buffer (chunk_gamma read this one out)
            issue_kvgb<DK, DV, false, false, true>(s, nullptr, cu + b, len, c0, (j + 1) & 1, k, nullptr, g, beta,
                                                   num_k_heads, num_v_heads, h + 1, 0, tid);
            cp_async_commit();
        }
        products_epilogue<true, WG>(s, acck, warp, lane);
        products_epilogue<false, WG>(s, accq, 3 - warp, lane);
        __syncthreads();
        invert_diagonal<DK>(s, tid);
        __syncthreads();
        unsigned char* vrec = WG ? trec_at(ws, m, b, ci, h, num_v_heads)
                                 : vrec_at<DK>(ws, m, b, ci, h, num_k_heads, num_v_heads);
        if constexpr (WG) {
            // T^T = I (I + A)^-T, this warp's 16 rows: T's columns 16w .. 16w + 15, rounded to bf16 into s.k as
            // [64][LDP] rows (s.k is free: the products above were the last to read it)
            float Rt[8][4], X[8][4];
            each_slice_elem<LDP>(warp, lane, [&](int nt, int e, int cc, int at) {   // at: T[token cc][this row]
                Rt[nt][e] = at == cc * (LDP + 1) ? 1.f : 0.f;
            });
            block_solve(s.a, s.dinv, Rt, X, lane);
            each_slice_elem<LDP>(warp, lane, [&](int nt, int e, int, int at) { s.k[at] = __float2bfloat16_rn(X[nt][e]); });
            __syncthreads();
            for (int idx = tid; idx < 2 * C * 8; idx += THREADS) {   // T, P as swizzled tiles
                const int which = idx / (C * 8), rest = idx % (C * 8), row = rest / 8, sg = rest % 8;
                *reinterpret_cast<uint4*>(vrec + (which ? TRec::P : TRec::T) + sw128_off(row, sg)) =
                    *reinterpret_cast<const uint4*>((which ? s.p : s.k) + row * LDP + sg * 8);
            }
        } else {
            for (int idx = tid; idx < 2 * C * 8; idx += THREADS) {
                const int which = idx / (C * 8), rest = idx % (C * 8), row = rest / 8, sg = rest % 8;
                *reinterpret_cast<uint4*>(vrec + VRec::A + which * (C * C * 2) + row * 128 + sg * 16) =
                    *reinterpret_cast<const uint4*>((which ? s.p : s.a) + row * LDP + sg * 8);
            }
            if (tid < 2 * C)
                *reinterpret_cast<uint4*>(vrec + VRec::DINV + tid * 16) =
                    *reinterpret_cast<const uint4*>(s.dinv + (tid >> 1) * LDD + (tid & 1) * 8);
        }
        if constexpr (WG) {   // beta, EK, EQ, WK (16 B a thread), then exp(gamma_C)
            if (tid < 4 * 16) {
                const int i = (tid & 15) * 4, a = tid >> 4;
                const float* x = a == 0 ? s.beta : a == 3 ? s.wd : s.eg;
                const float* r = a == 2 ? s.rq : s.rk;
                float4 f;
                f.x = a ? x[i] * r[i] : x[i];
                f.y = a ? x[i + 1] * r[i + 1] : x[i + 1];
                f.z = a ? x[i + 2] * r[i + 2] : x[i + 2];
                f.w = a ? x[i + 3] * r[i + 3] : x[i + 3];
                *reinterpret_cast<float4*>(vrec + TRec::BETA + tid * 16) = f;
            } else if (tid == 4 * 16) {
                *reinterpret_cast<float4*>(vrec + TRec::EGC) = make_float4(s.eg[C - 1], 0.f, 0.f, 0.f);
            }
        } else if (tid < 3 * 16) {
            const float* src = tid < 16 ? s.beta : tid < 32 ? s.eg : s.wd;
            *reinterpret_cast<uint4*>(vrec + VRec::BETA + tid * 16) = *reinterpret_cast<const uint4*>(src + (tid & 15) * 4);
        }
        __syncthreads();   // s.a, s.p, s.dinv, s.beta, s.eg, s.wd read out before the next head rewrites them
    }
}

}  // namespace gdnc
