// gdn/chunked_wgmma.cu: the sequential kernels of the chunked Gated DeltaNet's wgmma schedules, on Hopper's
// warpgroup MMA (compiled for sm_90a), and the overlapped schedule's precompute.
//
// The two-pass schedule: its first launch is gdn/chunked_mma.cu's q12_gdn_wgmma_precompute_d*, the chunk-local work
// of every (stream, chunk) in parallel, into one T record per (stream, value head, chunk) in the workspace
// (gdn/chunk.cuh: TRec, 128-byte swizzled tiles; no K record). Same math, arguments and in-place state contract as
// gdn/chunked_mma.cu (its header has the algebra); what differs is the solve, the rows the state's products take
// and the instructions. With k, q the raw bf16 rows, rk = 1 / |k| and rq = dk^-1/2 / |q| per token (K = rk k,
// Q = rq q are the normalised rows):
//     T       = (I + A)^-1                     (the precompute: the block solve applied to the identity, bf16)
//     R^T     = beta (V^T - exp(gamma) rk (S^T k^T))
//     V_new^T = R^T T^T                        (one product instead of four dependent block steps)
//     O^T     = exp(gamma) rq (S^T q^T) + V_new^T P^T
//     S^T     = exp(gamma_C) S^T + (V_new^T exp(gamma_C - gamma) rk) k
// (the per-token factors EK = exp(gamma) rk, EQ = exp(gamma) rq, WK = exp(gamma_C - gamma) rk come in the record).
// CTA: one warpgroup (128 threads) owns S^T [64 dv x dk] of one (stream, value head, 64-column dv slice) as
// the accumulator of m64n{dk}k16 (64 fp32 registers a thread at dk 128), grid (dv / 64, Hv, n). S^T's bf16 A
// fragments come straight from that accumulator (wgmma.cuh), so the state never leaves registers. Per chunk:
//   X, Y = S^T k^T, S^T q^T:  2 dk/16 wgmma m64n64k16, A = bf16(S^T) from registers, B = k, q (K-major tiles);
//                             X is committed alone, so R is computed while Y's wgmma run;
//   V_new^T:                  8 m64n64k16, A = R^T as bf16 hi + lo, B = T (K-major);
//   O^T += V_new^T P^T:       4 m64n64k16, A = V_new^T's bf16 hi, B = P (K-major);
//   S^T += Vd^T k:            8 m64n{dk}k16, A = Vd^T hi + lo, B = k (the same tile, MN-major; k is exact in bf16,
//                             so two products carry what takes three with the normalised K's hi + lo).
// The epilogues move the V slice in and the O slice out by 8 x 8 matrices, transposed (ldmatrix / stmatrix .trans),
// read the per-token factors as float2 pairs and split the hi + lo pairs from hi's bits (pack_hilo<true>).
// Loads: the raw k and q rows of the chunk's key head come by cp.async from every thread straight into the
// stage's swizzled tiles (gdn/chunk.cuh's issue_kq_sw128), the V slice (strided in v) the same way, and the T
// record, a byte image of the stage's TRec bytes, by one bulk copy from thread 0 (cp.async.bulk, completing on the
// stage's mbarrier). Two stages (1 CTA/SM), for grids of few CTAs: chunk c + 1 loads while c computes, its copies
// issued while c's X and Y run, off the chain. For grids of two CTAs an SM or more: at d64 one stage (2 CTAs/SM):
// chunk c + 1's rows and record are copied as soon as c's last wgmma is done, its V slice once c's o rows are
// stored, while the other CTA computes; at d128 the wide CTA (q12_gdn_wgmma_sequential_wide_d128): two warpgroups
// per (stream, value head), each one 64-column dv slice with its own V and O slices, the chunk's k tile (copied by
// warpgroup 0), q tile (warpgroup 1) and T record shared, so that each comes to shared memory once for both slices;
// two stages, 1 CTA/SM. These kernels give grid row z the z-th longest stream (longest_first), so that a ragged pass's longest
// streams start in the first wave: the order changes no result (a CTA never mixes streams).
// Numerics: the mma schedules' operands and roundings (bf16 S into the products, hi + lo pairs for R and the
// update's left operand) with T rounded to bf16 once, O's product from V_new's bf16 hi, and the raw rows with fp32
// scales where the mma schedules take the rounded normalised rows (in the precompute's A and P too):
// q12drv.kernels.gdn.reference.chunked_reference(path="wgmma") models them. Not the fused kernel's bits; the one-
// stage, two-stage and wide kernels give the same bits, and batched == alone holds.
// Shared memory (dynamic, 1 KiB slack for the tiles' 1024-byte alignment) per stage: k, q tiles (2 x 64 x dk
// bf16), T and P tiles (2 x 8 KiB), beta / EK / EQ / WK (1 KiB) and exp(gamma_C) (16 B), the V and O slices
// [64][72] bf16, rounded up to 1 KiB (68 KiB at d128); then one mbarrier per stage.
// Requirements: as gdn/chunked_mma.cu (q, k 16-byte aligned, v, o 8-byte aligned; dv a multiple of 64), and the
// workspace 16-byte aligned (the bulk copies).
//
// The overlapped schedule (its section below): the precompute runs beside the sequential kernel.
#include "gdn/chunk.cuh"
#include "common/wgmma.cuh"

// The wgmma kernels' configuration: the overlapped precompute's 128-thread groups a CTA, the ready flags its
// sequential kernel reads at one poll, the chunks from each stream's first whose precompute items are per value head
// (later chunks': per key head), and the warpgroups of the wide CTA. The host sizes and counts by the first, third
// and fourth (the contract defines Q12_GDN_OVERLAP_GROUPS, Q12_GDN_OVERLAP_VH_CHUNKS, Q12_GDN_WIDE_WARPGROUPS).
struct WgmmaConfig {
    int overlap_groups, flags_per_poll, value_head_chunks, wide_warpgroups;
};
__host__ __device__ constexpr WgmmaConfig wgmma_config() { return {3, 32, 8, 2}; }

namespace gdnw {

using namespace gdnc;

enum : int { TILE64 = GDN_C * GDN_C * 2 };   // one [64][64] bf16 tile (T diag(beta) hi or lo, a V slice)

// The overlapped schedule's record, one per (stream, value head, chunk): -W = -T diag(beta EK) k as a [64][DK] bf16
// tile (the k tile's 128-byte swizzle: the sequential kernel's S^T (-W)^T takes it where X takes k), P (swizzled),
// [64] fp32 EQ and WK, exp(gamma_C) and 12 zero bytes (COMMON bytes: one bulk copy); then T diag(beta) as bf16 hi
// and lo [64 j][64 t] swizzled tiles (TB: a second bulk copy).
template <int DK>
struct OverlapRec {
    static constexpr int W = 0, P = GDN_C * DK * 2, EQ = P + GDN_C * GDN_C * 2, WK = EQ + GDN_C * 4,
                         EGC = WK + GDN_C * 4, COMMON = EGC + 16;
    static constexpr int TB = COMMON, BYTES = TB + 2 * TILE64;
    static_assert(COMMON % 16 == 0 && P % 1024 == 0, "bulk copies of 16-byte multiples; P on a 1024-byte atom");
};

// Byte offsets inside one stage (from its 1024-byte aligned start); BYTES is a multiple of 1024. WGS: warpgroups
// of the CTA, each with its own V and O slices (slice w at V + w * SLICE, O + w * SLICE); the tiles and the T
// record are shared. OVERLAP (the overlapped schedule): the record is OverlapRec's common part (W, P, EQ, WK,
// exp(gamma_C)), then T diag(beta)'s hi and lo tiles and the CTA's V slice (swizzled, 8 KiB each, from the next
// 1 KiB).
template <int DK, int WGS = 1, bool OVERLAP = false>
struct Stage {
    using OR = OverlapRec<DK>;
    static constexpr int KT = GDN_C * DK * 2;                    // one [64 x DK] bf16 tile
    static constexpr int K = 0, Q = KT;                          // raw k and q rows, swizzled
    static constexpr int VREC = 2 * KT;                          // TRec or OverlapRec's common part (one bulk copy)
    static constexpr int REC = OVERLAP ? OR::COMMON : TRec::BYTES;
    static constexpr int T = VREC + TRec::T, W = VREC + OR::W;   // T (two-pass), -W (overlapped)
    static constexpr int P = VREC + (OVERLAP ? OR::P : TRec::P);
    static constexpr int BETA = VREC + TRec::BETA, EK = VREC + TRec::EK;   // (two-pass)
    static constexpr int EQ = VREC + (OVERLAP ? OR::EQ : TRec::EQ), WK = VREC + (OVERLAP ? OR::WK : TRec::WK);
    static constexpr int EGC = VREC + (OVERLAP ? OR::EGC : TRec::EGC);
    static constexpr int LDV = GDN_BV + 8, SLICE = GDN_C * LDV * 2;
    static constexpr int TB = (VREC + REC + 1023) / 1024 * 1024;  // (overlapped) T diag(beta) hi, lo: 2 x 8 KiB tiles
    static constexpr int VS = TB + 2 * TILE64;                   // (overlapped) the V slice: a swizzled [64][64] tile
    static constexpr int V = VREC + REC;                         // (two-pass) the V slices [64][LDV] bf16
    static constexpr int O = OVERLAP ? VS + TILE64 : V + WGS * SLICE;   // the O slices
    static constexpr int RAW = O + WGS * SLICE;                 // the last stage's extent (the mbarriers follow it)
    static constexpr int BYTES = (RAW + 1023) / 1024 * 1024;    // a stage's stride (the next on 1024 bytes)
    static_assert(VREC % 1024 == 0 && P % 1024 == 0 && V % 16 == 0 && RAW % 16 == 0, "stage layout: the tiles on "
                  "1024-byte atoms, the slices and the mbarriers 16-byte aligned");
    static_assert(!OVERLAP || WGS == 1, "the overlapped sequential kernel: one warpgroup a CTA");
};

// Dynamic shared memory of a sequential kernel: STAGES - 1 stages at their stride, the last one's own bytes, one
// 8-byte mbarrier a stage (16 bytes a pair), and the slack that puts the first stage on 1024 bytes (the dynamic
// shared memory is 128-byte aligned: 896 bytes).
template <int DK, int WGS, bool OVERLAP, int STAGES>
__host__ __device__ constexpr int sequential_smem() {
    using L = Stage<DK, WGS, OVERLAP>;
    return (STAGES - 1) * L::BYTES + L::RAW + 16 * ((STAGES + 1) / 2) + (1024 - 128);
}

// Descriptors of the stage's tiles (wgmma.cuh, 128-byte swizzle): k-step ks of a K-major [64 x D] tile (atom
// ks / 4, 32 bytes a step inside it), and 16-row k-step ks of a tile read MN-major (N = D, the next 64 columns
// one atom further, LBO).
__device__ __forceinline__ u64 kmajor(unsigned tile, int ks) {
    return wg::smem_desc_sw128(tile + (ks >> 2) * (GDN_C * 128) + (ks & 3) * 32, 16, 1024);
}
__device__ __forceinline__ u64 mnmajor(unsigned tile, int ks) {
    return wg::smem_desc_sw128(tile + ks * 2048, GDN_C * 128, 1024);
}

// A [64 tokens][LDV] bf16 slice (V or O) and this warp's accumulator pairs of it, by 8 x 8 matrices moved transposed
// (ldmatrix / stmatrix .trans): matrix j of group i is tokens 8 (2 i + j / 2) .. + 7, dv rows 16 warp + 8 (j % 2) ..
// + 7, so register j of group i holds n-tile nt = 2 i + j / 2, elements e = 2 (j % 2), + 1 (one dv row, two
// tokens: low half the even token). slice_row: this lane's row address inside group i.
__device__ __forceinline__ unsigned slice_row(unsigned slice, int i, int warp, int lane) {
    constexpr int LDV = GDN_BV + 8;
    const unsigned lane_row = 2 * ((8 * (lane >> 4) + (lane & 7)) * LDV + 16 * warp + 8 * ((lane >> 3) & 1));
    return (slice + i * (2 * 16 * LDV)) + lane_row;
}
__device__ __forceinline__ float bf16_lo(unsigned pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(unsigned pair) { return __uint_as_float(pair & 0xffff0000u); }
__device__ __forceinline__ float2 ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }

// cp.async of the value head's 64 raw V rows ([T, num_v_heads, DV] bf16 from packed token tok), columns col0 ..
// col0 + W - 1, into a swizzled [64][W] tile (sw128_off); rows >= nv land as zeros. v 16-byte aligned (the usual
// case; every row then is, as num_v_heads DV 2 is a multiple of 16): 16-byte pieces, thread tid segment tid % SEGS
// of rows tid / SEGS + RPP p, its destinations a fixed RPP rows apart (issue_kq_sw128's walk: half the copies of
// the 8-byte walk below, no divisions; the same bytes land). Else (v needs 8-byte alignment only): 8-byte pieces.
template <int DV, int W = DV>
__device__ __forceinline__ void issue_v_sw128(unsigned char* tile, const bf16* __restrict__ v, int nv, int tok,
                                              int num_v_heads, int h, int tid, int col0 = 0) {
    static_assert(W % 64 == 0 && W <= DV, "whole 64-column atoms");
    if ((reinterpret_cast<unsigned long long>(v) & 15) == 0) {
        constexpr int SEGS = W / 8, RPP = 128 / SEGS;
        const int row0 = tid / SEGS, sg = tid % SEGS;
        const int step = RPP * num_v_heads * DV;   // elements from one of this thread's rows to the next
        const bf16* src = v + ((long long)(tok + row0) * num_v_heads + h) * DV + col0 + sg * 8;
        unsigned char* dst = tile + sw128_off(row0, sg);
#pragma unroll
        for (int p = 0; p < GDN_C / RPP; ++p) {
            const bool ok = row0 + p * RPP < nv;
            cp_async16(dst + p * RPP * 128, ok ? src : v, ok);
            src += step;
        }
        return;
    }
    constexpr int PIECES = W / 4;
#pragma unroll
    for (int p = 0; p < GDN_C * PIECES / 128; ++p) {
        const int idx = tid + p * 128, row = idx / PIECES, part = idx % PIECES;
        const bool ok = row < nv;
        const bf16* src = ok ? v + ((long long)(tok + row) * num_v_heads + h) * DV + col0 + part * 4 : v;
        cp_async8(tile + sw128_off(row, part >> 1) + (part & 1) * 8, src, ok);
    }
}

// ---- the overlapped schedule's workspace (q12drv.kernels.gdn sizes it): n x ceil(chunk_len / 64) x Hv OverlapRec
//      records (rec_at), then one u32 ready flag per precompute unit (stream b, chunk ci, key head kh), counting the
//      unit's value heads whose records are stored, then the item counter, then per (stream, chunk, key head) its k
//      and q tiles.
template <int DK>
__device__ __forceinline__ unsigned* ready_flag_at(unsigned char* ws, const Q12Meta& m, int b, int ci, int kh,
                                                   int num_k_heads, int num_v_heads) {
    const int nchunks = ((int)m.chunk_len + GDN_C - 1) / GDN_C;
    const long long recs = (long long)m.batch_size * nchunks * num_v_heads * OverlapRec<DK>::BYTES;
    return reinterpret_cast<unsigned*>(ws + recs) + ((long long)b * nchunks + ci) * num_k_heads + kh;
}
// The item counter the precompute's groups claim items from: the u32 after the last ready flag (the host zeroes the
// flags and 16 bytes for it before the launches).
template <int DK>
__device__ __forceinline__ unsigned* item_counter_at(unsigned char* ws, const Q12Meta& m, int num_k_heads,
                                                     int num_v_heads) {
    return ready_flag_at<DK>(ws, m, (int)m.batch_size, 0, 0, num_k_heads, num_v_heads);
}
// The k and then the q tile ([64][DK] bf16 each, 128-byte swizzled, as the stage holds them) of (stream b, chunk ci,
// key head kh), from the first 128-byte boundary after the item counter's 16 bytes.
template <int DK>
__device__ __forceinline__ unsigned char* kq_at(unsigned char* ws, const Q12Meta& m, int b, int ci, int kh,
                                                int num_k_heads, int num_v_heads) {
    const int nchunks = ((int)m.chunk_len + GDN_C - 1) / GDN_C;
    const unsigned long long end = reinterpret_cast<unsigned long long>(
        item_counter_at<DK>(ws, m, num_k_heads, num_v_heads)) + 16 - reinterpret_cast<unsigned long long>(ws);
    return ws + ((end + 127) & ~127ull) + (((long long)b * nchunks + ci) * num_k_heads + kh) * (4 * GDN_C * DK);
}

// One chunk's products for this warpgroup (gdn/chunk.cuh's state_step with the solve as one product): St is
// S^T (m64n{DK} accumulator), updated; Ot gets O^T [64 dv x 64 tokens] (m64n64 accumulator). sb / sp: the
// stage (shared address, pointer); vs: this warpgroup's V slice (shared address), read here (two-pass); warp: 0..3
// in the warpgroup. meanwhile() runs while the first products are in flight.
// Every wgmma is complete on return: ptxas 13.0 serialises every wgmma of the loop (each waited alone) as soon as
// one is in flight across the loop's back edge.
// OVERLAP: X's accumulator starts as U^T = V^T (T diag(beta))^T (the stage's V slice and T diag(beta) tiles; it needs
// no S), then takes S^T (-W)^T (the -W tile where the two-pass X takes k): X is V_new^T, with no R epilogue and no
// T product.
template <int DK, bool OVERLAP, class F>
__device__ __forceinline__ void chunk_mma(float (&St)[DK / 2], float (&Ot)[32], unsigned sb, const unsigned char* sp,
                                          unsigned vs, int warp, int lane, F&& meanwhile) {
    using L = Stage<DK, 1, OVERLAP>;
    constexpr int NK = DK / 16;
    const int tq = lane & 3;
    const float* bet = reinterpret_cast<const float*>(sp + L::BETA);
    const float* ek = reinterpret_cast<const float*>(sp + L::EK);
    const float* eq = reinterpret_cast<const float*>(sp + L::EQ);
    const float* wk = reinterpret_cast<const float*>(sp + L::WK);
    float (*S4)[4] = reinterpret_cast<float (*)[4]>(St);
    float (*O4)[4] = reinterpret_cast<float (*)[4]>(Ot);

    // ---- X = S^T K^T (OVERLAP: X = U^T + S^T (-W)^T), Y = S^T Q^T (into Ot); then (two-pass) R^T = beta (V^T -
    // exp(gamma) X) and V_new^T = R^T T^T
    float X[32], N[32];
    float (*X4)[4] = reinterpret_cast<float (*)[4]>(X);
    float (*N4)[4] = reinterpret_cast<float (*)[4]>(N);
    unsigned sa[NK][4], rh[4][4], rl[4][4];
    // S's bf16 fragments first: (OVERLAP) U's and S's products then follow one wgmma.fence as one group
#pragma unroll
    for (int ks = 0; ks < NK; ++ks) a_from_c(S4[2 * ks], S4[2 * ks + 1], sa[ks]);
    if constexpr (OVERLAP) {
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            wg::wgmma_ss_n64<1, 1>(X, mnmajor(sb + L::VS, kk), mnmajor(sb + L::TB, kk), kk > 0);
            wg::wgmma_ss_n64<1, 1>(X, mnmajor(sb + L::VS, kk), mnmajor(sb + L::TB + TILE64, kk), 1);
        }
    }
    if (!OVERLAP) wg::fence();
#pragma unroll
    for (int ks = 0; ks < NK; ++ks)
        wg::mma_rs<64, 0>(X, sa[ks], kmajor(sb + (OVERLAP ? L::W : L::K), ks), OVERLAP || ks > 0);
    wg::commit();
#pragma unroll
    for (int ks = 0; ks < NK; ++ks) wg::mma_rs<64, 0>(Ot, sa[ks], kmajor(sb + L::Q, ks), ks > 0);
    wg::commit();
    meanwhile();
    wg::wait<1>();   // X complete (Y may still run)
    wg::pin(X);
    if constexpr (OVERLAP) {   // X is V_new^T
        wg::wait<0>();   // Y
        wg::pins(Ot, X, sa);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {   // the V slice as this lane's token pairs (slice_row), two n-tiles at a time
            unsigned vp[4];
            ldsm_x4_t(vp[0], vp[1], vp[2], vp[3], slice_row(vs, i, warp, lane));
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int nt = 2 * i + j;
                const float2 b = ld2(bet + 8 * nt + 2 * tq), f = ld2(ek + 8 * nt + 2 * tq);
                X4[nt][0] = b.x * (bf16_lo(vp[2 * j]) - f.x * X4[nt][0]);
                X4[nt][1] = b.y * (bf16_hi(vp[2 * j]) - f.y * X4[nt][1]);
                X4[nt][2] = b.x * (bf16_lo(vp[2 * j + 1]) - f.x * X4[nt][2]);
                X4[nt][3] = b.y * (bf16_hi(vp[2 * j + 1]) - f.y * X4[nt][3]);
            }
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) a_from_c_hilo<true>(X4[2 * kk], X4[2 * kk + 1], rh[kk], rl[kk]);
        // ---- V_new^T = R^T T^T
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            wg::mma_rs<64, 0>(N, rh[kk], kmajor(sb + L::T, kk), kk > 0);
            wg::mma_rs<64, 0>(N, rl[kk], kmajor(sb + L::T, kk), 1);
        }
        wg::commit();
        wg::wait<0>();
        wg::pins(Ot, N, rh, rl, sa);
    }
    float (*V4)[4] = OVERLAP ? X4 : N4;   // V_new^T
    // ---- O^T = exp(gamma) Y + V_new^T P^T;  S^T = exp(gamma_C) S^T + (V_new^T exp(gamma_C - gamma)) K
    // (vl, V_new^T's lo parts, comes with the split and is held to the end beside vh: O's product takes vh alone)
    unsigned vh[4][4], vl[4][4], dh[4][4], dl[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        a_from_c_hilo<true>(V4[2 * kk], V4[2 * kk + 1], vh[kk], vl[kk]);
        float x0[4], x1[4];
        const float2 w0 = ld2(wk + 16 * kk + 2 * tq), w1 = ld2(wk + 16 * kk + 8 + 2 * tq);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            x0[e] = V4[2 * kk][e] * (e & 1 ? w0.y : w0.x);
            x1[e] = V4[2 * kk + 1][e] * (e & 1 ? w1.y : w1.x);
        }
        a_from_c_hilo<true>(x0, x1, dh[kk], dl[kk]);
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float2 f = ld2(eq + 8 * nt + 2 * tq);
#pragma unroll
        for (int e = 0; e < 4; ++e) O4[nt][e] *= e & 1 ? f.y : f.x;
    }
    const float egC = *reinterpret_cast<const float*>(sp + L::EGC);
#pragma unroll
    for (int i = 0; i < DK / 2; ++i) St[i] *= egC;
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wg::mma_rs<64, 0>(Ot, vh[kk], kmajor(sb + L::P, kk), 1);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        wg::mma_rs<DK, 1>(St, dh[kk], mnmajor(sb + L::K, kk), 1);
        wg::mma_rs<DK, 1>(St, dl[kk], mnmajor(sb + L::K, kk), 1);
    }
    wg::commit();
    wg::wait<0>();
    wg::pins(Ot, St, vh, vl, dh, dl);
}

// (The overlapped schedule) thread 0 of a sequential CTA: how many chunks from lo on have their records ready (1 to
// flags_per_poll, at most n: the flags of lo .. lo + n - 1, stride bytes apart, each ready at `need`, its key head's
// count of value heads), waiting for lo's if needed. The flags are read together (relaxed, one round trip), then one
// acquire fence and one proxy fence order the bulk copies that read those records (async proxy) after them: per
// batch, not per chunk. One asm block: as C++ loops the wait cost the d128 kernel a spill under NVRTC 13.0.
#define Q12_FLAG_ZERO(i) "mov.u32 f" #i ", 0;\n"
#define Q12_FLAG_LOAD(i) "add.s64 a, a, %3;\nsetp.gt.s32 p, %2, " #i ";\n@p ld.relaxed.gpu.global.u32 f" #i ", [a];\n"
#define Q12_FLAG_COUNT(i) "setp.lt.u32 w, f" #i ", %4;\n@w bra Q12_COUNTED_%=;\nadd.s32 %0, %0, 1;\n"
#define Q12_FLAGS(M) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15) M(16) M(17) \
    M(18) M(19) M(20) M(21) M(22) M(23) M(24) M(25) M(26) M(27) M(28) M(29) M(30) M(31)
static_assert(wgmma_config().flags_per_poll == 32, "wait_ready reads flags f0 .. f31");
__device__ __forceinline__ int wait_ready(const unsigned* flag_lo, int n, unsigned long long stride,
                                          unsigned need = 1) {
    int count;
    asm volatile(
        "{\n.reg .pred p, w;\n.reg .u32 f<" "32" ">;\n.reg .u64 a;\n"
        Q12_FLAGS(Q12_FLAG_ZERO)
        "ld.relaxed.gpu.global.u32 f0, [%1];\nmov.u64 a, %1;\n"
        Q12_FLAGS(Q12_FLAG_LOAD)
        "setp.ge.u32 w, f0, %4;\n@w bra Q12_READY_%=;\n"
        "Q12_SPIN_%=:\nld.relaxed.gpu.global.u32 f0, [%1];\nsetp.lt.u32 w, f0, %4;\n@w bra Q12_SPIN_%=;\n"
        "mov.u32 f1, 0;\n"
        "Q12_READY_%=:\nmov.s32 %0, 1;\n"
        Q12_FLAGS(Q12_FLAG_COUNT)
        "Q12_COUNTED_%=:\nfence.acq_rel.gpu;\nfence.proxy.async.global;\n}\n"
        : "=r"(count) : "l"(flag_lo), "r"(n), "l"(stride), "r"(need) : "memory");
    return count;
}
#undef Q12_FLAGS
#undef Q12_FLAG_ZERO
#undef Q12_FLAG_LOAD
#undef Q12_FLAG_COUNT

// The stream a sequential CTA of grid row r takes: the r-th longest (ties: the lower index first), so that a
// ragged pass's longest streams start in the first wave and the short ones fill in behind them (longest
// processing time first). Every thread of the CTA calls it; scratch:
// THREADS + 1 ints of shared memory nothing else uses until the CTA's next barrier. Each thread ranks the streams
// tid, tid + THREADS, ... against all n lengths (THREADS of them at a time in scratch); the ranks are a
// permutation of 0 .. n - 1, so exactly one stream has rank r. Uniform lengths give b = r.
__device__ __forceinline__ int longest_first(const int* cu, int n, int r, int* scratch, int tid, int threads) {
    if (n == 1) return 0;
    int* pick = scratch + threads;
    for (int t0 = 0; t0 < n; t0 += threads) {
        const int t = t0 + tid;
        const int lt = t < n ? cu[t + 1] - cu[t] : 0;
        int rank = 0;
        for (int j0 = 0; j0 < n; j0 += threads) {
            __syncthreads();   // the previous tile's lengths read out
            if (j0 + tid < n) scratch[tid] = cu[j0 + tid + 1] - cu[j0 + tid];
            __syncthreads();
            const int jn = min(threads, n - j0);
            for (int j = 0; j < jn; ++j) {
                const int lj = scratch[j];
                rank += lj > lt || (lj == lt && j0 + j < t);
            }
        }
        if (t < n && rank == r) *pick = t;
    }
    __syncthreads();
    return *pick;
}

}  // namespace gdnw

// grid (D / 64 / WGS, Hv, n), 128 WGS threads (WGS warpgroups), dynamic smem sequential_smem<D, WGS, OVERLAP,
// STAGES>. WGS 2 (the wide CTA): warpgroup w owns dv slice 2 blockIdx.x + w; the chunk's k and q tiles (one each
// warpgroup copies) and T record are the two's, so each comes to shared memory once for both. OVERLAP: the
// overlapped schedule's sequential kernel: a chunk's records (and its k and q tiles) are copied once their precompute
// items' ready flag is set, and the CTA ends with griddepcontrol.wait (the precompute grid complete).
template <int D, int STAGES, int WGS = 1, bool OVERLAP = false>
__device__ __forceinline__ void wgmma_sequential_body(GDN_BODY_PARAMS) {
    using namespace gdnc;
    constexpr int DK = D, DV = D;
    if (gridDim.x != D / (GDN_BV * WGS)) return;
    unsigned char* __restrict__ const ws = workspace;
    using L = gdnw::Stage<DK, WGS, OVERLAP>;
    using OR = gdnw::OverlapRec<DK>;
    constexpr int C = GDN_C, BV = GDN_BV, THREADS = 128 * WGS;
    static_assert(!OVERLAP || STAGES == 2, "the overlapped sequential kernel has two stages");
    static_assert(WGS == 1 || (WGS == 2 && !OVERLAP && STAGES == 2), "the wide CTA: two stages, no flags");
    extern __shared__ __align__(128) unsigned char gdn_smem_raw[];
    const unsigned raw = smem_u32(gdn_smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;                  // the tiles' 1024-byte alignment
    unsigned char* basep = gdn_smem_raw + (base - raw);
    const unsigned bars = base + (STAGES - 1) * L::BYTES + L::RAW;   // one mbarrier per stage
    if constexpr (OVERLAP) {   // the host's size (sequential_smem, 896 bytes of alignment slack: __align__(128))
        unsigned dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
        if (bars + 8 * STAGES - raw > dyn) __trap();
    }

    // Every CTA waits for the precompute grid before it ends (pdl_wait; at once where it has nothing to do), so the
    // stream's next operation finds both grids complete, whichever way the two were launched.
    const int h = blockIdx.y;
    if ((int)blockDim.x != THREADS || (int)blockIdx.z >= (int)m.batch_size || h >= num_v_heads ||
        (int)blockIdx.x * BV * WGS >= DV) {
        pdl_wait();
        return;
    }
    const int tid = threadIdx.x, lane = tid & 31;
    const int wgi = WGS == 1 ? 0 : tid >> 7, wtid = WGS == 1 ? tid : tid & 127, warp = wtid >> 5;   // warpgroup, thread, warp
    const int col0 = (blockIdx.x * WGS + wgi) * BV;
    const int gq = lane >> 2, tq = lane & 3;
    const int* cu = q12_cu_seqlens(m);
    // grid row z takes the z-th longest stream (OVERLAP: stream z; its CTAs are all resident at once). The
    // scratch is stage 0's first bytes, free until the copies below, which come after the barrier below.
    const int b = OVERLAP ? (int)blockIdx.z
                          : gdnw::longest_first(cu, (int)m.batch_size, (int)blockIdx.z,
                                                reinterpret_cast<int*>(basep), tid, THREADS);
    const int len = cu[b + 1] - cu[b];
    if (len <= 0) {
        pdl_wait();
        return;
    }
    const int kh = h / (num_v_heads / num_k_heads);
    const int nch = (len + C - 1) / C;

    // OVERLAP: chunk 0's ready flag and the last chunk known ready, in shared memory (thread 0's; no register held
    // across the chunk loop for them), written before the prologue's barrier
    __shared__ const unsigned* flags;
    __shared__ int ready_to;
    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) wg::mbar_init(bars + 8 * i, 1);
        wg::fence_mbarrier_init();
        if (OVERLAP) {
            flags = gdnw::ready_flag_at<DK>(ws, m, b, 0, kh, num_k_heads, num_v_heads);
            ready_to = -1;
        }
    }
    __syncthreads();
    // Chunk ci into stage st, once every wgmma and generic read of the stage's tiles and scalars is done (the
    // caller's barrier). (Two-pass) the raw k and q rows: every thread, one cp.async group (made visible to the
    // wgmma by each thread's proxy fence after its wait); the T record: thread 0, one bulk copy on the stage's
    // mbarrier. (OVERLAP) the record's two parts and the chunk's k and q tiles, the precompute's: thread 0, three
    // bulk copies on the stage's mbarrier. The V slice (issue_v): every thread, one cp.async group, once the stage's
    // O rows are stored.
    // (OVERLAP) a ready flag's value once every value head of its key head is stored
    const unsigned need = (unsigned)(num_v_heads / num_k_heads);
    auto issue_kq = [&](int ci, int st) {   // (two-pass) the raw k and q rows from k and q
        if (OVERLAP) return;
        unsigned char* sp = basep + st * L::BYTES;
        const int nv = min(C, len - ci * C), tok = ld_volatile(cu + b) + ci * C;
        if (WGS == 1) issue_kq_sw128<DK>(sp + L::K, sp + L::Q, k, q, nv, tok, num_k_heads, kh, wtid);
        else if (wgi == 0) issue_kq_sw128<DK, 1>(sp + L::K, sp + L::Q, k, q, nv, tok, num_k_heads, kh, wtid);
        else issue_kq_sw128<DK, 2>(sp + L::K, sp + L::Q, k, q, nv, tok, num_k_heads, kh, wtid);
        cp_async_commit();
    };
    auto issue_vrec = [&](int ci, int st) {   // the precompute's record
        if (tid == 0) {
            const unsigned sb = base + st * L::BYTES;
            if (ci == 0) {   // later chunks: (OVERLAP) at the loop's top; else the precompute is complete
                if constexpr (OVERLAP) ready_to = gdnw::wait_ready(flags, nch, 4ull * num_k_heads, need) - 1;
                else pdl_wait();
            }
            wg::fence_proxy_async();   // the stage's generic reads (beta, EK, ...) before the copy's writes
            if constexpr (OVERLAP) {   // the k and q tiles, the record's common part, T diag(beta)'s tiles
                const unsigned char* rec = rec_at<OR::BYTES>(ws, m, b, ci, h, num_v_heads);
                wg::mbar_arrive_expect_tx(bars + 8 * st, OR::COMMON + 2 * gdnw::TILE64 + 2 * L::KT);
                wg::bulk_g2s(sb + L::K, gdnw::kq_at<DK>(ws, m, b, ci, kh, num_k_heads, num_v_heads), 2 * L::KT,
                             bars + 8 * st);
                wg::bulk_g2s(sb + L::VREC, rec, OR::COMMON, bars + 8 * st);
                wg::bulk_g2s(sb + L::TB, rec + OR::TB, 2 * gdnw::TILE64, bars + 8 * st);
            } else {
                wg::mbar_arrive_expect_tx(bars + 8 * st, TRec::BYTES);
                wg::bulk_g2s(sb + L::VREC, trec_at(ws, m, b, ci, h, num_v_heads), TRec::BYTES, bars + 8 * st);
            }
        }
    };
    auto issue_records = [&](int ci, int st) {
        issue_kq(ci, st);
        issue_vrec(ci, st);
    };
    // (OVERLAP) the stream's first token, held across the chunk loop
    const int tok0 = OVERLAP ? ld_volatile(cu + b) : 0;
    auto first_tok = [&] { return OVERLAP ? tok0 : ld_volatile(cu + b); };
    auto issue_v = [&](int ci, int st) {   // the V slice (OVERLAP: swizzled, for U's product)
        if constexpr (OVERLAP) {
            gdnw::issue_v_sw128<DV, BV>(basep + st * L::BYTES + L::VS, v, min(C, len - ci * C),
                                         first_tok() + ci * C, num_v_heads, h, wtid, col0);
        } else {
            issue_v_slice<DV>(reinterpret_cast<bf16*>(basep + st * L::BYTES + L::V + wgi * L::SLICE), v,
                              min(C, len - ci * C), ld_volatile(cu + b) + ci * C, num_v_heads, h, col0, wtid);
        }
        cp_async_commit();
    };
    // chunk 0's inputs and the state first: launched by PDL they load while the precompute finishes
    issue_kq(0, 0);
    issue_v(0, 0);
    const float* state = reinterpret_cast<const float*>(h_state_ptrs[b]) + (long long)h * DK * DV;
    const int bv0 = col0 + 16 * warp + gq;     // this lane's dv rows of S^T: bv0, bv0 + 8
    float St[DK / 2];
    float (*S4)[4] = reinterpret_cast<float (*)[4]>(St);
    load_state<DK, DV>(S4, state, bv0, tq);
    issue_vrec(0, 0);

    // Chunk ci's o rows leave from its stage's O slice during chunk ci + 1's first products (the last after the
    // loop); a stage's O slice is rewritten two barriers after it was stored from.
    auto o_rows = [&](int ci) {
        store_o_at<DV>(o, reinterpret_cast<const bf16*>(basep + (STAGES == 2 ? ci & 1 : 0) * L::BYTES + L::O + wgi * L::SLICE),
                       first_tok(), len, ci * C, num_v_heads, h, col0, wtid);
    };
    for (int ci = 0; ci < nch; ++ci) {
        const int st = STAGES == 2 ? (ci & 1) : 0;
        if (STAGES == 1 && ci > 0) issue_v(ci, 0);   // every thread is past chunk ci - 1's products: its V slice
        wg::mbar_wait(bars + 8 * st, (ci / STAGES) & 1);   // the stage's (ci / STAGES)-th fill
        cp_async_wait_all();
        wg::fence_proxy_async();   // this thread's k and q rows visible to the wgmma (the barrier below: everyone's)
        // OVERLAP: the next chunk's records are ready before its copies are issued below. Polled here, once this
        // chunk's copy and V slice have landed and before the next one is issued: the fence then waits for no bulk
        // copy in flight.
        if (OVERLAP && tid == 0 && ci + 1 < nch && ci + 1 > ready_to)
            ready_to = ci + gdnw::wait_ready(flags + (ci + 1) * num_k_heads, nch - ci - 1, 4ull * num_k_heads, need);
        __syncthreads();   // chunk ci's V slice from every thread and chunk ci - 1's O slice; (STAGES 2) chunk ci - 1
                           // is done with its stage
        auto issue_next = [&] {   // (STAGES 2) chunk ci + 1 into the other stage, which chunk ci - 1 is done with
            if (STAGES == 2 && ci + 1 < nch) {
                issue_records(ci + 1, st ^ 1);
                issue_v(ci + 1, st ^ 1);
            }
        };
        // The next chunk's copies: (two-pass) issued while X and Y run, off the chain; (OVERLAP) before them, its
        // chain being short enough that the copies outlast X and Y
        if (OVERLAP) issue_next();
        float Ot[32];
        gdnw::chunk_mma<DK, OVERLAP>(St, Ot, base + st * L::BYTES, basep + st * L::BYTES,
                                     base + st * L::BYTES + L::V + wgi * L::SLICE, warp, lane, [&] {
            if (ci > 0) o_rows(ci - 1);
            if (!OVERLAP) issue_next();
        });
        if (STAGES == 1) {
            __syncthreads();   // every warp is done with the stage's tiles, scalars, V slice and O slice
            if (ci + 1 < nch) issue_records(ci + 1, 0);
        }
        float (*O4)[4] = reinterpret_cast<float (*)[4]>(Ot);
#pragma unroll
        for (int i = 0; i < 4; ++i)   // O^T's token pairs to the O slice, transposed (gdnw::slice_row)
            wg::stsm_x4_t(gdnw::slice_row(base + st * L::BYTES + L::O + wgi * L::SLICE, i, warp, lane),
                          pack(O4[2 * i][0], O4[2 * i][1]), pack(O4[2 * i][2], O4[2 * i][3]),
                          pack(O4[2 * i + 1][0], O4[2 * i + 1][1]), pack(O4[2 * i + 1][2], O4[2 * i + 1][3]));
    }
    __syncthreads();   // the last O slice complete
    o_rows(nch - 1);
    store_state<DK, DV>(S4, reinterpret_cast<float*>(ld_volatile(h_state_ptrs + b)) + (long long)h * DK * DV, bv0, tq);
    if constexpr (OVERLAP) pdl_wait();
}

// ================================================================ the overlapped schedule
// For grids of few sequential CTAs (one long stream: 64 CTAs at Hv 32, d 128 leave half of an H200 idle), the
// precompute runs beside the sequential kernel instead of before it. Three launches on one stream:
//   1. the ready flags and the item counter zeroed (the host: one memset);
//   2. q12_gdn_wgmma_overlapped_precompute_d*: P persistent CTAs of overlap_groups (3) 128-thread groups, each group
//      one overlapped_item at a time on its own OverlapSmem (60 KB at d128: one CTA fills an SM), claiming items in
//      chunk-major order from the counter, and adding the item's value heads to its key head's ready flag once its
//      records are stored; every CTA first executes griddepcontrol.launch_dependents;
//   3. q12_gdn_wgmma_overlapped_sequential_d*, launched with programmatic stream serialization: it may start once
//      every precompute CTA has started, lands on the SMs the precompute left free (P = SMs - its CTAs), and copies
//      a chunk's records once their flag is complete.
// No cycle: the precompute never waits, and every CTA of it is running or done before a sequential CTA starts
// (without programmatic launch the sequential kernel starts after the precompute: the same result, serially).
// The sequential CTAs end with griddepcontrol.wait, so the stream's next operation finds both grids complete.
// Records and chain: fla-core's order of the same algebra, V_new = U - W S with U = T diag(beta) V and
// W = T diag(beta EK) k (k the raw rows). The precompute stores, per (stream, value head, chunk), OverlapRec: -W
// (bf16), P, EQ, WK, exp(gamma_C), and T diag(beta) as bf16 hi + lo tiles (T diag(beta) and T diag(beta EK) are
// formed as hi + lo pairs from the fp32 T), and per (stream, chunk, key head) the k and q tiles it holds anyway
// (kq_at), which the sequential kernel copies with the record. Per chunk the sequential kernel then takes V^T (T
// diag(beta))^T (8 wgmma, both operands MN-major in shared memory, issued before S's conversion: they need no S)
// as the start of X's accumulator and S^T (-W)^T onto it: X is V_new^T, R's epilogue and the T product are off the
// chain; it copies its own V slice from v (issue_v_sw128). Not the two-pass schedule's bits
// (chunked_reference(path="overlapped") models it, the state's error as the two-pass schedule's); batched == alone.
// The record is 41.5 KB a value head and chunk at d128 (2.4x the T record): it is read soon after it is written.
// Items: in each stream's first value_head_chunks (8) chunks, one per (stream, chunk, value head), so that the
// first records come sooner; after them one per (stream, chunk, key head), its value heads one after the other.
// A key head's flag is complete at Hv / Hk.
namespace gdnw {

// The overlapped precompute's item on warpgroup MMA. Its products: K K^T and Q K^T (as K Q^T, P^T's rows) as
// m64n64k16 with both operands the swizzled k and q tiles (the full 64 x 64: the accumulator is the mma.sync C
// layout of each warp's 16 rows, so products_epilogue takes it, warp w on block w), the diagonals of K K^T and
// Q Q^T for the rows' scales, and W per 64-column half (A: T diag(beta EK)'s fragments, B: the k tile MN-major).

// An overlapped precompute group's shared memory: PrepSmem's members with k and q as 128-byte swizzled tiles (the
// group's base on 1024 bytes), -A and P padded on 1024-byte boundaries (after the solve their bytes take T's scaled
// columns as two swizzled tiles); kraw names k (issue_kvgb's raw-K branch, not taken here, names it).
template <int DK>
struct OverlapSmem {
    static constexpr int LDK = DK + 8, LDP = GDN_C + 8, LDD = 24;
    union {
        bf16 k[GDN_C * DK];
        bf16 kraw[GDN_C * DK];
    };
    bf16 q[GDN_C * DK];   // q's tile
    bf16 a[GDN_C * LDP];
    bf16 p[GDN_C * LDP];
    bf16 dinv[GDN_C * LDD];
    float d[4 * 16 * 17];
    float graw[1][GDN_C];   // one buffer (PrepSmem has two): the next head's g and beta land once chunk_gamma has
    float braw[1][GDN_C];   // read these
    float gam[GDN_C];
    float erk[GDN_C];
    float erq[GDN_C];
    float ec[GDN_C];
    float beta[GDN_C];
    float eg[GDN_C];
    float wd[GDN_C];
    float rk[GDN_C];
    float rq[GDN_C];
};
template <int DK>
__host__ __device__ constexpr int overlap_group_bytes() { return (int)(sizeof(OverlapSmem<DK>) + 1023) / 1024 * 1024; }
// An overlapped precompute CTA's dynamic shared memory: overlap_groups mma precompute CTAs' worth, so that at d128
// the CTA fills an SM and no sequential CTA shares it; its groups fit from the first 1024-byte boundary.
template <int DK>
__host__ __device__ constexpr int overlapped_precompute_smem() {
    return wgmma_config().overlap_groups * (int)sizeof(gdnc::PrepSmem<DK>);
}
static_assert(wgmma_config().overlap_groups * overlap_group_bytes<128>() + 1024 <= overlapped_precompute_smem<128>() &&
                  wgmma_config().overlap_groups * overlap_group_bytes<64>() + 1024 <= overlapped_precompute_smem<64>(),
              "the overlapped precompute's groups do not fit in its shared memory");

// After the block solve each warp holds T's columns 16 warp .. 16 warp + 15 in fp32 (X[nt][e] = T[8 nt + 2 tq +
// (e & 1)][16 warp + gq + 8 (e >> 1)]). This thread's pairs of them, scaled by f(column), as transposed swizzled
// tiles th (bf16 hi), tl (lo) ([64 columns j][64 tokens t], sw128_off: row j holds T[t][j] f(j) over the tokens;
// the thread's columns j0 = 16 warp + gq, + 8, its tokens 8 nt + 2 tq, + 1). The pair keeps the error of the fp32 T
// where one bf16 would not (docs/kernels/gdn.md).
template <class F>
__device__ __forceinline__ void t_cols_hilo(const float (*X)[4], bf16* th, bf16* tl, F&& f, int warp, int lane) {
    const int gq = lane >> 2, tq = lane & 3, j0 = 16 * warp + gq;
    const float f0 = f(j0), f1 = f(j0 + 8);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float fj = hh ? f1 : f0;
            const int at = (sw128_off(j0 + 8 * hh, nt) + 4 * tq) / 2;
            const float x0 = X[nt][2 * hh], x1 = X[nt][2 * hh + 1];
            unsigned hi, lo;
            pack_hilo(x0 * fj, x1 * fj, hi, lo);
            *reinterpret_cast<unsigned*>(&th[at]) = hi;
            *reinterpret_cast<unsigned*>(&tl[at]) = lo;
        }
}

// The record's scalars and P (OverlapRec's common part but W): P as a swizzled tile from the group's padded s.p, EQ
// and WK (16 bytes a thread), exp(gamma_C); stored once the block solve is done.
template <int DK, class S>
__device__ __forceinline__ void store_overlap_scalars(unsigned char* rec, const S& s, int tid) {
    using OR = OverlapRec<DK>;
    constexpr int C = GDN_C, LDP = GDN_C + 8;
    for (int idx = tid; idx < C * 8; idx += 128)   // P as a swizzled tile
        *reinterpret_cast<uint4*>(rec + OR::P + sw128_off(idx / 8, idx % 8)) =
            *reinterpret_cast<const uint4*>(s.p + (idx / 8) * LDP + (idx % 8) * 8);
    if (tid < 2 * 16) {   // EQ, WK (16 B a thread), then exp(gamma_C)
        const int i = (tid & 15) * 4;
        const float* x = tid < 16 ? s.eg : s.wd;
        const float* r = tid < 16 ? s.rq : s.rk;
        *reinterpret_cast<float4*>(rec + OR::EQ + tid * 16) =
            make_float4(x[i] * r[i], x[i + 1] * r[i + 1], x[i + 2] * r[i + 2], x[i + 3] * r[i + 3]);
    } else if (tid == 2 * 16) {
        *reinterpret_cast<float4*>(rec + OR::EGC) = make_float4(s.eg[C - 1], 0.f, 0.f, 0.f);
    }
}

// P from K Q^T's accumulator (the mma C layout of each warp's 16 rows, as products_epilogue takes it): warp w holds
// P^T's rows j = 16 w .. + 15 (k tokens), and its n-tiles nt >= 2 w are the q tokens i >= 16 w that P's causal part
// needs of them (the n-tiles before lie above P's diagonal: zero_ap's zeros), so that with K K^T's nt <= 2 w + 1
// every warp takes 10 n-tiles. Each element is ex2(erq_i + ec_j) (K Q^T)_ji where i >= j (masked ones are selected
// away: their exponent may overflow), stored transposed into P's rows as bf16 by one stmatrix .trans a pair of
// n-tiles (matrix mm = lane / 8: n-tile 2 pr + mm / 2, P^T's rows 16 w + 8 (mm % 2) ..; in P rows 8 nt + lane % 8,
// columns 16 w + 8 (mm % 2) ..).
template <class S>
__device__ __forceinline__ void pt_epilogue(S& s, const float (*acc)[4], int warp, int lane) {
    constexpr int LDP = GDN_C + 8;
    const int gq = lane >> 2, tq = lane & 3, mm = lane >> 3, r8 = lane & 7;
    const float e0 = s.ec[16 * warp + gq], e1 = s.ec[16 * warp + gq + 8];   // rows j and j + 8
    const unsigned sp = smem_u32(s.p);
#pragma unroll
    for (int pr = 0; pr < 4; ++pr) {
        if (pr < warp) continue;
        unsigned r[4];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int nt = 2 * pr + u, i = 8 * nt + 2 * tq;
            const float2 c = *reinterpret_cast<const float2*>(&s.erq[i]);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int j = 16 * warp + gq + 8 * hh;
                const float ej = hh ? e1 : e0;
                float v0 = ex2(c.x + ej) * acc[nt][2 * hh], v1 = ex2(c.y + ej) * acc[nt][2 * hh + 1];
                v0 = i >= j ? v0 : 0.f;
                v1 = i + 1 >= j ? v1 : 0.f;
                r[2 * u + hh] = pack(v0, v1);
            }
        }
        wg::stsm_x4_t(sp + 2 * ((8 * (2 * pr + (mm >> 1)) + r8) * LDP + 16 * warp + 8 * (mm & 1)), r[0], r[1], r[2], r[3]);
    }
}


// One item, by one group of 128 threads (tid 0..127, sync() its barrier) on its OverlapSmem: chunk ci of (stream b,
// key head kh), which has len tokens, for the key head's value heads kh group + j0 .. + j1 - 1 (one, or all).
// claim() (the group's next item: an atomic) is called under the item's first copies. It returns after the group's
// last barrier: every record store of the item is issued, and the group's shared memory is free again.
template <int DK, class Sync, class Claim>
__device__ __forceinline__ void overlapped_item(const Q12Meta& m, const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                const float* __restrict__ g, const float* __restrict__ beta,
                                                int num_k_heads, int num_v_heads, unsigned char* __restrict__ ws,
                                                OverlapSmem<DK>& s, int b, int kh, int ci, int len, int tid, Sync sync,
                                                Claim claim, int j0, int j1) {
    using OR = OverlapRec<DK>;
    constexpr int DV = DK;
    constexpr int C = GDN_C, THREADS = 128, LDP = GDN_C + 8, NK = DK / 16;
    const int lane = tid & 31, warp = tid >> 5, mat = lane >> 3, r8 = lane & 7, gq = lane >> 2, tq = lane & 3;
    const int* cu = q12_cu_seqlens(m);
    const int c0 = ci * C, group = num_v_heads / num_k_heads, nv = min(C, len - c0);
    unsigned char* kt = reinterpret_cast<unsigned char*>(s.k);
    unsigned char* qt = reinterpret_cast<unsigned char*>(s.q);
    const unsigned sk = smem_u32(s.k), sq = smem_u32(s.q), sa = smem_u32(s.a), sp = smem_u32(s.p);

    // g and beta of the first value head, the raw k and q rows as swizzled tiles
    issue_kvgb<DK, DV, false, false, true>(s, nullptr, cu + b, len, c0, 0, k, nullptr, g, beta, num_k_heads,
                                           num_v_heads, kh * group + j0, 0, tid);
    issue_kq_sw128<DK>(kt, qt, k, q, nv, ld_volatile(cu + b) + c0, num_k_heads, kh, tid);
    cp_async_commit();
    claim();   // the group's next item (an atomic: its latency under the copies')
    cp_async_wait_all();
    wg::fence_proxy_async();   // the tiles visible to the wgmma (the barrier below: everyone's)
    sync();
    {   // the rows' scales from the diagonals of K K^T and Q Q^T (fp32 sums of the raw rows' exact products)
        float kk[32], qq[32];
        wg::fence();
#pragma unroll
        for (int ks = 0; ks < NK; ++ks) wg::mma_ss<64>(kk, kmajor(sk, ks), kmajor(sk, ks), ks > 0);
#pragma unroll
        for (int ks = 0; ks < NK; ++ks) wg::mma_ss<64>(qq, kmajor(sq, ks), kmajor(sq, ks), ks > 0);
        wg::commit();
        zero_ap(s, tid);   // -A and P: every byte of the records defined
        wg::wait<0>();
        // row i = 16 warp + gq + 8 hh sits in n-tile 2 warp + hh, element 2 hh + (gq & 1) of the lane with tq = gq / 2
        if (tq == (gq >> 1)) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
                    if (nt == 2 * warp + hh) {
                        const int i = 16 * warp + gq + 8 * hh, e = 4 * nt + 2 * hh;   // (registers: e fixed)
                        const bool odd = gq & 1;
                        s.rk[i] = rsqrtf((odd ? kk[e + 1] : kk[e]) + 1e-6f);
                        s.rq[i] = rsqrtf((odd ? qq[e + 1] : qq[e]) + 1e-6f) * (1.0f / sqrtf((float)DK));
                    }
        }
    }
    // K Q^T (P^T's rows) once for the key head (each value head scales it by its own beta and gamma in the epilogue)
    float accq[32];
    wg::fence();
#pragma unroll
    for (int ks = 0; ks < NK; ++ks) wg::mma_ss<64>(accq, kmajor(sk, ks), kmajor(sq, ks), ks > 0);
    wg::commit();
    if (j0 == 0) {   // the k and q tiles (adjacent here and in the stage) for the sequential kernel
        uint4* dst = reinterpret_cast<uint4*>(kq_at<DK>(ws, m, b, ci, kh, num_k_heads, num_v_heads));
        const uint4* src = reinterpret_cast<const uint4*>(s.k);
#pragma unroll 4
        for (int i = tid; i < 2 * C * DK * 2 / 16; i += THREADS) dst[i] = src[i];
    }
    wg::wait<0>();
    for (int j = j0; j < j1; ++j) {
        const int h = kh * group + j;
        if (j > j0) cp_async_wait_all();   // this value head's g and beta, copied while the previous head computed
        sync();   // (j j0: the scales and the zeroed -A and P stored; every thread's K Q^T complete)
        {
            float acck[32];   // K K^T again for each value head (a few wgmma; holding it costs registers), issued
            wg::fence();      // before zero_ap, chunk_gamma and their barrier, so that it runs under them
#pragma unroll
            for (int ks = 0; ks < NK; ++ks) wg::mma_ss<64>(acck, kmajor(sk, ks), kmajor(sk, ks), ks > 0);
            wg::commit();
            if (j > j0) zero_ap(s, tid);   // the previous head's T tiles out of -A's and P's upper blocks
            if (warp == 0) chunk_gamma<true>(s, 0, lane);
            sync();
            if (j + 1 < j1) {   // the next value head's g and beta (chunk_gamma has read this head's)
                issue_kvgb<DK, DV, false, false, true>(s, nullptr, cu + b, len, c0, 0, k, nullptr, g, beta,
                                                       num_k_heads, num_v_heads, h + 1, 0, tid);
                cp_async_commit();
            }
            wg::wait<0>();
            wg::pin(acck);
            products_epilogue<true, true>(s, reinterpret_cast<const float (*)[4]>(acck), warp, lane);
        }
        pt_epilogue(s, reinterpret_cast<const float (*)[4]>(accq), warp, lane);
        __syncwarp();   // the warp's diagonal block of K K^T (s.d) stored by its lanes
        invert_block(s, warp, lane);   // (on all 32 lanes, both halves the same column: 4 B spilled at d128)
        sync();
        // T's columns 16 warp .. + 15 (each_slice_elem: the identity's, solved)
        float Rt[8][4], X[8][4];
        each_slice_elem<LDP>(warp, lane, [&](int nt, int e, int cc, int at) {
            Rt[nt][e] = at == cc * (LDP + 1) ? 1.f : 0.f;
        });
        block_solve(s.a, s.dinv, Rt, X, lane);
        unsigned char* rec = rec_at<OR::BYTES>(ws, m, b, ci, h, num_v_heads);
        store_overlap_scalars<DK>(rec, s, tid);
        sync();   // -A read by every warp's solve, P stored: their bytes take T's scaled columns (swizzled tiles)
        t_cols_hilo(X, s.a, s.p, [&](int c) { return s.beta[c]; }, warp, lane);
        cp_async_wait_all();       // the next head's g and beta
        wg::fence_proxy_async();   // T diag(beta)'s tiles visible to the wgmma
        sync();
        {   // T diag(beta)'s hi and lo tiles (the first 8 KiB of s.a and s.p) to the record, for the sequential
            // kernel's U product
            uint4* dst = reinterpret_cast<uint4*>(rec + OR::TB);
            constexpr int T16 = TILE64 / 16;
#pragma unroll 4
            for (int i = tid; i < 2 * T16; i += THREADS)
                dst[i] = i < T16 ? reinterpret_cast<const uint4*>(s.a)[i]
                                 : reinterpret_cast<const uint4*>(s.p)[i - T16];
        }
        sync();   // T diag(beta)'s tiles read out
        // T diag(beta EK) from T's fp32 columns, still held
        t_cols_hilo(X, s.a, s.p, [&](int c) { return s.beta[c] * (s.eg[c] * s.rk[c]); }, warp, lane);
        wg::fence_proxy_async();
        sync();
        // W = T diag(beta EK) k per 64-column half: A = the tiles' fragments of this warp's token rows (all four
        // k-steps, loaded once for both halves), B = the k tile MN-major; stored negated
        unsigned ah[4][4], al[4][4];
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            const int off = sw128_off(16 * ks + (mat >> 1) * 8 + r8, 2 * warp + (mat & 1));
            ldsm_x4_t(ah[ks][0], ah[ks][1], ah[ks][2], ah[ks][3], sa + off);
            ldsm_x4_t(al[ks][0], al[ks][1], al[ks][2], al[ks][3], sp + off);
        }
#pragma unroll 1
        for (int half = 0; half < DK / 64; ++half) {
            float acc[32];
            wg::fence();
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                wg::mma_rs<64, 1>(acc, ah[ks], mnmajor(sk + half * (GDN_C * 128), ks), ks > 0);
                wg::mma_rs<64, 1>(acc, al[ks], mnmajor(sk + half * (GDN_C * 128), ks), 1);
            }
            wg::commit();
            wg::wait<0>();
            wg::pins(ah, al);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int t = 16 * warp + gq + 8 * hh, d = 64 * half + 8 * nt + 2 * tq;
                    *reinterpret_cast<unsigned*>(rec + OR::W + sw128_off(t, d >> 3) + (d & 7) * 2) =
                        pack(-acc[4 * nt + 2 * hh], -acc[4 * nt + 2 * hh + 1]);
                }
        }
        sync();   // s.a, s.p, s.dinv, s.beta, ... read out before the next head rewrites them
    }
}

// grid (P), 128 overlap_groups threads, dynamic smem overlapped_precompute_smem<D>() (overlap_groups x
// overlap_group_bytes from the first 1024-byte boundary fit): one CTA fills an SM. Each group (128 threads, one item
// at a time) claims the next item, chunk-major, from a counter in the workspace (an atomic per item, issued under
// the item's first copies), and adds the item's value heads to its key head's ready flag once its records are
// stored (red.release after the item's last barrier: its release is cumulative over the group's stores, which that
// barrier ordered).
template <int D>
__device__ __forceinline__ void overlapped_precompute_body(GDN_BODY_PARAMS) {
    using namespace gdnc;
    constexpr int DK = D;
    unsigned char* __restrict__ const ws = workspace;
    pdl_launch_dependents();
    extern __shared__ __align__(128) unsigned char gdn_smem_raw[];
    constexpr int groups = wgmma_config().overlap_groups;
    if ((int)blockDim.x != groups * 128) return;
    const int grp = threadIdx.x >> 7, tid = threadIdx.x & 127;
    const unsigned raw = smem_u32(gdn_smem_raw), pad = ((raw + 1023u) & ~1023u) - raw;
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
    // the host's size: a shorter one would overlap the groups
    if (pad + groups * overlap_group_bytes<DK>() > dyn) __trap();
    OverlapSmem<DK>& sw = *reinterpret_cast<OverlapSmem<DK>*>(gdn_smem_raw + pad + grp * overlap_group_bytes<DK>());
    const int* cu = q12_cu_seqlens(m);
    // an item: (chunk, stream, value head) in the first value_head_chunks chunks, (chunk, stream, key head) after
    const int group = num_v_heads / num_k_heads, nch = ((int)m.chunk_len + GDN_C - 1) / GDN_C;
    const int vh_chunks = min(nch, wgmma_config().value_head_chunks);
    const int per_vh_chunk = (int)m.batch_size * num_v_heads, per_chunk = (int)m.batch_size * num_k_heads;
    const int vh_items = vh_chunks * per_vh_chunk, items = vh_items + (nch - vh_chunks) * per_chunk;
    unsigned* counter = item_counter_at<DK>(ws, m, num_k_heads, num_v_heads);
    auto next_item = [&]() -> int {   // (thread 0) this group's next item (items or more: none left)
        return (int)min(atomicAdd(counter, 1u), (unsigned)items);
    };
    // claimed[grp][i & 1]: item i's index, written by thread 0 before item i - 1's first barrier and read by
    // everyone after its last (the other slot is item i + 1's)
    __shared__ int claimed[groups][2];
    auto sync = [grp] { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + grp) : "memory"); };
    if (tid == 0) claimed[grp][0] = next_item();
    sync();
    for (int i = 0, w = claimed[grp][0]; w < items; w = claimed[grp][++i & 1]) {
        auto claim = [&] {
            if (tid == 0) claimed[grp][(i + 1) & 1] = next_item();
        };
        const bool per_vh = w < vh_items;
        const int wl = per_vh ? w : w - vh_items, units = per_vh ? num_v_heads : num_k_heads;
        const int ci = per_vh ? wl / per_vh_chunk : vh_chunks + wl / per_chunk;
        const int r = per_vh ? wl % per_vh_chunk : wl % per_chunk, b = r / units, u = r % units;
        const int kh = per_vh ? u / group : u, j0 = per_vh ? u % group : 0, j1 = per_vh ? j0 + 1 : group;
        const int len = cu[b + 1] - cu[b];
        if (ci * GDN_C >= len) {   // past this stream's end: no item, no flag (the sequential kernel waits for none)
            claim();
            sync();
            continue;
        }
        overlapped_item<DK>(m, q, k, g, beta, num_k_heads, num_v_heads, ws, sw, b, kh, ci, len, tid, sync, claim, j0,
                            j1);
        if (tid == 0) {   // the group's record stores are issued (the item's last barrier): publish them
            unsigned* flag = ready_flag_at<DK>(ws, m, b, ci, kh, num_k_heads, num_v_heads);
            asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(flag), "r"(j1 - j0) : "memory");
        }
    }
}

}  // namespace gdnw

// ================================================================ entries
// The host plans their grids (q12drv.kernels.gdn) and passes its sizes as contract defines, checked here.
#if !defined(Q12_GDN_WGMMA_SEQUENTIAL_SMEM_2STAGE_D128) || !defined(Q12_GDN_WGMMA_SEQUENTIAL_SMEM_2STAGE_D64) ||  \
    !defined(Q12_GDN_WGMMA_SEQUENTIAL_SMEM_1STAGE_D64) ||                                                        \
    !defined(Q12_GDN_WGMMA_SEQUENTIAL_SMEM_WIDE_D128) || !defined(Q12_GDN_OVERLAP_SEQUENTIAL_SMEM_D128) ||        \
    !defined(Q12_GDN_OVERLAP_SEQUENTIAL_SMEM_D64) || !defined(Q12_GDN_OVERLAP_PRECOMPUTE_SMEM_D128) ||            \
    !defined(Q12_GDN_OVERLAP_PRECOMPUTE_SMEM_D64) || !defined(Q12_GDN_OVERLAP_REC_D128) ||                         \
    !defined(Q12_GDN_OVERLAP_REC_D64) || !defined(Q12_GDN_TREC) || !defined(Q12_GDN_OVERLAP_GROUPS) ||            \
    !defined(Q12_GDN_OVERLAP_VH_CHUNKS) || !defined(Q12_GDN_WIDE_WARPGROUPS)
#error "compile through q12drv: it passes the host's shared memory and record sizes (-DQ12_GDN_WGMMA_*, -DQ12_GDN_OVERLAP_*, -DQ12_GDN_TREC, -DQ12_GDN_WIDE_WARPGROUPS)"
#endif
static_assert(gdnw::sequential_smem<128, 1, false, 2>() == Q12_GDN_WGMMA_SEQUENTIAL_SMEM_2STAGE_D128 &&
                  gdnw::sequential_smem<64, 1, false, 2>() == Q12_GDN_WGMMA_SEQUENTIAL_SMEM_2STAGE_D64 &&
                  gdnw::sequential_smem<64, 1, false, 1>() == Q12_GDN_WGMMA_SEQUENTIAL_SMEM_1STAGE_D64 &&
                  gdnw::sequential_smem<128, 2, false, 2>() == Q12_GDN_WGMMA_SEQUENTIAL_SMEM_WIDE_D128 &&
                  gdnw::sequential_smem<128, 1, true, 2>() == Q12_GDN_OVERLAP_SEQUENTIAL_SMEM_D128 &&
                  gdnw::sequential_smem<64, 1, true, 2>() == Q12_GDN_OVERLAP_SEQUENTIAL_SMEM_D64,
              "the wgmma sequential kernels' shared memory differs from the host's");
static_assert(gdnw::overlapped_precompute_smem<128>() == Q12_GDN_OVERLAP_PRECOMPUTE_SMEM_D128 &&
                  gdnw::overlapped_precompute_smem<64>() == Q12_GDN_OVERLAP_PRECOMPUTE_SMEM_D64,
              "the overlapped precompute's shared memory differs from the host's");
static_assert(gdnw::OverlapRec<128>::BYTES == Q12_GDN_OVERLAP_REC_D128 &&
                  gdnw::OverlapRec<64>::BYTES == Q12_GDN_OVERLAP_REC_D64 && gdnc::TRec::BYTES == Q12_GDN_TREC,
              "the record sizes differ from the host's");
static_assert(wgmma_config().overlap_groups == Q12_GDN_OVERLAP_GROUPS &&
                  wgmma_config().value_head_chunks == Q12_GDN_OVERLAP_VH_CHUNKS &&
                  wgmma_config().wide_warpgroups == Q12_GDN_WIDE_WARPGROUPS,
              "the overlapped precompute's groups or items, or the wide CTA's warpgroups differ from the host's");

// The two-stage, wide and overlapped kernels: 1 CTA/SM; the one-stage kernel: 2 CTAs/SM (d64: at d128 the wide CTA
// runs where the grid fills two CTAs an SM).
constexpr int GDN_WIDE = wgmma_config().wide_warpgroups, GDN_GROUPS = wgmma_config().overlap_groups;
extern "C" __global__ void __launch_bounds__(128, 1) q12_gdn_wgmma_sequential_2stage_d128(GDN_PARAMS) { wgmma_sequential_body<128, 2>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1) q12_gdn_wgmma_sequential_2stage_d64(GDN_PARAMS) { wgmma_sequential_body<64, 2>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 2) q12_gdn_wgmma_sequential_1stage_d64(GDN_PARAMS) { wgmma_sequential_body<64, 1>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(128 * GDN_WIDE, 1) q12_gdn_wgmma_sequential_wide_d128(GDN_PARAMS) { wgmma_sequential_body<128, 2, GDN_WIDE>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(128 * GDN_GROUPS, 1) q12_gdn_wgmma_overlapped_precompute_d128(GDN_PARAMS) { gdnw::overlapped_precompute_body<128>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(128 * GDN_GROUPS, 1) q12_gdn_wgmma_overlapped_precompute_d64(GDN_PARAMS) { gdnw::overlapped_precompute_body<64>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1) q12_gdn_wgmma_overlapped_sequential_d128(GDN_PARAMS) { wgmma_sequential_body<128, 2, 1, true>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1) q12_gdn_wgmma_overlapped_sequential_d64(GDN_PARAMS) { wgmma_sequential_body<64, 2, 1, true>(GDN_ARGS); }
