// gdn_wgmma.cu: the sequential kernel of the "wgmma" Gated DeltaNet pair (ops.gdn(algo="wgmma")), on Hopper's
// warpgroup MMA (compiled for sm_90a), and the pair's flow form for grids of few CTAs ("the flow form", below
// the sequential kernel). The pair's first launch is gdn_chunk.cu's q12_gdn_chunk_prep_tiles_d*:
// the chunk-local work of every (stream, chunk) in parallel, into one record per (stream, value head, chunk) in
// the workspace (gdn_chunk.cuh: TileVRec, 128-byte swizzled tiles; no K record). Same math, arguments and
// in-place state contract as gdn_chunk.cu (its header has the algebra); what differs is the solve, the rows the
// state's products take and the instructions. With k, q the raw bf16 rows, rk = 1 / |k| and rq = dk^-1/2 / |q|
// per token (K = rk k, Q = rq q are the normalised rows):
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
//                             (XY 1) X is committed alone, so R is computed while Y's wgmma run;
//   V_new^T:                  8 m64n64k16, A = R^T as bf16 hi + lo, B = T (K-major);
//   O^T += V_new^T P^T:       8 m64n64k16, A = V_new^T hi + lo, B = P (K-major);
//   S^T += Vd^T k:            8 m64n{dk}k16, A = Vd^T hi + lo, B = k (the same tile, MN-major; k is exact in bf16,
//                             so two products carry what took three with the normalised K's hi + lo).
// The epilogues move the V slice in and the O slice out by 8 x 8 matrices, transposed (ldmatrix / stmatrix .trans:
// four instructions each way where there were 32 scalar loads and 32 scalar stores), read the per-token factors
// as float2 pairs and split the hi + lo pairs from hi's bits (pack_hilo<true>).
// Loads: the raw k and q rows of the chunk's key head come by cp.async from every thread straight into the
// stage's swizzled tiles (gdn_chunk.cuh's issue_kq_sw128), the V slice (strided in v) the same way, and the V
// record, a byte image of the stage's TileVRec bytes, by one bulk copy from thread 0 (cp.async.bulk, completing
// on the stage's mbarrier). STAGES 2 (1 CTA/SM): chunk c + 1 loads while c computes, for grids of few CTAs, its
// copies issued (AHEAD 1) while c's X and Y run, off the chain; STAGES 1 (2 CTAs/SM): (EARLY 1) chunk c + 1's rows
// and record are copied as soon as c's last wgmma is done, its V slice once c's o rows are stored, while the other
// CTA computes (the rule: gdn_wgmma.stages).
// Numerics: the "split" pair's operands and roundings (bf16 S into the products, hi + lo pairs for R, V_new and
// the update's left operand) with T rounded to bf16 once (a T lo product measured no more accurate on the H200:
// it was removed with its 8 KiB a record), and the raw rows with fp32 scales where the split pair takes the
// rounded normalised rows, in the precompute's A and P too since session 10 (H200 run AY: the state's error
// 7.5e-5 -> 5.0e-5, o's 3.6e-3 -> 3.0e-3); gdn_chunk.chunked_reference(t_product=True) models them. The results
// are not the fused kernel's bits; batched == alone holds (a CTA never mixes streams).
// Shared memory (dynamic, 1 KiB slack for the tiles' 1024-byte alignment) per stage: k, q tiles (2 x 64 x dk
// bf16), T and P tiles (2 x 8 KiB), beta / EK / EQ / WK (1 KiB) and exp(gamma_C) (16 B), the V and O slices
// [64][72] bf16, rounded up to 1 KiB (68 KiB at d128); then one mbarrier per stage.
// Requirements: as gdn_chunk.cu (q, k 16-byte aligned, v, o 8-byte aligned; dv a multiple of 64), and the
// workspace 16-byte aligned (the bulk copies).
// Measured on the H200 before the raw rows (tests/GPU.md session 7, runs AQ and AS; Hk 16, Hv 32, d 128; ms,
// both launches; STAGES 2 / 1; the K record of K hi, K lo and Q then came by bulk copy and the update took
// three products): 8 x 2048 0.567 / 0.526, 1 x 8192 0.443 / 0.541, ragged 8 x 256..2048 0.353 / 0.337, 8 x 128
// 0.065 / 0.058, 1 x 2048 0.128 / 0.153 (session 6, before the trims: 0.603 / 0.561, 0.475 / 0.582, 0.372 /
// 0.366, 0.068 / 0.061, 0.135 / 0.165); XY 0 and EARLY 0 within 1%; the flow form 0.430 at 1 x 8192, 0.134 at
// 1 x 2048; fla-core 0.6.0 replayed from a CUDA graph 0.946 / 0.637 / 0.572 (8 x 2048 / 1 x 8192 / ragged).
// Session 8 (no GPU was lent: none of it has run on one yet, checked by NVRTC 13.0 and nvdisasm only): the raw
// rows (no K record of 48 KiB per (stream, key head, chunk) written and read; the update 8 wgmma instead of 12),
// AHEAD, the matrix moves and the bit split: the d128 two-stage kernel's SASS 2396 -> 2136 instructions, its loop
// about 250 of them fewer on the chain and 250 moved under X and Y; 0 spills, no wgmma serialised.
// The wide form (q12_gdn_wgmma_seqw_d128, ops.gdn(form="wide"), session 8, not run on a GPU yet either): one CTA of
// two warpgroups per (stream, value head), each warpgroup one dv slice with its own V and O slices, the chunk's k
// tile (copied by warpgroup 0), q tile (warpgroup 1) and V record shared: each comes to shared memory once for the
// two slices (8 x 2048: 33 KB a warpgroup-chunk from L2 instead of 58); two stages, 1 CTA/SM.
// Tried by SASS and dropped: the O product left in flight into the next chunk (ptxas 13.0 then serialises all 40
// wgmma of the loop, chunk_mma's note); O^T and S^T scaled under V_new's wgmma (ptxas moved the multiplies below
// the wait).
#include "gdn/chunk.cuh"
#include "common/wgmma.cuh"

                        // 0.368 -> 0.344 ms at 1 x 8192, the same bits); 0: from k and q. (U in bf16, as fla-core's u,
                        // was measured too and dropped: 0.368 -> 0.355 ms, the state's error 5.5e-5 -> 5.3e-4.)
                          // but the scales, Q K^T and the k and q stores twice), one per (stream, chunk, key head)
                          // after them; 0: one per (stream, chunk, key head) throughout, its value heads one after
                          // the other. Measured at 1 x 8192: run BN (the precompute then paced the flow form):
                          // every chunk's items a value head 0.344 -> 0.388 ms, the first 8 0.357; session 14 (the
                          // sequential kernel 0.263 ms alone, the precompute 0.251): every chunk's 316.2 us in
                          // gpu_compare (run BW), as without; session 15, with GDN_WG_FLOW_FLAGS 16, bench/gdn_ab.py
                          // (one process a build, the rounds interleaved, run BY): without 307.3 us, every chunk's
                          // 305.0, the first 8 chunks' 301.1 (the same bits: the items' arithmetic is the same)
                                // (gdn_wgmma.FLOW_VH_CHUNKS: the host's count of the items)
                       // independent of S; run BQ: the flow form 0.341 -> 0.317 ms at 1 x 8192); 0: U in fp32 from
                       // the precompute (UwsRec)
                           // samples in run BN)
                       // own diagonal block (no barrier and no idle half of the group around invert_diagonal); 0:
                       // P from Q K^T's rows, invert_diagonal by threads 0..63 between two barriers. With
                       // KKEARLY and PUBFENCE 0 the precompute alone took 247 us under ncu at 1 x 8192 (run BU;
                       // 266 before them, run BT), its barrier stalls 1.73 -> 0.99 an issue; the flow form did not
                       // move (the sequential kernel, 0.263 ms alone, now paces it): run BV's gdn_debug at 1 x
                       // 8192, default 0.317 ms, PBAL 0 0.316, KKEARLY 0 0.319, PUBFENCE 1 0.317 (the same bits)
                            // ms (TOK0 0: 0.316): within the spread, as U's and S's products into one accumulator
                            // run one after the other anyway
                              // (bench/gdn_ab.py, runs BX and BY): 4 317.6 / 315.7 us, 16 306.8 / 307.3, 32 305.4
                              // (run BY; the same bits). Tried with it and dropped (run BX): U's 8 wgmma issued
                              // first, right after the chunk's barrier, with the next chunk's copies and S's
                              // conversions under them (nvdisasm: U's wait after the copies, as meant): 306.8 ->
                              // 323.9 us, and 317.6 -> 334.6 with 4 flags; why it is slower is not known
#define Q12_STR_(x) #x
#define Q12_STR(x) Q12_STR_(x)
                           // an L1 invalidation, more: 1.5% of the precompute's stall samples in run BT)


namespace gdnw {

using namespace gdnc;

// The flow record (GDN_WG_USEQ 1): UwsRec's common part (W stored as -W), then T diag(beta) hi and lo (two
// [64 j][64 t] swizzled tiles, 8 KiB each) in place of U; the sequential kernel copies its V slice from v.
enum : int { TILE64 = GDN_C * GDN_C * 2 };   // one [64][64] bf16 tile (T diag(beta) hi or lo, a V slice)
template <int DK, int DV>
struct UseqRec : UwsRec<DK, DV> {
    static constexpr int TB = UwsRec<DK, DV>::COMMON, BYTES = TB + 2 * TILE64;
    static_assert(TB % 16 == 0, "bulk copies from 16-byte aligned addresses");
};
template <bool B, class T, class F> struct pick { using type = T; };
template <class T, class F> struct pick<false, T, F> { using type = F; };
template <int DK, int DV>
using FlowRec = typename pick<1 != 0, UseqRec<DK, DV>, UwsRec<DK, DV>>::type;

// Byte offsets inside one stage (from its 1024-byte aligned start); BYTES is a multiple of 1024. WGS: warpgroups
// of the CTA, each with its own V and O slices (slice w at V + w * SLICE, O + w * SLICE); the tiles and the V
// record are shared.
// UWS (the flow form's GDN_WG_UWS 1): the record is UwsRec's common part (W, P, EQ, WK, exp(gamma_C); one bulk
// copy) and the CTA's U slice (a second one), no V slice.
template <int DK, int WGS = 1, bool UWS = false>
struct Stage {
    using UR = FlowRec<DK, DK>;
    static constexpr bool USEQ = UWS && 1;             // (the flow form's GDN_WG_USEQ)
    static constexpr int KT = GDN_C * DK * 2;                    // one [64 x DK] bf16 tile
    static constexpr int K = 0, Q = KT;                          // raw k and q rows, swizzled (cp.async)
    static constexpr int VREC = 2 * KT;                          // TileVRec or UwsRec's common part (one bulk copy)
    static constexpr int REC = UWS ? UR::COMMON : TileVRec::BYTES;
    static constexpr int T = VREC + TileVRec::T, W = VREC + UR::W;   // T (the pair's), W (UWS)
    static constexpr int P = VREC + (UWS ? UR::P : TileVRec::P);
    static constexpr int BETA = VREC + TileVRec::BETA, EK = VREC + TileVRec::EK;   // not UWS
    static constexpr int EQ = VREC + (UWS ? UR::EQ : TileVRec::EQ), WK = VREC + (UWS ? UR::WK : TileVRec::WK);
    static constexpr int EGC = VREC + (UWS ? UR::EGC : TileVRec::EGC);
    static constexpr int LDV = GDN_BV + 8, SLICE = GDN_C * LDV * 2;
    static constexpr int U = VREC + REC;                         // (UWS) the U slice, UR::USLICE bytes
    static constexpr int TB = (VREC + REC + 1023) / 1024 * 1024;  // (USEQ) T diag(beta) hi, lo: 2 x 8 KiB tiles
    static constexpr int VS = TB + 2 * TILE64;                   // (USEQ) the V slice: a swizzled [64][64] tile
    static constexpr int V = VREC + REC;                         // (not UWS) the V slices [64][LDV] bf16
    static constexpr int O = USEQ ? VS + TILE64 : UWS ? U + UR::USLICE : V + WGS * SLICE;   // the O slices
    static constexpr int RAW = O + WGS * SLICE;                 // the last stage's extent (the mbarriers follow it)
    static constexpr int BYTES = (RAW + 1023) / 1024 * 1024;    // a stage's stride (the next on 1024 bytes)
    static_assert(VREC % 1024 == 0 && P % 1024 == 0 && V % 16 == 0 && RAW % 16 == 0, "stage layout: the tiles on "
                  "1024-byte atoms, the slices and the mbarriers 16-byte aligned");
    static_assert(!UWS || WGS == 1, "UWS: one warpgroup a CTA (the flow form)");
};

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

// One chunk's products for this warpgroup (gdn_chunk.cuh's state_step with the solve as one product): St is
// S^T (m64n{DK} accumulator), updated; Ot gets O^T [64 dv x 64 tokens] (m64n64 accumulator). sb / sp: the
// stage (shared address, pointer); vs: this warpgroup's V slice (shared address), read here; warp: 0..3 in the
// warpgroup. meanwhile() runs while the first products are in flight.
// Every wgmma is complete on return. (Leaving the O product in flight into the next chunk, issued
// after the update, made ptxas 13.0 serialize all 40 wgmma of the loop, each waited alone: nvdisasm, session 8;
// it does so as soon as any wgmma is in flight across the loop's back edge, even with the wait at the loop's top.)
// UWS (the flow form, GDN_WG_UWS 1): X' = S^T W^T takes the W tile where X takes k, and V_new^T = U^T - X' (the
// stage's U slice; vs unused) replaces R's epilogue and the T product.
template <int DK, bool UWS, class F>
__device__ __forceinline__ void chunk_mma(float (&St)[DK / 2], float (&Ot)[32], unsigned sb, const unsigned char* sp,
                                          unsigned vs, int warp, int lane, F&& meanwhile) {
    using L = Stage<DK, 1, UWS>;
    constexpr int NK = DK / 16;
    const int tq = lane & 3;
    const float* bet = reinterpret_cast<const float*>(sp + L::BETA);
    const float* ek = reinterpret_cast<const float*>(sp + L::EK);
    const float* eq = reinterpret_cast<const float*>(sp + L::EQ);
    const float* wk = reinterpret_cast<const float*>(sp + L::WK);
    float (*S4)[4] = reinterpret_cast<float (*)[4]>(St);
    float (*O4)[4] = reinterpret_cast<float (*)[4]>(Ot);

    // ---- X = S^T K^T (UWS: X' = S^T W^T), Y = S^T Q^T (into Ot); then R^T = beta (V^T - exp(gamma) X) and
    // V_new^T = R^T T^T (UWS: V_new^T = U^T - X')
    float X[32], N[32];
    float (*X4)[4] = reinterpret_cast<float (*)[4]>(X);
    float (*N4)[4] = reinterpret_cast<float (*)[4]>(N);
    unsigned sa[NK][4], rh[4][4], rl[4][4];
    // USEQ: U^T = V^T (T diag(beta))^T first (it needs no S), then S^T (-W)^T onto it. GDN_WG_CVT_FIRST 1: S's
    // bf16 fragments before both, one wgmma.fence; 0: converted while U's wgmma run, a second fence before S's
    // products, where ptxas 13.0 waits for U's (nvdisasm: WARPGROUP.DEPBAR between the two groups)
    constexpr bool CVT_FIRST = !L::USEQ || 1;
    if constexpr (CVT_FIRST) {
#pragma unroll
        for (int ks = 0; ks < NK; ++ks) a_from_c(S4[2 * ks], S4[2 * ks + 1], sa[ks]);
    }
    if constexpr (L::USEQ) {
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            wg::wgmma_ss_n64<1, 1>(X, mnmajor(sb + L::VS, kk), mnmajor(sb + L::TB, kk), kk > 0);
            wg::wgmma_ss_n64<1, 1>(X, mnmajor(sb + L::VS, kk), mnmajor(sb + L::TB + TILE64, kk), 1);
        }
    }
    if constexpr (!CVT_FIRST) {
#pragma unroll
        for (int ks = 0; ks < NK; ++ks) a_from_c(S4[2 * ks], S4[2 * ks + 1], sa[ks]);
    }
    if (!L::USEQ || !CVT_FIRST) wg::fence();
#pragma unroll   // (USEQ: X = U^T + S^T (-W)^T, V_new^T itself)
    for (int ks = 0; ks < NK; ++ks)
        wg::mma_rs<64, 0>(X, sa[ks], kmajor(sb + (UWS ? L::W : L::K), ks), L::USEQ || ks > 0);
    wg::commit();
#pragma unroll
    for (int ks = 0; ks < NK; ++ks) wg::mma_rs<64, 0>(Ot, sa[ks], kmajor(sb + L::Q, ks), ks > 0);
    wg::commit();
    meanwhile();
    wg::wait<1>();   // X complete (XY 1: Y may still run)
    wg::pin(X);
    if constexpr (L::USEQ) {   // X is V_new^T
        wg::wait<0>();   // Y
        wg::pins(Ot, X, sa);
    } else if constexpr (UWS) {   // V_new^T = U^T - X': this thread's 8 n-tiles of the U slice (UwsRec's order)
        const float4* u = reinterpret_cast<const float4*>(sp + L::U) + 32 * warp + lane;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const float4 x = u[nt * 128];
            X4[nt][0] = x.x - X4[nt][0];
            X4[nt][1] = x.y - X4[nt][1];
            X4[nt][2] = x.z - X4[nt][2];
            X4[nt][3] = x.w - X4[nt][3];
        }
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
    float (*V4)[4] = UWS ? X4 : N4;   // V_new^T
    // ---- O^T = exp(gamma) Y + V_new^T P^T;  S^T = exp(gamma_C) S^T + (V_new^T exp(gamma_C - gamma)) K
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
    // (O^T and S^T scaled under V_new's wgmma instead, between a wait for Y and one for V_new: ptxas 13.0 moved
    // every multiply below the second wait, session 8's nvdisasm)
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
    for (int kk = 0; kk < 4; ++kk) {
        wg::mma_rs<64, 0>(Ot, vh[kk], kmajor(sb + L::P, kk), 1);
        if (0) wg::mma_rs<64, 0>(Ot, vl[kk], kmajor(sb + L::P, kk), 1);
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        wg::mma_rs<DK, 1>(St, dh[kk], mnmajor(sb + L::K, kk), 1);
        wg::mma_rs<DK, 1>(St, dl[kk], mnmajor(sb + L::K, kk), 1);
    }
    wg::commit();
    wg::wait<0>();
    wg::pins(Ot, St, vh, vl, dh, dl);
}

// The flow form (below), thread 0 of a sequential CTA: how many chunks from lo on have their records ready (1 to
// GDN_WG_FLOW_FLAGS, at most n: the flags of lo .. lo + n - 1, stride bytes apart, each ready at need or more: 1, or
// GDN_WG_FLOW_VH's count of the key head's value-head items), waiting for lo's if needed. The flags are read
// together (relaxed, one round trip), then one acquire fence and one proxy fence order the bulk copies that read
// those records (async proxy) after them: per batch, not per chunk (run 3: an acquire load and a proxy fence at
// every chunk made the sequential kernel 35% slower, 0.8 us a chunk). One asm block: as C++ loops the wait cost
// the d128 kernel a spill under NVRTC 13.0.
#define Q12_FLAG_ZERO(i) "mov.u32 f" #i ", 0;\n"
#define Q12_FLAG_LOAD(i) "add.s64 a, a, %3;\nsetp.gt.s32 p, %2, " #i ";\n@p ld.relaxed.gpu.global.u32 f" #i ", [a];\n"
#define Q12_FLAG_COUNT(i) "setp.lt.u32 w, f" #i ", %4;\n@w bra Q12_COUNTED_%=;\nadd.s32 %0, %0, 1;\n"
#define Q12_FLAGS_4(M) M(1) M(2) M(3)
#define Q12_FLAGS_8(M) Q12_FLAGS_4(M) M(4) M(5) M(6) M(7)
#define Q12_FLAGS_16(M) Q12_FLAGS_8(M) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
#define Q12_FLAGS_32(M) Q12_FLAGS_16(M) M(16) M(17) M(18) M(19) M(20) M(21) M(22) M(23) M(24) M(25) M(26) M(27) \
    M(28) M(29) M(30) M(31)
#define Q12_FLAGS(M) Q12_FLAGS_32(M)
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
#undef Q12_FLAGS_4
#undef Q12_FLAGS_8
#undef Q12_FLAGS_16
#undef Q12_FLAGS_32
#undef Q12_FLAG_ZERO
#undef Q12_FLAG_LOAD
#undef Q12_FLAG_COUNT

// The stream a sequential CTA of grid row r takes: the r-th longest (ties: the lower index first), so that a
// ragged pass's longest streams start in the first wave and the short ones fill in behind them (longest
// processing time first: H200 run AU, 8 streams of 256..2048 tokens, the wide form's sequential kernel took 188 us
// in grid order, against about 125 us for its longest stream alone). Every thread of the CTA calls it; scratch:
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

// grid (DV / 64 / WGS, Hv, n), 128 WGS threads (WGS warpgroups), dynamic smem gdn_wgmma.seq_smem_bytes(DK, STAGES,
// WGS). FLOW: the flow form's sequential kernel (below): a chunk's records are copied once their precompute item's
// ready flag is set, and the CTA ends with griddepcontrol.wait (the precompute grid complete). WGS 2 (the wide
// form, ops.gdn(form="wide")): warpgroup w owns dv slice 2 blockIdx.x + w; the chunk's k and q tiles (one each
// warpgroup copies) and V record are the two's, so each comes to shared memory once for both.
template <int DK, int DV, int STAGES, bool FLOW = false, int WGS = 1, bool UWS = false>
__device__ __forceinline__ void gdn_wg_seq_body(const Q12Meta& m, const unsigned long long* __restrict__ h_state_ptrs,
                                                const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                const bf16* __restrict__ v, bf16* __restrict__ o, int num_k_heads,
                                                int num_v_heads, unsigned char* __restrict__ ws) {
    using namespace gdnc;
    using L = gdnw::Stage<DK, WGS, UWS>;
    using UR = gdnw::FlowRec<DK, DV>;
    constexpr int C = GDN_C, BV = GDN_BV, THREADS = 128 * WGS;
    static_assert(!FLOW || STAGES == 2, "the flow form's sequential kernel has two stages");
    static_assert(!UWS || FLOW, "UWS: the flow form's records");
    static_assert(WGS == 1 || (WGS == 2 && !FLOW && STAGES == 2), "the wide form: two stages, no flags");
    extern __shared__ __align__(128) unsigned char gdn_smem_raw[];
    const unsigned raw = smem_u32(gdn_smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;                  // the tiles' 1024-byte alignment
    unsigned char* basep = gdn_smem_raw + (base - raw);
    const unsigned bars = base + (STAGES - 1) * L::BYTES + L::RAW;   // one mbarrier per stage
    if constexpr (FLOW) {   // gdn_wgmma.py's seq_smem_bytes (896 bytes of alignment slack: __align__(128))
        unsigned dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
        if (bars + 8 * STAGES - raw > dyn) __trap();
    }

    // Every CTA waits for the precompute grid before it ends (pdl_wait; at once where it has nothing to do), so the
    // stream's next operation finds both grids complete, whichever way the pair was launched.
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
    // grid row z takes the z-th longest stream (the flow form: stream z; its CTAs are all resident at once). The
    // scratch is stage 0's first bytes, free until the copies below, which come after the barrier below.
    const int b = FLOW ? (int)blockIdx.z
                       : gdnw::longest_first(cu, (int)m.batch_size, (int)blockIdx.z,
                                             reinterpret_cast<int*>(basep), tid, THREADS);
    const int len = cu[b + 1] - cu[b];
    if (len <= 0) {
        pdl_wait();
        return;
    }
    const int kh = h / (num_v_heads / num_k_heads);
    const int nch = (len + C - 1) / C;

    // FLOW: chunk 0's ready flag and the last chunk known ready, in shared memory (thread 0's; no register held
    // across the chunk loop for them), written before the prologue's barrier
    __shared__ const unsigned* flags;
    __shared__ int ready_to;
    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) wg::mbar_init(bars + 8 * i, 1);
        wg::fence_mbarrier_init();
        if (FLOW) {
            flags = ready_flag_at<UR::BYTES>(ws, m, b, 0, kh, num_k_heads, num_v_heads);
            ready_to = -1;
        }
    }
    __syncthreads();
    // Chunk ci into stage st, once every wgmma and generic read of the stage's tiles and scalars is done (the
    // caller's barrier). The raw k and q rows: every thread, one cp.async group (made visible to the wgmma by each
    // thread's proxy fence after its wait); the UWS flow form's (KQREC) come with the record instead, the
    // precompute's copy of them. The V record: thread 0, one bulk copy on the stage's mbarrier. The V
    // slice (issue_v): every thread, one cp.async group, once the stage's O rows are stored.
    constexpr bool KQREC = UWS && 1;   // (the k and q tiles come with the record)
    // (FLOW) a ready flag's value once every item of its key head is stored (GDN_WG_FLOW_VH: one item a value head)
    const unsigned FLOW_NEED = 1 ? (unsigned)(num_v_heads / num_k_heads) : 1u;
    auto issue_kq = [&](int ci, int st) {   // the raw k and q rows from k and q (KQREC: none, the record brings them)
        if (KQREC) return;
        unsigned char* sp = basep + st * L::BYTES;
        const int nv = min(C, len - ci * C), tok = ld_volatile(cu + b) + ci * C;
        if (WGS == 1) issue_kq_sw128<DK>(sp + L::K, sp + L::Q, k, q, nv, tok, num_k_heads, kh, wtid);
        else if (wgi == 0) issue_kq_sw128<DK, 1>(sp + L::K, sp + L::Q, k, q, nv, tok, num_k_heads, kh, wtid);
        else issue_kq_sw128<DK, 2>(sp + L::K, sp + L::Q, k, q, nv, tok, num_k_heads, kh, wtid);
        cp_async_commit();
    };
    auto issue_vrec = [&](int ci, int st) {   // the V record: the precompute's
        if (tid == 0) {
            const unsigned sb = base + st * L::BYTES;
            if (ci == 0) {   // later chunks: (FLOW) at the loop's top; else the precompute is complete
                if constexpr (FLOW) ready_to = gdnw::wait_ready(flags, nch, 4ull * num_k_heads, FLOW_NEED) - 1;
                else pdl_wait();
            }
            wg::fence_proxy_async();   // the stage's generic reads (beta, EK, ...) before the copy's writes
            if constexpr (UWS) {   // the record's common part, then this CTA's U slice (USEQ: T diag(beta), V slice)
                const unsigned char* rec = rec_at<UR::BYTES>(ws, m, b, ci, h, num_v_heads);
                constexpr unsigned TAIL = L::USEQ ? 2 * gdnw::TILE64 : UR::USLICE;
                wg::mbar_arrive_expect_tx(bars + 8 * st, UR::COMMON + TAIL + (KQREC ? 2 * L::KT : 0));
                if (KQREC) wg::bulk_g2s(sb + L::K, kqrec_at<UR::BYTES, DK>(ws, m, b, ci, kh, num_k_heads, num_v_heads),
                                        2 * L::KT, bars + 8 * st);
                wg::bulk_g2s(sb + L::VREC, rec, UR::COMMON, bars + 8 * st);
                if constexpr (L::USEQ) {
                    wg::bulk_g2s(sb + L::TB, rec + UR::TB, 2 * gdnw::TILE64, bars + 8 * st);
                } else {
                    wg::bulk_g2s(sb + L::U, rec + UR::U + (col0 / BV) * UR::USLICE, UR::USLICE, bars + 8 * st);
                }
            } else {
                wg::mbar_arrive_expect_tx(bars + 8 * st, TileVRec::BYTES);
                wg::bulk_g2s(sb + L::VREC, tile_vrec_at(ws, m, b, ci, h, num_v_heads), TileVRec::BYTES, bars + 8 * st);
            }
        }
    };
    auto issue_records = [&](int ci, int st) {
        issue_kq(ci, st);
        issue_vrec(ci, st);
    };
    // (USEQ, GDN_WG_FLOW_TOK0) the stream's first token, held across the chunk loop
    constexpr bool TOK0 = L::USEQ && 1;
    const int tok0 = TOK0 ? ld_volatile(cu + b) : 0;
    auto first_tok = [&] { return TOK0 ? tok0 : ld_volatile(cu + b); };
    auto issue_v = [&](int ci, int st) {   // (UWS: none, U comes in the record; USEQ: the slice, swizzled)
        if constexpr (L::USEQ) {
            gdnw::issue_v_sw128<DV, BV>(basep + st * L::BYTES + L::VS, v, min(C, len - ci * C),
                                         first_tok() + ci * C, num_v_heads, h, wtid, col0);
            cp_async_commit();
            return;
        }
        if (UWS) return;
        issue_v_slice<DV>(reinterpret_cast<bf16*>(basep + st * L::BYTES + L::V + wgi * L::SLICE), v, min(C, len - ci * C),
                          ld_volatile(cu + b) + ci * C, num_v_heads, h, col0, wtid);
        cp_async_commit();
    };
    // chunk 0's inputs and the state first: with the pair launched by PDL they load while the precompute finishes
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
        if (STAGES == 1 && ci > 0) {   // every thread is past chunk ci - 1's products: this chunk's V slice
            if (!1) issue_records(ci, 0);
            issue_v(ci, 0);
        }
        wg::mbar_wait(bars + 8 * st, (ci / STAGES) & 1);   // the stage's (ci / STAGES)-th fill
        cp_async_wait_all();
        wg::fence_proxy_async();   // this thread's k and q rows visible to the wgmma (the barrier below: everyone's)
        // FLOW: the next chunk's records are ready before its copies are issued below. Polled here, once this
        // chunk's copy and V slice have landed and before the next one is issued: the fence then waits for no bulk copy in
        // flight (polled before mbar_wait it did, about 1.8 us a fence, run AR)
        if (FLOW && tid == 0 && ci + 1 < nch && ci + 1 > ready_to)
            ready_to = ci + gdnw::wait_ready(flags + (ci + 1) * num_k_heads, nch - ci - 1, 4ull * num_k_heads,
                                             FLOW_NEED);
        __syncthreads();   // chunk ci's V slice from every thread and chunk ci - 1's O slice; (STAGES 2) chunk ci - 1
                           // is done with its stage
        auto issue_next = [&] {   // (STAGES 2) chunk ci + 1 into the other stage, which chunk ci - 1 is done with
            if (STAGES == 2 && ci + 1 < nch) {
                issue_records(ci + 1, st ^ 1);
                issue_v(ci + 1, st ^ 1);
            }
        };
        constexpr int AHEAD = UWS ? 0 : 1;
        if (AHEAD == 0) issue_next();
        float Ot[32];
        gdnw::chunk_mma<DK, UWS>(St, Ot, base + st * L::BYTES, basep + st * L::BYTES, base + st * L::BYTES + L::V + wgi * L::SLICE,
                            warp, lane, [&] {
            if (ci > 0) o_rows(ci - 1);
            if (AHEAD == 1) issue_next();   // its 2 x 64 + 64 / 2 copies off the chain, under X and Y
        });
        if (STAGES == 1) {
            __syncthreads();   // every warp is done with the stage's tiles, scalars, V slice and O slice
            if (1 && ci + 1 < nch) issue_records(ci + 1, 0);
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
    if constexpr (FLOW) pdl_wait();
}

// ================================================================ the flow form
// For grids of few sequential CTAs (one long stream: 64 CTAs at Hv 32, d 128 leave half of an H200 idle), the
// precompute runs beside the sequential kernel instead of before it. Three launches on one stream:
//   1. the ready flags and the item counter zeroed (ops: one memset of gdn_wgmma.flags_bytes);
//   2. q12_gdn_wgmma_prep_flow_d*: P persistent CTAs of three 128-thread groups (each group a prep_item_wg at a
//      time on its own WgPrepSmem, 60 KB at d128: one CTA fills an SM), each claiming items in chunk-major order
//      from the counter, each item's ready flag released once its records are stored; every CTA first executes
//      griddepcontrol.launch_dependents;
//   3. q12_gdn_wgmma_seq_flow_d*, launched with programmatic stream serialization: it may start once every
//      precompute CTA has started, lands on the SMs the precompute left free (P = SMs - its CTAs), and copies
//      a chunk's records once their flag is set.
// No cycle: the precompute never waits, and every CTA of it is running or done before a sequential CTA starts
// (without programmatic launch the sequential kernel starts after the precompute: the same result, serially).
// The sequential CTAs end with griddepcontrol.wait, so the stream's next operation finds both grids complete.
// Records and chain (GDN_WG_UWS 1, session 11): fla-core's order of the same algebra, V_new = U - W S. The
// precompute (gdn_chunk.cuh's prep_item<UWS>) stores, per (stream, value head, chunk), UwsRec: W = T diag(beta EK) k
// (bf16, the k tile's layout), P, EQ, WK, exp(gamma_C), and U = T diag(beta) V in fp32 in the sequential kernel's
// accumulator order (T diag(beta) and T diag(beta EK) as bf16 hi + lo pairs from the fp32 T, V and k exact). Per
// chunk the sequential kernel then runs [X' = S^T W^T, Y] -> V_new^T = U^T - X' (eight 16-byte loads and 32
// subtractions a thread) -> [O, S update]: R's epilogue, its hi + lo split and the 8 wgmma of the T product leave
// the chain. Not the pair's bits (chunked_reference(t_product=True, u_minus_ws="fp32") models it: the state's
// error as the pair's in numpy); batched == alone. The records are 3.3x the pair's (57.9 KB a value head and chunk
// at d128; GDN_WG_USEQ 1: 2.4x), fine here: they are read soon after they are written. GDN_WG_KQREC 1 (session
// 12): the precompute also
// stores each item's k and q tiles (kqrec_at), which it holds anyway, and the sequential kernel copies them with
// the record (one more bulk copy from thread 0 on the stage's mbarrier) instead of 2 x 8 cp.async a thread from k
// and q (24% of its stall samples in run BG). GDN_WG_USEQ 1 (session 13, the default): U's product moves to the
// sequential kernel, which takes V^T (T diag(beta))^T (8 wgmma, both operands MN-major in shared memory, issued
// before S's conversion: they need no S) as the start of X's accumulator, then S^T (-W)^T onto it: X is V_new^T,
// with no U loads or subtractions. The record (UseqRec, 41.5 KB at d128, 2.4x the pair's) carries T diag(beta)
// as bf16 hi + lo tiles instead of U in fp32, W negated; the sequential kernel copies its V slice from v itself
// (issue_v_sw128, 4 cp.async a thread), so the precompute loads no V at all, and, with no U product beside them,
// keeps T's fp32 columns for T diag(beta EK) (GDN_WG_TKEEP) and W's A fragments for both halves (GDN_WG_WFRAG).
// H200, 1 x 8192: the flow form 0.341 -> 0.317 ms (run BQ, gdn_debug), 315.2 us with TKEEP and WFRAG against
// fla-core's 626.8 (run BS, gpu_compare: 0.503). With V carried in the record as well (run BP) it was 0.338
// against 0.331: the precompute's V loads and stores cost what U's product saved. GDN_WG_UWS 0: the pair's
// records and sequential arithmetic (its bits; the flags stay where FlowRec puts them).
namespace gdnw {

// ---- the UWS flow precompute's item on warpgroup MMA (GDN_WG_PREP_WG 1; session 11, first run in session 12)
// (GDN_WG_USEQ 0) The same records and numerics as gdnc::prep_item<DK, DV, true, true> (K K^T, Q K^T of the raw
// rows in fp32; T's scaled columns as bf16 hi + lo; U in fp32, W rounded to bf16); GDN_WG_USEQ 1: T diag(beta)'s
// tiles stored in place of U (no V, no U product), -W. Its kinds of product by wgmma: K K^T and Q K^T
// as m64n64k16 with both operands the swizzled k and q tiles (the full 64 x 64: the accumulator is the mma.sync C
// layout of each warp's 16 rows, so products_epilogue takes it, warp w on block w for both), U^T per 64-row dv
// m-tile (A: V^T's fragments by ldmatrix.trans of the swizzled V rows, B: T diag(beta)'s swizzled [64 j][64 t] hi
// and lo tiles, MN-major), W per 64-column half (A: T diag(beta EK)'s fragments, B: the k tile MN-major).

// A flow precompute group's shared memory: PrepSmem's members with k and q as 128-byte swizzled tiles (the group's
// base on 1024 bytes), -A and P padded on 1024-byte boundaries (after the solve their bytes take T's scaled columns
// as two swizzled tiles); kraw is k (normalise's raw-row branch names it; the rows' scales only read k and q).
template <int DK>
struct WgPrepSmem {
    static constexpr int LDK = DK + 8, LDP = GDN_C + 8, LDD = 24;
    union {
        bf16 k[GDN_C * DK];
        bf16 kraw[GDN_C * DK];
    };
    bf16 q[GDN_C * DK];   // q's tile, then (its products done) the value head's V rows, swizzled [64][DV]
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
__host__ __device__ constexpr int wg_prep_group_bytes() { return (int)(sizeof(WgPrepSmem<DK>) + 1023) / 1024 * 1024; }

// (GDN_WG_PBAL) P from K Q^T's accumulator (the mma C layout of each warp's 16 rows, as products_epilogue takes
// it): warp w holds P^T's rows j = 16 w .. + 15 (k tokens), and its n-tiles nt >= 2 w are the q tokens i >= 16 w
// that P's causal part needs of them (the n-tiles before lie above P's diagonal: zero_ap's zeros). Each element is
// ex2(erq_i + ec_j) (K Q^T)_ji where i >= j (masked ones are selected away: their exponent may overflow), stored
// transposed into P's rows as bf16 by one stmatrix .trans a pair of n-tiles (matrix mm = lane / 8: n-tile 2 pr +
// mm / 2, P^T's rows 16 w + 8 (mm % 2) ..; in P rows 8 nt + lane % 8, columns 16 w + 8 (mm % 2) ..).
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

template <int DK, int DV, class Sync, class Claim>
__device__ __forceinline__ void prep_item_wg(const Q12Meta& m, const bf16* __restrict__ q, const bf16* __restrict__ k,
                                             const bf16* __restrict__ v, const float* __restrict__ g,
                                             const float* __restrict__ beta, int num_k_heads, int num_v_heads,
                                             unsigned char* __restrict__ ws, WgPrepSmem<DK>& s, int b, int kh, int ci,
                                             int len, int tid, Sync sync, Claim claim, int j0, int j1) {
    using UR = FlowRec<DK, DV>;
    static_assert(DV == DK, "V rows in q's tile (dv = dk)");
    constexpr int C = GDN_C, THREADS = 128, LDP = GDN_C + 8, NK = DK / 16;
    const int lane = tid & 31, warp = tid >> 5, mat = lane >> 3, r8 = lane & 7, gq = lane >> 2, tq = lane & 3;
    const int* cu = q12_cu_seqlens(m);
    const int c0 = ci * C, group = num_v_heads / num_k_heads, nv = min(C, len - c0);
    unsigned char* kt = reinterpret_cast<unsigned char*>(s.k);
    unsigned char* qt = reinterpret_cast<unsigned char*>(s.q);
    const unsigned sk = smem_u32(s.k), sq = smem_u32(s.q), sa = smem_u32(s.a), sp = smem_u32(s.p);

    // the item's value heads kh group + j0 .. + j1 - 1 (all of the key head's, or one: GDN_WG_FLOW_VH)
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
    // Q K^T (GDN_WG_PBAL: K Q^T, P^T's rows) once for the key head (each value head scales it by its own beta and
    // gamma in the epilogue)
    float accq[32];
    wg::fence();
#pragma unroll
    for (int ks = 0; ks < NK; ++ks)
        wg::mma_ss<64>(accq, kmajor(1 ? sk : sq, ks), kmajor(1 ? sq : sk, ks), ks > 0);
    wg::commit();
    if (j0 == 0) {   // the k and q tiles (adjacent here and in the stage) for the sequential kernel, before V takes q's bytes
        uint4* dst = reinterpret_cast<uint4*>(kqrec_at<UR::BYTES, DK>(ws, m, b, ci, kh, num_k_heads, num_v_heads));
        const uint4* src = reinterpret_cast<const uint4*>(s.k);
#pragma unroll 4
        for (int i = tid; i < 2 * C * DK * 2 / 16; i += THREADS) dst[i] = src[i];
    }
    wg::wait<0>();
    for (int j = j0; j < j1; ++j) {
        const int h = kh * group + j;
        if (j > j0) cp_async_wait_all();   // this value head's g, beta and V, copied while the previous head computed
        sync();   // (j j0: the scales and the zeroed -A and P stored; every thread's Q K^T complete: q is read out)
        if (!1 && j == j0) {   // (USEQ: the sequential kernel copies V itself)
            issue_v_sw128<DV>(qt, v, nv, ld_volatile(cu + b) + c0, num_v_heads, h, tid);
            cp_async_commit();
        }
        {
            float acck[32];   // K K^T again for each value head (a few wgmma; holding it costs registers)
            auto kk = [&] {
                wg::fence();
#pragma unroll
                for (int ks = 0; ks < NK; ++ks) wg::mma_ss<64>(acck, kmajor(sk, ks), kmajor(sk, ks), ks > 0);
                wg::commit();
            };
            if (1) kk();   // (it reads the k tile only) under zero_ap, chunk_gamma and their barrier
            if (j > j0) zero_ap(s, tid);   // the previous head's T tiles out of -A's and P's upper blocks
            if (warp == 0) chunk_gamma<true>(s, 0, lane);
            sync();
            if (j + 1 < j1) {   // the next value head's g and beta (chunk_gamma has read this head's)
                issue_kvgb<DK, DV, false, false, true>(s, nullptr, cu + b, len, c0, 0, k, nullptr, g, beta,
                                                       num_k_heads, num_v_heads, h + 1, 0, tid);
                cp_async_commit();
            }
            if (!1) kk();
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
        unsigned char* urec = rec_at<UR::BYTES>(ws, m, b, ci, h, num_v_heads);
        store_uws_scalars<DK, DV>(urec, s, tid);
        sync();   // -A read by every warp's solve, P stored: their bytes take T's scaled columns (swizzled tiles)
        t_cols_hilo<true>(X, s.a, s.p, [&](int c) { return s.beta[c]; }, warp, lane);
        cp_async_wait_all();       // this value head's V rows (USEQ: none; the next head's g and beta)
        wg::fence_proxy_async();   // T diag(beta)'s tiles and V visible to the wgmma
        sync();
        {   // T diag(beta)'s hi and lo tiles (the first 8 KiB of s.a and s.p) to the record, for the sequential
            // kernel's U product
            uint4* dst = reinterpret_cast<uint4*>(urec + UR::TB);
            constexpr int T16 = TILE64 / 16;
#pragma unroll 4
            for (int i = tid; i < 2 * T16; i += THREADS)
                dst[i] = i < T16 ? reinterpret_cast<const uint4*>(s.a)[i]
                                 : reinterpret_cast<const uint4*>(s.p)[i - T16];
        }
        sync();   // V and T diag(beta)'s tiles read out (every thread waited for its wgmma)
        if (!1 && j + 1 < j1) {   // the next value head's V rows, while this one's W is computed
            issue_v_sw128<DV>(qt, v, nv, ld_volatile(cu + b) + c0, num_v_heads, h + 1, tid);
            cp_async_commit();
        }
        t_cols_hilo<true>(X, s.a, s.p, [&](int c) { return s.beta[c] * (s.eg[c] * s.rk[c]); }, warp, lane);
        wg::fence_proxy_async();
        sync();
        // W = T diag(beta EK) k per 64-column half: A = the tiles' fragments of this warp's token rows, two k-steps
        // (16 registers) in flight at a time (all four with the accumulator and Q K^T's spilled the d128 build)
        unsigned ah[4][4], al[4][4];   // the tiles' A fragments of all four k-steps, once for both halves
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
                    *reinterpret_cast<unsigned*>(urec + UR::W + sw128_off(t, d >> 3) + (d & 7) * 2) =
                        1 ? pack(-acc[4 * nt + 2 * hh], -acc[4 * nt + 2 * hh + 1])   // -W
                                    : pack(acc[4 * nt + 2 * hh], acc[4 * nt + 2 * hh + 1]);
                }
        }
        sync();   // s.a, s.p, s.dinv, s.beta, ... read out before the next head rewrites them
    }
}

// grid (P), 384 threads (three groups), dynamic smem 3 x PrepSmem<DK> (GDN_WG_PREP_WG: 3 x wg_prep_group_bytes from
// the first 1024-byte boundary, which fits in it): one CTA fills an SM. Each group (128 threads, one item at a time)
// claims the next item of (chunk, stream, key head), chunk-major, from a counter in the workspace (an atomic per
// item, issued under the item's first copies), and releases the item's ready flag once its records are stored. The
// claims replaced a static walk (worker w: items w, w + 3P, ...): at 1 x 8192 (2048 items on 204 groups) its
// eleventh round held 8 items; the claims end within an item of each other (precompute alone 0.346 -> 0.316 ms,
// runs BI and BK; the flow form 0.358 -> 0.356, as it waits for the sequential kernel too). Tried and removed (runs
// BJ, BK): a second, co-resident grid of one group a CTA beside each sequential CTA (268 groups instead of 204),
// which slowed the sequential kernel sharing its SM: the flow form 0.356 -> 0.393 ms.
template <int DK, int DV>
__device__ __forceinline__ void gdn_prep_flow_body(const Q12Meta& m, const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                   const bf16* __restrict__ v, const float* __restrict__ g,
                                                   const float* __restrict__ beta,
                                                   int num_k_heads, int num_v_heads, unsigned char* __restrict__ ws) {
    using namespace gdnc;
    using UR = FlowRec<DK, DV>;
    pdl_launch_dependents();
    extern __shared__ __align__(128) unsigned char gdn_smem_raw[];
    if ((int)blockDim.x != 3 * 128) return;
    constexpr int groups = 3;
    constexpr bool WG = 1 && 1;
    static_assert(WG || !1 || !1, "1: the wgmma precompute's tiles (prep_item_wg)");
    static_assert(WG || !1, "1: the wgmma precompute's items (prep_item_wg)");
    static_assert(WG || !1 || !1, "1: the wgmma precompute's records (prep_item_wg)");
    const int grp = threadIdx.x >> 7, tid = threadIdx.x & 127;
    static_assert(3 * wg_prep_group_bytes<DK>() + 1024 <= 3 * (int)sizeof(PrepSmem<DK>),
                  "the wgmma groups fit in the host's 3 x PrepSmem");
    const unsigned raw = smem_u32(gdn_smem_raw), pad = ((raw + 1023u) & ~1023u) - raw;
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
    // the host's size (gdn_wgmma.prep_flow_smem_bytes): a shorter one would overlap the groups
    if ((WG ? pad + groups * wg_prep_group_bytes<DK>() : groups * (int)sizeof(PrepSmem<DK>)) > dyn) __trap();
    unsigned char* wbase = gdn_smem_raw + pad;
    PrepSmem<DK>& s = reinterpret_cast<PrepSmem<DK>*>(gdn_smem_raw)[grp];
    WgPrepSmem<DK>& sw = *reinterpret_cast<WgPrepSmem<DK>*>(wbase + grp * wg_prep_group_bytes<DK>());
    const int* cu = q12_cu_seqlens(m);
    // an item: (chunk, stream, key head), or (GDN_WG_FLOW_VH, the first GDN_WG_FLOW_VH_FIRST chunks) (chunk, stream,
    // value head)
    const int group = num_v_heads / num_k_heads, nch = ((int)m.chunk_len + GDN_C - 1) / GDN_C;
    const int vh_chunks = 1 ? min(nch, 8) : 0;
    const int per_vh_chunk = (int)m.batch_size * num_v_heads, per_chunk = (int)m.batch_size * num_k_heads;
    const int vh_items = vh_chunks * per_vh_chunk, items = vh_items + (nch - vh_chunks) * per_chunk;
    unsigned* counter = item_counter_at<UR::BYTES>(ws, m, num_k_heads, num_v_heads);
    auto next_item = [&]() -> int {   // (thread 0) this group's next item (items or more: none left)
        return (int)min(atomicAdd(counter, 1u), (unsigned)items);
    };
    // claimed[grp][i & 1]: item i's index, written by thread 0 before item i - 1's first barrier and read by
    // everyone after its last (the other slot is item i + 1's)
    __shared__ int claimed[3][2];
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
        if constexpr (WG) {
            prep_item_wg<DK, DV>(m, q, k, v, g, beta, num_k_heads, num_v_heads, ws, sw, b, kh, ci, len, tid, sync,
                                 claim, j0, j1);
        } else {
            claim();
            prep_item<DK, DV, true, 1>(m, q, k, g, beta, num_k_heads, num_v_heads, ws, s, b, kh, ci, len, tid,
                                                sync, v);
        }
        if (tid == 0) {   // the group's record stores are issued (the item's last barrier): publish them
            if (0) __threadfence();
            unsigned* flag = ready_flag_at<UR::BYTES>(ws, m, b, ci, kh, num_k_heads, num_v_heads);
            if (1)   // the key head's flag counts its value heads' items
                asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(flag), "r"(j1 - j0) : "memory");
            else asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flag), "r"(1u) : "memory");
        }
    }
}

}  // namespace gdnw

// Entry parameters: gdn_chunk.cu's split pair's. STAGES 2: __launch_bounds__(128, 1); STAGES 1: 2 CTAs/SM.
extern "C" __global__ void __launch_bounds__(128, 1) q12_gdn_wgmma_seq_d128(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    if (gridDim.x == 128 / GDN_BV) gdn_wg_seq_body<128, 128, 2>(m, h_state_ptrs, q, k, v, o, num_k_heads, num_v_heads, workspace);
}
extern "C" __global__ void __launch_bounds__(128, 2) q12_gdn_wgmma_seq1_d128(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    if (gridDim.x == 128 / GDN_BV) gdn_wg_seq_body<128, 128, 1>(m, h_state_ptrs, q, k, v, o, num_k_heads, num_v_heads, workspace);
}
extern "C" __global__ void __launch_bounds__(128, 1) q12_gdn_wgmma_seq_d64(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    if (gridDim.x == 64 / GDN_BV) gdn_wg_seq_body<64, 64, 2>(m, h_state_ptrs, q, k, v, o, num_k_heads, num_v_heads, workspace);
}
extern "C" __global__ void __launch_bounds__(128, 2) q12_gdn_wgmma_seq1_d64(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    if (gridDim.x == 64 / GDN_BV) gdn_wg_seq_body<64, 64, 1>(m, h_state_ptrs, q, k, v, o, num_k_heads, num_v_heads, workspace);
}

// The wide form (two warpgroups a CTA, both dv slices of a value head; d128 only): grid (1, Hv, n), 256 threads.
extern "C" __global__ void __launch_bounds__(256, 1) q12_gdn_wgmma_seqw_d128(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    if (gridDim.x == 128 / (2 * GDN_BV)) gdn_wg_seq_body<128, 128, 2, false, 2>(m, h_state_ptrs, q, k, v, o, num_k_heads, num_v_heads, workspace);
}

extern "C" __global__ void __launch_bounds__(384, 1) q12_gdn_wgmma_prep_flow_d128(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    gdnw::gdn_prep_flow_body<128, 128>(m, q, k, v, g, beta, num_k_heads, num_v_heads, workspace);
}
extern "C" __global__ void __launch_bounds__(384, 1) q12_gdn_wgmma_prep_flow_d64(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    gdnw::gdn_prep_flow_body<64, 64>(m, q, k, v, g, beta, num_k_heads, num_v_heads, workspace);
}
extern "C" __global__ void __launch_bounds__(128, 1) q12_gdn_wgmma_seq_flow_d128(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    if (gridDim.x == 128 / GDN_BV) gdn_wg_seq_body<128, 128, 2, true, 1, 1>(m, h_state_ptrs, q, k, v, o, num_k_heads, num_v_heads, workspace);
}
extern "C" __global__ void __launch_bounds__(128, 1) q12_gdn_wgmma_seq_flow_d64(Q12Meta m, const unsigned long long* __restrict__ h_state_ptrs, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta, bf16* __restrict__ o, int num_k_heads, int num_v_heads, unsigned char* __restrict__ workspace) {
    if (gridDim.x == 64 / GDN_BV) gdn_wg_seq_body<64, 64, 2, true, 1, 1>(m, h_state_ptrs, q, k, v, o, num_k_heads, num_v_heads, workspace);
}

// gdn_wgmma.py's stage_bytes(d) must give these numbers.
static_assert(gdnw::Stage<128>::BYTES == 69632 && gdnw::Stage<64>::BYTES == 53248 && gdnw::Stage<128, 2>::BYTES == 88064,
              "Stage size differs from q12drv.kernels.gdn_wgmma.stage_bytes");
static_assert(gdnw::Stage<128>::RAW == 68624 && gdnw::Stage<64>::RAW == 52240 && gdnw::Stage<128, 2>::RAW == 87056,
              "Stage extent differs from q12drv.kernels.gdn_wgmma._stage_raw (seq_smem_bytes)");
static_assert(gdnw::FlowRec<128, 128>::BYTES == 41488 && gdnw::FlowRec<64, 64>::BYTES == 33296,
              "UseqRec differs from q12drv.kernels.gdn_wgmma.flow_record_bytes(useq=True)");
static_assert(gdnw::Stage<128, 1, true>::BYTES == 92160 && gdnw::Stage<64, 1, true>::BYTES == 67584 &&
              gdnw::Stage<128, 1, true>::RAW == 92160 && gdnw::Stage<64, 1, true>::RAW == 67584,
              "the USEQ flow stage differs from q12drv.kernels.gdn_wgmma.stage_bytes(useq=True)");
static_assert(gdnc::UwsRec<128, 128>::BYTES == 57872 && gdnc::UwsRec<64, 64>::BYTES == 33296,
              "UwsRec size differs from q12drv.kernels.gdn_wgmma.flow_record_bytes");
static_assert(gdnc::UwsRec<128, 128>::P == 16384 && gdnc::UwsRec<128, 128>::EQ == 24576 &&
              gdnc::UwsRec<128, 128>::U == 25104 && gdnc::UwsRec<64, 64>::P == 8192 &&
              gdnc::UwsRec<64, 64>::EQ == 16384 && gdnc::UwsRec<64, 64>::U == 16912,
              "UwsRec offsets differ from q12drv.kernels.gdn_wgmma.flow_record_offsets");
