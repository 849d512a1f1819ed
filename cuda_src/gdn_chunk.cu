// gdn_chunk.cu: Gated DeltaNet (Qwen3-Next) prefill over varlen streams, chunked (WY) form on
// bf16 tensor cores (mma.sync m16n8k16, fp32 accumulate). Same math, arguments and in-place
// state contract as gdn_prefill.cu (the recurrent form, see its header):
//     k^ = k / sqrt(sum k^2 + 1e-6),  q~ = q / sqrt(sum q^2 + 1e-6) * dk^-1/2   (fp32)
//     S <- exp(g_t) S;  S <- S + k^ (beta_t (v_t - S^T k^))^T;  o_t = S^T q~
//
// Algebra, per chunk of C = 64 tokens of one (stream, value head); gamma = inclusive cumsum of g in
// the chunk, K/Q = the normalised rows, S = the fp32 state [dk, dv]:
//     A     = strictly_lower(beta_i exp(gamma_i - gamma_j) (K K^T)_ij)
//     R     = beta (V - exp(gamma) (K S))
//     V_new = (I + A)^-1 R                       (= FLA's u - w S, without forming w and u)
//     O     = exp(gamma) (Q S) + (Q K^T exp(gamma_i - gamma_j) [j <= i]) V_new
//     S     = exp(gamma_C) S + (K exp(gamma_C - gamma))^T V_new
// (I + A)^-1 is applied by block forward substitution over four 16-token blocks: the diagonal
// blocks are inverted in fp32 by substitution (64 threads, one column each), the off-diagonal
// blocks of -A and the inverses go through the tensor cores.
// Every warp works on S^T (dv rows, dk columns): with S^T as the mma accumulator, its C fragments
// are directly A fragments of the next products (S^T K^T, R^T, V_new^T P^T, V_new^T K), so the
// state never leaves registers and the four warps never exchange state data.
//
// Geometry: grid (dv/64, Hv, n), block 128 (4 warps); warp w owns dv columns 16w..16w+15 of the CTA's
// 64-column slice (BV = 64; a launch with any other grid.x or block does nothing). A CTA never mixes
// streams (batched == alone, bit for bit); the dv columns of S evolve independently, so slices never
// talk. Streams of length 0 are skipped (state untouched). The last chunk is partial: rows >= len load
// as zero (k, q, v, beta, g), so they change nothing, and their o is never written.
// Pipeline (GDN_PREFETCH 1): cp.async (zero-fill past the stream) brings raw K, the V slice, g and beta
// of chunk c+1 into a second buffer while chunk c computes (issued after c's normalisation), and raw Q
// into s.q once c's Q reads are done; four barriers per chunk. GDN_WARP_INV 1: the warp that computes
// a diagonal block of K K^T inverts it (16 lanes, fp32 substitution) right away, no barrier of its own.
// Shared memory (dynamic, gdnc::Smem<dk>): bf16 K hi, K lo, Q [64][dk+8]; raw K [64][dk]; two bf16
// V/O slices [64][72]; -A (off-diagonal blocks), P [64][72]; bf16 diagonal inverses [64][24]; fp32
// diagonal blocks [4][16][17]; g, beta [2][64]; gamma, beta, exp(gamma), exp(gamma_C - gamma) [64]:
// 114,944 B (d128), 82,176 B (d64): 2 CTAs/SM at d128. Registers: S^T slice 64 fp32 (d128)
// + two 32-float accumulators; 255 with NVRTC 13.5, no spills (scalars the loop does not need in
// registers are re-read: ld_volatile).
// Per warp and chunk (d128): 80 mma for K K^T / Q K^T (warp w: K rows of block w, Q rows of
// block 3-w, causal tiles only), 64 K S, 40 solve, 64 Q S, 40 P V_new, 192 state update.
//
// Precision (measured with q12drv.kernels.gdn_chunk.chunked_reference, the numpy model of this
// kernel, against the float64 reference; random inputs, non-zero initial state, up to 1100
// tokens): o relative error ~3.7e-3 (the bf16 rounding of o itself is ~2.5e-3), final state
// ~1e-4..3e-4. The state error is dominated by the update K^T V_new: with bf16 K and bf16 V_new
// it is ~1.7e-3, so that product uses hi + lo bf16 pairs of both (three mma: hi hi, lo hi, hi lo;
// GDN_UPD_SPLIT 1). V_new and the solve's intermediates always enter as hi + lo pairs (cheap).
// S enters K S and Q S as one bf16 (GDN_S_HILO 0): a hi + lo pair changed the error by < 1%.
// The split pair (ops.gdn(algo="split")): the chunk-local work (normalisation, gamma, K K^T, Q K^T, -A, P,
// the diagonal inverses) does not depend on the state, so q12_gdn_chunk_prep_d* does it for every (stream,
// key head, chunk) in parallel, grid (chunks, Hk, n), into a caller-provided workspace: a K record per
// (stream, key head, chunk) (K hi, K lo, Q: 48 KiB at d128), K K^T and Q K^T computed once per key head, and
// a V record per (stream, value head, chunk) (-A, P, inverses, beta, exp(gamma), exp(gamma_C - gamma):
// 18.75 KiB), each value head's beta and gamma applied in the epilogues (gdnc::PrepSmem: 62,720 B, 3 CTAs/SM).
// q12_gdn_chunk_seq*_d* is the fused kernel's loop with only the state step on each chunk's serial path.
// seq (two record buffers, 167,424 B, 1 CTA/SM) loads the next chunk's records while this one computes: for
// grids of few CTAs; seq1 (one buffer, 83,712 B, 2 CTAs/SM) loads at the top of each chunk while the other
// CTA computes: for grids of >= 2 CTAs per SM (gdn_chunk.split_stages). The same phase functions run on the
// same values: o and the final states are bit-identical to the fused kernel (tests/gpu/test_gdn_gpu.py).
// Costs: the workspace (gdn_chunk.workspace_bytes: n x ceil(chunk_len / 64) x (Hk x 48 KiB + Hv x 18.75 KiB) at
// d128; 1 x 8192 Qwen3-Next heads: 171 MiB) and one more launch.
// The split pair, H200, CUDA events, medians (tests/GPU.md session 3, run L, commit 3e0ccea), ms, fused in
// brackets: 8 x 2048 0.696 (1.066), 1 x 8192 0.720 (1.465), ragged 8 x 256..2048 0.481 (0.732), 8 x 128 0.079
// (0.088), 1 x 2048 0.205 (0.393); the precompute kernel alone 0.228 / 0.129 / 0.139 / 0.032 / 0.053. The way
// there (runs H-L): one record per value head, 1 CTA/SM for both kernels: 1.06 / 0.83 / 0.65; K records per
// key head: 0.92-0.95 / 0.76-0.78 / 0.57-0.59; the one-buffer sequential kernel for many CTAs: 0.81 / 0.78 /
// 0.55 (the two-buffer one was 0.94 / 0.78 / 0.58 there: the rule in split_stages picks the faster on all five
// cases); the precompute kernel's own smem layout (3 CTAs/SM): 0.72 / 0.75 / 0.52; its products once per
// key head: the numbers above. fla-core 0.6.0 in run K: 1.49 / 1.33 / 1.43 ms.
// A bf16 state update (GDN_UPD_SPLIT 0, fla's precision) measured 8% faster at 8 x 2048 (fused) with a 7x
// larger state error (5.4e-4 vs 7.9e-5; run G): kept off.
// Tried and kept off (every variant bit-identical or within the model's error): GDN_PREFETCH 1 (+3..7% at
// 8 x 2048, -4% at 1 x 8192, and 16 B of local memory on NVRTC 13.0), GDN_WARP_INV 1 (+10%). Tried and removed:
// GDN_KSPLIT 2 (two warps per 16 dv columns, each holding half of S^T's dk columns; +40% at 8 x 2048, +3% at
// 1 x 8192: the pair's partial sums and the redundant solve cost more than the halved chains save); narrower
// dv slices BV 32 (64 threads, 2.3x slower on every case: the chunk-local work is repeated per slice) and
// BV 16 (32 threads, 10x slower), removed after measuring (they had filled the grid when dv/64 * Hv * n
// CTAs were fewer than the SMs).
// Requirements: q, k 16-byte aligned, v, o 8-byte aligned (as the recurrent kernel); dv a multiple of 64.
#include "q12_meta.cuh"
#include "gdn_norm.cuh"

#define GDN_C 64      // tokens per chunk
#define GDN_BV 64     // dv columns per CTA: 4 warps of 16 (the host's gdn_chunk.BV)
#ifndef GDN_S_HILO
#define GDN_S_HILO 0
#endif
#ifndef GDN_UPD_SPLIT
#define GDN_UPD_SPLIT 1
#endif
#ifndef GDN_PREFETCH   // 1: cp.async of chunk c+1 while chunk c computes; 0: load each chunk when it starts
#define GDN_PREFETCH 0
#endif
#ifndef GDN_WARP_INV   // 1: each warp inverts the diagonal blocks it computed, no extra barrier; 0: separate phase
#define GDN_WARP_INV 0
#endif
#ifndef GDN_NORM_UNROLL  // unroll of the normalisation passes
#define GDN_NORM_UNROLL 2
#endif

namespace gdnc {

__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_t(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_u32(p)));
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
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

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

// hi = bf16(x), lo = bf16(x - hi), for a pair of values.
__device__ __forceinline__ void pack_hilo(float x0, float x1, unsigned& hi, unsigned& lo) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    const float2 hf = __bfloat1622float2(h);
    __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
    hi = *reinterpret_cast<unsigned*>(&h);
    lo = *reinterpret_cast<unsigned*>(&l);
}

// A fragment (16 x 16, k = 16 columns) from two accumulator n-tiles c0 (columns 0..7), c1 (8..15).
__device__ __forceinline__ void a_from_c(const float* c0, const float* c1, unsigned* a) {
    a[0] = pack(c0[0], c0[1]);
    a[1] = pack(c0[2], c0[3]);
    a[2] = pack(c1[0], c1[1]);
    a[3] = pack(c1[2], c1[3]);
}

__device__ __forceinline__ void a_from_c_hilo(const float* c0, const float* c1, unsigned* hi, unsigned* lo) {
    pack_hilo(c0[0], c0[1], hi[0], lo[0]);
    pack_hilo(c0[2], c0[3], hi[1], lo[1]);
    pack_hilo(c1[0], c1[1], hi[2], lo[2]);
    pack_hilo(c1[2], c1[3], hi[3], lo[3]);
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
    bf16 kraw[GDN_C * DK];    // raw k rows (cp.async; the next chunk's while this one computes)
    bf16 v[2][GDN_C * LDV];   // V slice, then O slice (each warp reuses its own 16 columns); double buffer
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

// Which warp computes K rows of 16-token block mt (Q rows of block mq: owner(3 - mq)); balanced causal work.
template <int NW>
__device__ __forceinline__ int owner(int mt) {
    if (NW == 4) return mt;
    if (NW == 2) return mt < 2 ? mt : 3 - mt;
    return 0;
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
#if GDN_S_HILO
        unsigned a[4], alo[4];
        a_from_c_hilo(St[2 * ks], St[2 * ks + 1], a, alo);
#else
        unsigned a[4];
        a_from_c(St[2 * ks], St[2 * ks + 1], a);
#endif
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            unsigned b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3, x + (16 * np + (mat >> 1) * 8 + r) * LDK + 16 * ks + (mat & 1) * 8);
            mma(acc[2 * np], a, b0, b1);
            mma(acc[2 * np + 1], a, b2, b3);
#if GDN_S_HILO
            mma(acc[2 * np], alo, b0, b1);
            mma(acc[2 * np + 1], alo, b2, b3);
#endif
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

// ---- the per-chunk phases, shared by the fused kernel, the split pair's precompute kernel (chunk-local
//      work) and its sequential kernel (the state work)

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

// cp.async of the V slice (columns col0..col0+63 of value head h, [T, num_v_heads, DV] bf16) of 64 rows from
// packed token tok into dst (row stride BV + 8): 8-byte pieces (v needs 8-byte alignment only); rows >= nv
// read nothing and land as zeros.
template <int DV>
__device__ __forceinline__ void issue_v_slice(bf16* dst, const bf16* __restrict__ v, int nv, int tok, int num_v_heads,
                                              int h, int col0, int tid) {
    constexpr int C = GDN_C, BV = GDN_BV, THREADS = 128, LDV = GDN_BV + 8;
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
// Partly unrolled: a full unroll hoists every row's loads and spills next to S^T.
template <int DK, typename S>
__device__ __forceinline__ void normalise(S& s, bf16* klo, int klo_ld, int tid, int seg, float qscale) {
    constexpr int C = GDN_C, THREADS = 128, SEGS = DK / 8, RPP = THREADS / SEGS, LDK = DK + 8;
#pragma unroll GDN_NORM_UNROLL
    for (int p = 0; p < C / RPP; ++p) {
        const int row = tid / SEGS + p * RPP;
#pragma unroll
        for (int which = 0; which < 2; ++which) {  // 0: k, 1: q
            const uint4 raw = which ? *reinterpret_cast<const uint4*>(&s.q[row * LDK + seg * 8])
                                    : *reinterpret_cast<const uint4*>(&s.kraw[row * DK + seg * 8]);
            float x[8];
            const float inv = gdn_row_inv_norm<SEGS>(raw, x);
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
                *reinterpret_cast<uint4*>(&klo[row * klo_ld + seg * 8]) = lo;
            }
        }
    }
}

// gamma = inclusive cumsum of g (one warp, two tokens per lane), exp(gamma), exp(gamma_C - gamma); beta copied.
template <typename S>
__device__ __forceinline__ void chunk_gamma(S& s, int buf, int lane) {
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
    s.beta[2 * lane] = s.braw[buf][2 * lane];
    s.beta[2 * lane + 1] = s.braw[buf][2 * lane + 1];
    s.gam[2 * lane] = ga;
    s.gam[2 * lane + 1] = gb;
    s.eg[2 * lane] = expf(ga);
    s.eg[2 * lane + 1] = expf(gb);
    s.wd[2 * lane] = expf(gC - ga);
    s.wd[2 * lane + 1] = expf(gC - gb);
}

// The products' epilogue for block row mt, with beta and gamma of the chunk's value head: KK: acc = K K^T
// rows -> -A (strictly lower, off the diagonal block) and the fp32 diagonal block (GDN_WARP_INV: inverted by
// this warp); else acc = Q K^T rows -> P (lower, diagonal included).
template <bool KK, typename S>
__device__ __forceinline__ void products_epilogue(S& s, const float (*acc)[4], int mt, int lane) {
    constexpr int LDP = GDN_C + 8, LDD = 24;
    const int gq = lane >> 2, tq = lane & 3;
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
#if GDN_WARP_INV
    if (KK) {
        __syncwarp();
        if (lane < 16) invert_column(&s.d[mt * 272], &s.dinv[16 * mt * LDD], lane);
        __syncwarp();
    }
#endif
}

// K K^T (rows of the warp's blocks) -> -A blocks and the fp32 diagonal blocks; Q K^T -> P.
template <int DK, int NW, typename S>
__device__ __forceinline__ void local_products(S& s, int warp, int lane) {
    float acc[8][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
        if (owner<NW>(mt) != warp) continue;
        causal_rows_kt<DK>(acc, s.k, s.k, mt, lane);
        products_epilogue<true>(s, acc, mt, lane);
    }
#pragma unroll
    for (int mq = 0; mq < 4; ++mq) {
        if (owner<NW>(3 - mq) != warp) continue;
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

template <int DK>
__device__ __forceinline__ void state_step(const ChunkOps& c, float (*St)[4], bf16* vo, int warp, int lane) {
    constexpr int C = GDN_C, LDK = DK + 8, LDV = GDN_BV + 8, LDP = C + 8, LDD = 24, NTS = DK / 8;
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
        // block forward substitution: X_b = (R_b + sum_{m<b} X_m (-A_bm)^T) Dinv_b^T
#pragma unroll
        for (int bi = 0; bi < 4; ++bi) {
            float* y0 = Rt[2 * bi];
            float* y1 = Rt[2 * bi + 1];
#pragma unroll
            for (int mm = 0; mm < bi; ++mm) {
                unsigned ahi[4], alo[4], b0, b1, b2, b3;
                a_from_c_hilo(X[2 * mm], X[2 * mm + 1], ahi, alo);
                ldsm_x4(b0, b1, b2, b3, &c.a[(16 * bi + (mat >> 1) * 8 + r8) * LDP + 16 * mm + (mat & 1) * 8]);
                mma(y0, ahi, b0, b1);
                mma(y1, ahi, b2, b3);
                mma(y0, alo, b0, b1);
                mma(y1, alo, b2, b3);
            }
            unsigned ahi[4], alo[4], b0, b1, b2, b3;
            a_from_c_hilo(y0, y1, ahi, alo);
            ldsm_x4(b0, b1, b2, b3, &c.dinv[(16 * bi + (mat >> 1) * 8 + r8) * LDD + (mat & 1) * 8]);
#pragma unroll
            for (int e = 0; e < 4; ++e) X[2 * bi][e] = X[2 * bi + 1][e] = 0.f;
            mma(X[2 * bi], ahi, b0, b1);
            mma(X[2 * bi + 1], ahi, b2, b3);
            mma(X[2 * bi], alo, b0, b1);
            mma(X[2 * bi + 1], alo, b2, b3);
        }
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
#if GDN_UPD_SPLIT
                ldsm_x4_t(b0, b1, b2, b3, &c.klo[off]);
                mma(St[2 * np], ahi, b0, b1);
                mma(St[2 * np + 1], ahi, b2, b3);
#endif
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
__device__ __forceinline__ void store_o(bf16* __restrict__ o, const bf16* ob, const int* cub, int len, int c0,
                                        int num_v_heads, int h, int col0, int tid) {
    constexpr int C = GDN_C, BV = GDN_BV, THREADS = 128, LDV = GDN_BV + 8;
    const int tok0 = ld_volatile(cub);
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

}  // namespace gdnc

// ================================================================ the fused kernel (the default)
template <int DK, int DV>
__device__ __forceinline__ void gdn_chunk_body(const Q12Meta& m, const unsigned long long* __restrict__ h_state_ptrs,
                                               const bf16* __restrict__ q, const bf16* __restrict__ k,
                                               const bf16* __restrict__ v, const float* __restrict__ g,
                                               const float* __restrict__ beta, bf16* __restrict__ o,
                                               int num_k_heads, int num_v_heads) {
    using namespace gdnc;
    using SM = Smem<DK>;
    constexpr int C = GDN_C;
    constexpr int BV = GDN_BV;
    constexpr int NW = BV / 16;                 // warps; warp w owns dv columns 16w..16w+15
    constexpr int THREADS = 32 * NW;
    constexpr int SEGS = DK / 8;                // 16-byte segments per q/k row
    constexpr int RPP = THREADS / SEGS;         // rows per pass
    static_assert(DK % 16 == 0 && DV % BV == 0 && 32 % SEGS == 0 && C % RPP == 0, "shapes");
    static_assert(NW == 4, "4 warps of 16 dv columns");

    extern __shared__ __align__(16) unsigned char gdn_smem_raw[];
    SM& s = *reinterpret_cast<SM*>(gdn_smem_raw);

    const int b = blockIdx.z;
    const int h = blockIdx.y;
    if ((int)blockDim.x != THREADS || b >= (int)m.batch_size || h >= num_v_heads || (int)blockIdx.x * BV >= DV) return;
    const int col0 = blockIdx.x * BV;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;    // mma fragment row group / thread in group

    const int* cu = q12_cu_seqlens(m);
    const int len = cu[b + 1] - cu[b];
    if (len <= 0) return;

    issue_kvgb<DK, DV, true, true, true>(s, s.v[0], cu + b, len, 0, 0, k, v, g, beta, num_k_heads, num_v_heads, h, col0, tid);
    issue_q<DK>(s, cu + b, len, 0, q, num_k_heads, num_v_heads, h, tid);
    cp_async_commit();

    const float* state = reinterpret_cast<const float*>(h_state_ptrs[b]) + (long long)h * DK * DV;
    const int bv0 = col0 + 16 * warp + gq;     // this lane's dv rows of S^T: bv0, bv0 + 8
    float St[DK / 8][4];
    load_state<DK, DV>(St, state, bv0, tq);

    const float qscale = 1.0f / sqrtf((float)DK);
    const int seg = tid % SEGS;
    int buf = 0;
    for (int c0 = 0; c0 < len; c0 += C, buf ^= 1) {
#if !GDN_PREFETCH
        if (c0 > 0) {
            issue_kvgb<DK, DV, true, true, true>(s, s.v[buf], cu + b, len, c0, buf, k, v, g, beta, num_k_heads, num_v_heads, h, col0,
                                     tid);
            issue_q<DK>(s, cu + b, len, c0, q, num_k_heads, num_v_heads, h, tid);
            cp_async_commit();
        }
#endif
        cp_async_wait_all();
        __syncthreads();   // B1: chunk c0's raw rows, V, g, beta in shared memory
        normalise<DK>(s, s.klo, SM::LDK, tid, seg, qscale);
        if (warp == 0) chunk_gamma(s, buf, lane);
        __syncthreads();   // B2: K, Q, gamma ready; kraw free
#if GDN_PREFETCH
        if (c0 + C < len)
            issue_kvgb<DK, DV, true, true, true>(s, s.v[buf ^ 1], cu + b, len, c0 + C, buf ^ 1, k, v, g, beta, num_k_heads,
                                     num_v_heads, h, col0, tid);
        cp_async_commit();
#endif
        local_products<DK, NW>(s, warp, lane);
        __syncthreads();   // B3: -A, P (and the diagonal inverses) complete
#if !GDN_WARP_INV
        invert_diagonal<DK>(s, tid);
        __syncthreads();
#endif
        state_step<DK>(ChunkOps{s.k, s.klo, s.q, s.a, s.p, s.dinv, s.beta, s.eg, s.wd}, St, s.v[buf], warp, lane);
        __syncthreads();   // B4: O slice complete in s.v[buf]; s.q, s.k, s.a, s.p free
#if GDN_PREFETCH
        if (c0 + C < len) issue_q<DK>(s, cu + b, len, c0 + C, q, num_k_heads, num_v_heads, h, tid);
        cp_async_commit();
#endif
        // No barrier after the o store: s.v[buf] is next written by the load two chunks on, behind the next B1.
        store_o<DV>(o, s.v[buf], cu + b, len, c0, num_v_heads, h, col0, tid);
    }
    store_state<DK, DV>(St, reinterpret_cast<float*>(ld_volatile(h_state_ptrs + b)) + (long long)h * DK * DV, bv0, tq);
}

// ================================================================ the split pair
// The chunk-local work (normalisation, gamma, K K^T, Q K^T, the diagonal inverses) does not depend on the
// state: q12_gdn_chunk_prep computes it for every (stream, chunk) in parallel into a workspace, and
// q12_gdn_chunk_seq walks the chunks with only the state step on its serial path, the next chunk's records
// arriving by cp.async while this one computes. The same instructions on the same values as the fused
// kernel: the results are bit-identical to it.

namespace gdnc {

// K record of one (stream, key head, chunk): normalised K hi, K lo, Q [64][DK] bf16 (shared by the value
// heads of that key head). V record of one (stream, value head, chunk): -A, P [64][64] bf16, the diagonal
// inverses [64][16] bf16, beta, exp(gamma), exp(gamma_C - gamma) [64] fp32. Unpadded; byte offsets.
template <int DK>
struct KRec {
    static constexpr int K = 0, KLO = GDN_C * DK * 2, Q = 2 * GDN_C * DK * 2, BYTES = 3 * GDN_C * DK * 2;
};
struct VRec {
    static constexpr int A = 0, P = GDN_C * GDN_C * 2, DINV = 2 * GDN_C * GDN_C * 2, BETA = DINV + GDN_C * 16 * 2,
                         EG = BETA + GDN_C * 4, WD = EG + GDN_C * 4, BYTES = WD + GDN_C * 4;
};

// The workspace: n x ceil(chunk_len / 64) x Hk K records, then n x ceil(chunk_len / 64) x Hv V records.
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

// One chunk's records (rows padded as in Smem<DK>) and V/O slice in the sequential kernel's shared memory.
template <int DK>
struct SeqBuf {
    static constexpr int LDK = DK + 8, LDV = GDN_BV + 8, LDP = GDN_C + 8, LDD = 24;
    bf16 k[GDN_C * LDK];
    bf16 klo[GDN_C * LDK];
    bf16 q[GDN_C * LDK];
    bf16 a[GDN_C * LDP];
    bf16 p[GDN_C * LDP];
    bf16 dinv[GDN_C * LDD];
    bf16 v[GDN_C * LDV];   // V slice, then O slice
    float beta[GDN_C];
    float eg[GDN_C];
    float wd[GDN_C];
};
template <int DK, int STAGES>
struct SeqSmem {
    SeqBuf<DK> buf[STAGES];
};

// The precompute kernel's shared memory: Smem<DK> without what it does not need (V/O slices; K lo goes
// straight to the K record) and with raw K sharing its bytes with -A and P (raw K is read by the
// normalisation, -A and P are first written after it): 62,720 B at d128, 3 CTAs/SM.
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
    float beta[GDN_C];
    float eg[GDN_C];
    float wd[GDN_C];
};

// cp.async of chunk c's records and V slice into one buffer of the sequential kernel.
template <int DK, int DV>
__device__ __forceinline__ void issue_record(SeqBuf<DK>& sb, const unsigned char* krec,
                                             const unsigned char* vrec, const bf16* __restrict__ v, const int* cub,
                                             int len, int c, int num_v_heads, int h, int col0, int tid) {
    constexpr int C = GDN_C, BV = GDN_BV, THREADS = 128, SEGS = DK / 8;
    constexpr int LDK = SeqBuf<DK>::LDK, LDV = SeqBuf<DK>::LDV, LDP = SeqBuf<DK>::LDP, LDD = SeqBuf<DK>::LDD;
#pragma unroll 1
    for (int idx = tid; idx < 3 * C * SEGS; idx += THREADS) {   // K hi, K lo, Q
        const int which = idx / (C * SEGS), rest = idx % (C * SEGS), row = rest / SEGS, sg = rest % SEGS;
        bf16* dst = (which == 0 ? sb.k : which == 1 ? sb.klo : sb.q) + row * LDK + sg * 8;
        cp_async16(dst, krec + which * (C * DK * 2) + row * (DK * 2) + sg * 16, true);
    }
#pragma unroll
    for (int idx = tid; idx < 2 * C * 8; idx += THREADS) {      // -A, P
        const int which = idx / (C * 8), rest = idx % (C * 8), row = rest / 8, sg = rest % 8;
        cp_async16((which ? sb.p : sb.a) + row * LDP + sg * 8, vrec + VRec::A + which * (C * C * 2) + row * 128 + sg * 16,
                   true);
    }
    if (tid < 2 * C) cp_async16(sb.dinv + (tid >> 1) * LDD + (tid & 1) * 8, vrec + VRec::DINV + tid * 16, true);
    if (tid < 3 * 16) {                                         // beta, exp(gamma), exp(gamma_C - gamma)
        float* dst = tid < 16 ? sb.beta : tid < 32 ? sb.eg : sb.wd;
        cp_async16(dst + (tid & 15) * 4, vrec + VRec::BETA + tid * 16, true);
    }
    issue_v_slice<DV>(sb.v, v, min(C, len - c), ld_volatile(cub) + c, num_v_heads, h, col0, tid);
}

}  // namespace gdnc

// grid (ceil(chunk_len / 64), Hk, n), 128 threads, dynamic smem PrepSmem<DK>: one chunk of one (stream, key
// head): its K record, K K^T and Q K^T once, then each value head's V record (its beta and gamma scale the
// products in the epilogues).
template <int DK, int DV>
__device__ __forceinline__ void gdn_prep_body(const Q12Meta& m, const bf16* __restrict__ q, const bf16* __restrict__ k,
                                              const float* __restrict__ g, const float* __restrict__ beta,
                                              int num_k_heads, int num_v_heads, unsigned char* __restrict__ ws) {
    using namespace gdnc;
    using SM = PrepSmem<DK>;
    constexpr int C = GDN_C, THREADS = 128, SEGS = DK / 8, LDK = SM::LDK, LDP = SM::LDP, LDD = SM::LDD;
    extern __shared__ __align__(16) unsigned char gdn_smem_raw[];
    SM& s = *reinterpret_cast<SM*>(gdn_smem_raw);

    const int b = blockIdx.z, kh = blockIdx.y, ci = blockIdx.x;
    if ((int)blockDim.x != THREADS || b >= (int)m.batch_size || kh >= num_k_heads) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int* cu = q12_cu_seqlens(m);
    const int len = cu[b + 1] - cu[b];
    const int c0 = ci * C;
    if (c0 >= len) return;
    const int group = num_v_heads / num_k_heads;

    issue_kvgb<DK, DV, true, false, true>(s, nullptr, cu + b, len, c0, 0, k, nullptr, g, beta, num_k_heads, num_v_heads,
                                          kh * group, 0, tid);
    issue_q<DK>(s, cu + b, len, c0, q, num_k_heads, num_v_heads, kh * group, tid);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    unsigned char* krec = krec_at<DK>(ws, m, b, ci, kh, num_k_heads);
    normalise<DK>(s, reinterpret_cast<bf16*>(krec + KRec<DK>::KLO), DK, tid, tid % SEGS, 1.0f / sqrtf((float)DK));
    __syncthreads();   // raw K read out: its bytes become -A and P
    // -A and P: every byte of the records defined (the products write only the blocks the solve reads,
    // the same ones for every value head)
    for (int i = tid; i < 2 * C * LDP / 8; i += THREADS) reinterpret_cast<uint4*>(s.a)[i] = make_uint4(0, 0, 0, 0);
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
        if (j > 0) {   // this value head's g and beta (the previous head's products are written out)
            issue_kvgb<DK, DV, false, false, true>(s, nullptr, cu + b, len, c0, 0, k, nullptr, g, beta, num_k_heads,
                                                   num_v_heads, h, 0, tid);
            cp_async_commit();
            cp_async_wait_all();
        }
        __syncthreads();
        if (warp == 0) chunk_gamma(s, 0, lane);
        __syncthreads();
        products_epilogue<true>(s, acck, warp, lane);
        products_epilogue<false>(s, accq, 3 - warp, lane);
        __syncthreads();
#if !GDN_WARP_INV
        invert_diagonal<DK>(s, tid);
        __syncthreads();
#endif
        unsigned char* vrec = vrec_at<DK>(ws, m, b, ci, h, num_k_heads, num_v_heads);
        for (int idx = tid; idx < 2 * C * 8; idx += THREADS) {
            const int which = idx / (C * 8), rest = idx % (C * 8), row = rest / 8, sg = rest % 8;
            *reinterpret_cast<uint4*>(vrec + VRec::A + which * (C * C * 2) + row * 128 + sg * 16) =
                *reinterpret_cast<const uint4*>((which ? s.p : s.a) + row * LDP + sg * 8);
        }
        if (tid < 2 * C)
            *reinterpret_cast<uint4*>(vrec + VRec::DINV + tid * 16) =
                *reinterpret_cast<const uint4*>(s.dinv + (tid >> 1) * LDD + (tid & 1) * 8);
        if (tid < 3 * 16) {
            const float* src = tid < 16 ? s.beta : tid < 32 ? s.eg : s.wd;
            *reinterpret_cast<uint4*>(vrec + VRec::BETA + tid * 16) = *reinterpret_cast<const uint4*>(src + (tid & 15) * 4);
        }
        __syncthreads();   // s.a, s.p, s.dinv, s.beta, s.eg, s.wd read out before the next head rewrites them
    }
}

// grid (DV / 64, Hv, n), 128 threads, dynamic smem SeqSmem<DK, STAGES>: the fused kernel's chunk loop with the
// chunk-local work read from the records. STAGES 2: the next chunk's records load while this one computes
// (1 CTA/SM: for grids of few CTAs, where nothing else would hide the loads); STAGES 1: one buffer, loaded
// at the top of each chunk (2 CTAs/SM: for grids of several waves, where the other CTA computes meanwhile).
template <int DK, int DV, int STAGES>
__device__ __forceinline__ void gdn_seq_body(const Q12Meta& m, const unsigned long long* __restrict__ h_state_ptrs,
                                             const bf16* __restrict__ v, bf16* __restrict__ o, int num_k_heads,
                                             int num_v_heads, unsigned char* __restrict__ ws) {
    using namespace gdnc;
    constexpr int C = GDN_C, BV = GDN_BV, THREADS = 128;
    extern __shared__ __align__(16) unsigned char gdn_smem_raw[];
    SeqSmem<DK, STAGES>& ss = *reinterpret_cast<SeqSmem<DK, STAGES>*>(gdn_smem_raw);

    const int b = blockIdx.z, h = blockIdx.y;
    if ((int)blockDim.x != THREADS || b >= (int)m.batch_size || h >= num_v_heads || (int)blockIdx.x * BV >= DV) return;
    const int col0 = blockIdx.x * BV;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;
    const int* cu = q12_cu_seqlens(m);
    const int len = cu[b + 1] - cu[b];
    if (len <= 0) return;
    const int kh = h / (num_v_heads / num_k_heads);

    issue_record<DK, DV>(ss.buf[0], krec_at<DK>(ws, m, b, 0, kh, num_k_heads),
                         vrec_at<DK>(ws, m, b, 0, h, num_k_heads, num_v_heads), v, cu + b, len, 0, num_v_heads, h, col0,
                         tid);
    cp_async_commit();
    const float* state = reinterpret_cast<const float*>(h_state_ptrs[b]) + (long long)h * DK * DV;
    const int bv0 = col0 + 16 * warp + gq;
    float St[DK / 8][4];
    load_state<DK, DV>(St, state, bv0, tq);

    int t = 0;
    for (int c0 = 0, ci = 0; c0 < len; c0 += C, ++ci, t ^= (STAGES - 1)) {
        if (STAGES == 1 && c0 > 0) {   // the buffer's o rows are stored: load this chunk into it
            __syncthreads();
            issue_record<DK, DV>(ss.buf[0], krec_at<DK>(ws, m, b, ci, kh, num_k_heads),
                                 vrec_at<DK>(ws, m, b, ci, h, num_k_heads, num_v_heads), v, cu + b, len, c0,
                                 num_v_heads, h, col0, tid);
            cp_async_commit();
        }
        cp_async_wait_all();
        __syncthreads();   // chunk ci's records and V slice in buf[t]; buf[t ^ 1] free (its o rows stored)
        if (STAGES == 2) {
            if (c0 + C < len)
                issue_record<DK, DV>(ss.buf[(t + 1) % STAGES], krec_at<DK>(ws, m, b, ci + 1, kh, num_k_heads),
                                     vrec_at<DK>(ws, m, b, ci + 1, h, num_k_heads, num_v_heads), v, cu + b, len, c0 + C,
                                     num_v_heads, h, col0, tid);
            cp_async_commit();
        }
        SeqBuf<DK>& sb = ss.buf[t];
        state_step<DK>(ChunkOps{sb.k, sb.klo, sb.q, sb.a, sb.p, sb.dinv, sb.beta, sb.eg, sb.wd}, St, sb.v, warp, lane);
        __syncthreads();   // O slice complete in buf[t].v
        store_o<DV>(o, sb.v, cu + b, len, c0, num_v_heads, h, col0, tid);
    }
    store_state<DK, DV>(St, reinterpret_cast<float*>(ld_volatile(h_state_ptrs + b)) + (long long)h * DK * DV, bv0, tq);
}

#define GDN_MAX_THREADS 128
// One dv slice width: grid.x must be D / 64 (and the block 128 threads, checked in the body).
template <int D>
__device__ __forceinline__ void gdn_chunk_dispatch(const Q12Meta& m, const unsigned long long* __restrict__ h_state_ptrs,
                                                   const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                   const bf16* __restrict__ v, const float* __restrict__ g,
                                                   const float* __restrict__ beta, bf16* __restrict__ o,
                                                   int num_k_heads, int num_v_heads) {
    if (gridDim.x == D / GDN_BV) gdn_chunk_body<D, D>(m, h_state_ptrs, q, k, v, g, beta, o, num_k_heads, num_v_heads);
}

extern "C" __global__ void __launch_bounds__(GDN_MAX_THREADS) q12_gdn_chunk_d128(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads) {
    gdn_chunk_dispatch<128>(m, h_state_ptrs, q, k, v, g, beta, o, num_k_heads, num_v_heads);
}

extern "C" __global__ void __launch_bounds__(GDN_MAX_THREADS) q12_gdn_chunk_d64(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads) {
    gdn_chunk_dispatch<64>(m, h_state_ptrs, q, k, v, g, beta, o, num_k_heads, num_v_heads);
}

// The split pair takes the fused kernel's arguments and the workspace (see q12drv.kernels.gdn_chunk).
extern "C" __global__ void __launch_bounds__(GDN_MAX_THREADS, 3) q12_gdn_chunk_prep_d128(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    gdn_prep_body<128, 128>(m, q, k, g, beta, num_k_heads, num_v_heads, workspace);
}
extern "C" __global__ void __launch_bounds__(GDN_MAX_THREADS, 3) q12_gdn_chunk_prep_d64(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    gdn_prep_body<64, 64>(m, q, k, g, beta, num_k_heads, num_v_heads, workspace);
}
extern "C" __global__ void __launch_bounds__(GDN_MAX_THREADS) q12_gdn_chunk_seq_d128(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    if (gridDim.x == 128 / GDN_BV) gdn_seq_body<128, 128, 2>(m, h_state_ptrs, v, o, num_k_heads, num_v_heads, workspace);
}
extern "C" __global__ void __launch_bounds__(GDN_MAX_THREADS) q12_gdn_chunk_seq_d64(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    if (gridDim.x == 64 / GDN_BV) gdn_seq_body<64, 64, 2>(m, h_state_ptrs, v, o, num_k_heads, num_v_heads, workspace);
}
extern "C" __global__ void __launch_bounds__(GDN_MAX_THREADS) q12_gdn_chunk_seq1_d128(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    if (gridDim.x == 128 / GDN_BV) gdn_seq_body<128, 128, 1>(m, h_state_ptrs, v, o, num_k_heads, num_v_heads, workspace);
}
extern "C" __global__ void __launch_bounds__(GDN_MAX_THREADS) q12_gdn_chunk_seq1_d64(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    if (gridDim.x == 64 / GDN_BV) gdn_seq_body<64, 64, 1>(m, h_state_ptrs, v, o, num_k_heads, num_v_heads, workspace);
}

// The host's q12drv.kernels.gdn_chunk.smem_bytes(d) must give these numbers.
static_assert(sizeof(gdnc::Smem<128>) == 114944, "Smem<128> size differs from gdn_chunk.smem_bytes(128)");
static_assert(sizeof(gdnc::Smem<64>) == 82176, "Smem<64> size differs from gdn_chunk.smem_bytes(64)");
static_assert(gdnc::KRec<128>::BYTES == 49152 && gdnc::KRec<64>::BYTES == 24576 && gdnc::VRec::BYTES == 19200,
              "record sizes differ from gdn_chunk.k_record_bytes / v_record_bytes");
static_assert(sizeof(gdnc::PrepSmem<128>) == 62720 && sizeof(gdnc::PrepSmem<64>) == 46336,
              "PrepSmem size differs from gdn_chunk.prep_smem_bytes");
static_assert(sizeof(gdnc::SeqSmem<128, 2>) == 167424 && sizeof(gdnc::SeqSmem<64, 2>) == 118272,
              "SeqSmem size differs from gdn_chunk.seq_smem_bytes");
