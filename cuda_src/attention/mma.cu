// attention/mma.cu: batched varlen paged causal prefill attention (FlashAttention-2 style, sm_90
// mma.sync). Entries q12_attn_prefill_d64 / _d128 / _d256, one per head dim, all ATTN_PARAMS.
//
// Semantics: stream b = blockIdx.z owns the packed rows cu[b] .. cu[b+1] of Q and O ([T, Hq, D] bf16);
// q_len = cu[b+1] - cu[b], kv_len = kv_lens[b]; row r (0-based in the stream's chunk) sees keys
// 0 .. kv_len - q_len + r (bottom-right causal), of them only those from kv_len - q_len + r - window_left on
// (the sliding window; window_left >= kv_len: none); kv_head = h / (Hq / Hkv). Keys and values are gathered
// from the paged pools ([num_blocks, block_size, Hkv, D] bf16) through the stream's block table;
// block_size is a power of two (the stager's rule: a key's page and row by shift and mask). Softmax of
// scale * q.k in fp32 (scale > 0: the row maximum is taken over the raw scores).
//
// CTA: kWarps warps computing attn_block_m(D) CTA rows of one stream; the tiles per head dim are
// attn_config(D). Without GQA packing a CTA row is a token of query head h = blockIdx.y; with it
// (gqa_pack) the CTA's rows are the (token, query head) pairs of kv head blockIdx.y: row r is token
// (m0 + r) / G, head kvh * G + (m0 + r) % G, G = Hq / Hkv, so one K/V tile serves G heads. blockIdx.x
// counts m-tiles from the last (heaviest) one. The CTA walks key tiles of BN keys from the tile holding
// the first key its first row sees (key 0 without a window: tiles wholly below every row's window are
// never loaded) up to the last key its rows may see: a two-stage cp.async ring with one __syncthreads
// per tile (tile n + 1 is issued right after the barrier that proves tile n - 1's stage free), the
// physical slot of each key row looked up by one thread two tiles ahead and kept in an int [2][BN] slot
// array in shared memory.
// Per tile, S = Q K^T and O += P V on mma.sync.m16n8k16 (bf16 in, fp32 accumulate), each K and V
// fragment feeding the warp's MW 16-row sub-tiles, and the online softmax in fp32 registers.
// warp_skip: a warp skips the math of key tiles above all its rows (it still copies and takes the
// barriers; such a tile would add exact zeros). dim_split: warp pairs share 16 * MW rows; in S warp
// half hw takes keys hw * BN/2 .. +BN/2, in P V head dims hw * D/2 .. +D/2, and the pair exchanges row
// maxima and P (bf16) through shared memory behind a named 64-thread barrier (two per tile) and the
// row sums at the end: each K and V fragment feeds two sub-tiles while a warp holds only D/2
// accumulator columns (MW 2 over all of D = 256 would need 256 accumulator registers).
// A CTA never spans two streams and computes each row with the same arithmetic in the same order
// whatever the batch, so batched and single-stream launches give bit-identical results.
//
// Shared memory (attn_smem_bytes(D), all dynamic): Q [BM][LD], K and V [kStages][BN][LD] each (LD = D +
// 8: rows padded by 16 bytes, which moves each of the 8 rows of an ldmatrix phase 4 banks on, so a
// phase hits 32 distinct banks), the slot array int [2][BN]; with dim_split per warp pair a P tile
// [32][BN + 8] bf16, then the pairs' row maxima / sums float [kWarps/2][2][32]. The epilogue stages O
// through the Q tile.
// ---------------------------------------------------------------------------------------------
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16 A/B and .f32 C/D), lane = 0..31,
// g = lane >> 2 (groupID), t = lane & 3 (threadID_in_group). Each .b32 A/B register holds two
// bf16, the lower-indexed element in the low 16 bits.
//   A (16x16, row-major), regs a0..a3:
//     a0: (row g,   cols 2t, 2t+1)      a1: (row g+8, cols 2t, 2t+1)
//     a2: (row g,   cols 2t+8, 2t+9)    a3: (row g+8, cols 2t+8, 2t+9)
//   B (16x8, "col": element (k, n)), regs b0, b1:
//     b0: (k 2t, 2t+1; n g)             b1: (k 2t+8, 2t+9; n g)
//   C/D (16x8 fp32), regs c0..c3:
//     c0, c1: (row g, cols 2t, 2t+1)    c2, c3: (row g+8, cols 2t, 2t+1)
// ldmatrix.m8n8.x4.b16: lanes 8i..8i+7 give the 8 row addresses (16 B each) of matrix i; the
// result register i of lane l holds matrix i's (row l>>2, cols 2(l&3), 2(l&3)+1). With .trans it
// holds (rows 2(l&3), 2(l&3)+1; col l>>2) instead, i.e. the transposed matrix's fragment.
//
// Q as A (S = Q K^T, k-step kk over head dims): smem sQ[row][d] row-major. Matrices
//   0: rows 0-7, d kk..+7 (a0)   1: rows 8-15, d kk..+7 (a1)
//   2: rows 0-7, d kk+8.. (a2)   3: rows 8-15, d kk+8.. (a3)
//   => lane l addresses row (l & 15), dim kk + (l >> 4) * 8.
// K as B (k = head dim, n = key): B(k=d, n=key) = K[key][d]; sK[key][d] row-major is B in "col"
//   layout, so plain ldmatrix: matrix with rows = 8 keys, cols = 8 dims gives lane l
//   (key l>>2 = g, dims 2t, 2t+1) = b0. One x4 covers 16 keys (two n-tiles) x 16 dims:
//   0: keys 0-7, d kk.. (b0 of n-tile 2j)     1: keys 0-7, d kk+8.. (b1 of n-tile 2j)
//   2: keys 8-15, d kk.. (b0 of n-tile 2j+1)  3: keys 8-15, d kk+8.. (b1 of n-tile 2j+1)
//   => lane l addresses key (l & 7) + ((l >> 4) << 3), dim kk + ((l >> 3) & 1) * 8.
// P as A (O += P V, k-step ks over 16 keys): the S accumulators of n-tiles 2ks and 2ks+1 are
//   already in A layout: a0 = S[2ks](c0,c1), a1 = S[2ks](c2,c3), a2 = S[2ks+1](c0,c1),
//   a3 = S[2ks+1](c2,c3), each packed to bf16x2 (first element low).
// V as B (k = key, n = head dim): B(k=key, n=d) = V[key][d]; sV[key][d] is B row-major, so
//   ldmatrix.trans: matrix with rows = 8 keys, cols = 8 dims gives lane l (keys 2t, 2t+1; dim g)
//   = b0. One x4.trans covers 16 keys x 16 dims (two n-tiles of O):
//   0: keys 0-7, d n0.. (b0 of 2d2)   1: keys 8-15, d n0.. (b1 of 2d2)
//   2: keys 0-7, d n0+8.. (b0 of 2d2+1)   3: keys 8-15, d n0+8.. (b1 of 2d2+1)
//   => lane l addresses key (l & 15), dim n0 + (l >> 4) * 8.
// O accumulators (C layout) per 8-dim n-tile: thread holds rows g, g+8 of its warp's 16 rows,
//   dims 2t, 2t+1. Row statistics (max, sum) are shared by the 4 lanes of a quad (xor 1, 2).
// ---------------------------------------------------------------------------------------------
#include "attention/common.cuh"
#include "common/mma_sync.cuh"

namespace {

using namespace attn;
using namespace mma_sync;

// Tiles of the entry for head dim D (64, 128 or 256).
struct AttnConfig {
    int block_n;        // BN: keys per K/V tile
    int warp_subtiles;  // MW: 16-row sub-tiles per warp
    bool gqa_pack;      // CTA rows are the (token, query head) pairs of one kv head
    bool warp_skip;     // a warp skips key tiles above all its rows
    bool dim_split;     // warp pairs share their rows, splitting S by keys and O by head dims
};
__host__ __device__ constexpr AttnConfig attn_config(int d) {
    // D 64: two CTAs fit an SM. D 128: BN 32 keeps MW 2 under 255 registers without spills. D 256:
    // dim_split, as MW 2 over the whole head dim would not fit the registers.
    return d == 64 ? AttnConfig{64, 1, false, false, false}
         : d == 128 ? AttnConfig{32, 2, true, true, false}
                    : AttnConfig{64, 2, true, true, true};
}
constexpr int kWarps = 8;  // every head dim
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 2;  // K/V stages of the cp.async ring
constexpr int kPad = 8;     // bf16 of padding per smem row
__host__ __device__ constexpr bool attn_head_dim(int d) { return d == 64 || d == 128 || d == 256; }
// CTA rows ((token, head) pairs with gqa_pack): warp pairs share theirs with dim_split.
__host__ __device__ constexpr int attn_block_m(int d) {
    return kWarps * attn_config(d).warp_subtiles * 16 / (attn_config(d).dim_split ? 2 : 1);
}
// Dynamic shared memory of one CTA (the layout in the header).
__host__ __device__ constexpr int attn_smem_bytes(int d) {
    return (attn_block_m(d) + 2 * kStages * attn_config(d).block_n) * (d + kPad) * 2 + 2 * attn_config(d).block_n * 4 +
           (attn_config(d).dim_split ? (kWarps / 2) * (32 * (attn_config(d).block_n + kPad) * 2 + 2 * 32 * 4) : 0);
}

// The host's launch numbers (q12drv.kernels.attention.CONTRACTS) must be the source's.
#if !defined(Q12_ATTN_D64_THREADS) || !defined(Q12_ATTN_D64_BLOCK_M) || !defined(Q12_ATTN_D64_GQA) ||    \
    !defined(Q12_ATTN_D64_SMEM) || !defined(Q12_ATTN_D128_THREADS) || !defined(Q12_ATTN_D128_BLOCK_M) || \
    !defined(Q12_ATTN_D128_GQA) || !defined(Q12_ATTN_D128_SMEM) || !defined(Q12_ATTN_D256_THREADS) ||    \
    !defined(Q12_ATTN_D256_BLOCK_M) || !defined(Q12_ATTN_D256_GQA) || !defined(Q12_ATTN_D256_SMEM)
#error "compile through q12drv (registry.compile_defines): it passes the host's tiles (-DQ12_ATTN_D<d>_*)"
#endif
#define ATTN_CONTRACT(D)                                                                                   \
    static_assert(Q12_ATTN_D##D##_THREADS == kThreads, "D" #D ": threads per CTA differ from the host's");    \
    static_assert(Q12_ATTN_D##D##_BLOCK_M == attn_block_m(D), "D" #D ": CTA rows differ from the host's");   \
    static_assert(Q12_ATTN_D##D##_GQA == attn_config(D).gqa_pack, "D" #D ": GQA packing differs from the host's"); \
    static_assert(Q12_ATTN_D##D##_SMEM == attn_smem_bytes(D), "D" #D ": shared memory differs from the host's");
ATTN_CONTRACT(64)
ATTN_CONTRACT(128)
ATTN_CONTRACT(256)
#undef ATTN_CONTRACT

// Named barrier of the 64 threads of one warp pair (id 1..8; __syncthreads uses 0).
__device__ __forceinline__ void pair_sync(int id) {
    asm volatile("bar.sync %0, 64;\n" ::"r"(id) : "memory");
}

template <int D>
__device__ __forceinline__ void attn_prefill(const Q12Meta& m, const bf16* q, const bf16* k_pool,
                                             const bf16* v_pool, bf16* o, int num_q_heads,
                                             int num_kv_heads, int block_size, float scale, int window_left) {
    static_assert(attn_head_dim(D), "head dims 64, 128 and 256");
    constexpr AttnConfig C = attn_config(D);
    constexpr int BN = C.block_n;
    constexpr int MW = C.warp_subtiles;
    constexpr bool GQA = C.gqa_pack;
    constexpr bool WSKIP = C.warp_skip;
    constexpr bool DS = C.dim_split;
    constexpr int kWR = MW * 16;            // query rows per warp: MW sub-tiles of 16
    constexpr int kBM = attn_block_m(D);    // query rows per CTA
    constexpr int LD = D + kPad;            // smem row stride (elements)
    constexpr int CPR = D / 8;              // 16-byte chunks per row
    constexpr int KD = D / 16;              // k-steps of S = Q K^T
    constexpr int NS = BN / 8;              // 8-key n-tiles of S
    constexpr int KN = BN / 16;             // 16-key k-steps of O += P V
    constexpr int ND = D / 8;               // 8-dim n-tiles of O
    constexpr int NSW = DS ? NS / 2 : NS;   // n-tiles of S this warp computes
    constexpr int NDW = DS ? ND / 2 : ND;   // n-tiles of O this warp accumulates
    constexpr int PLD = BN + kPad;          // DS: row stride of the P exchange tile (elements)
    constexpr int RPT = BN * CPR / kThreads;  // K/V rows each thread copies per tile
    constexpr int QPT = kBM * CPR / kThreads; // Q rows each thread copies
    static_assert(kThreads % CPR == 0 && RPT * kThreads == BN * CPR && QPT * kThreads == kBM * CPR, "copy split");
    static_assert(BN % 16 == 0 && D % 16 == 0, "tile shape");
    static_assert(BN <= kThreads, "one thread per key row fills the slot array");
    static_assert(!DS || (MW == 2 && kWarps % 2 == 0 && BN % 32 == 0), "DS: warp pairs of 32 rows, BN % 32 == 0");

    const int b = blockIdx.z;
    if (b >= static_cast<int>(m.batch_size)) return;
    const int h = blockIdx.y;  // query head, or kv head with GQA packing
    if (h >= (GQA ? num_kv_heads : num_q_heads)) return;
    const int grp = num_q_heads / num_kv_heads;
    const int G = GQA ? grp : 1;  // CTA rows per token
    // Heaviest tiles (most keys) first: blockIdx.x = 0 takes the last m-tile.
    const int mt = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
    const int* cu = q12_cu_seqlens(m);
    const int row0 = cu[b];
    const int q_len = cu[b + 1] - row0;
    const int m0 = mt * kBM;  // first CTA row (a (token, head) pair index with GQA)
    if (m0 >= q_len * G) return;
    const int kv_len = q12_kv_lens(m)[b];
    const int* bt = q12_block_table(m, b);
    const int kvh = GQA ? h : h / grp;
    const int rows_here = min(kBM, q_len * G - m0);
    const int shift = kv_len - q_len;                   // token r sees keys <= shift + r
    const int max_key = shift + (GQA ? (m0 + rows_here - 1) / G : m0 + rows_here - 1);  // last key any row sees
    const int diag_from = shift + (GQA ? m0 / G : m0);  // smallest causal bound over the CTA's rows
    const int n_tiles = max_key >= 0 ? max_key / BN + 1 : 0;  // key tile n holds keys n * BN ..
    // The CTA walks tiles n0 .. n_tiles - 1: n0 is the tile of the first key its first row sees (its causal
    // bound - window_left, written so that it cannot overflow; 0 without a window). Tile n keeps stage
    // n % kStages and slot-array half n & 1 whatever n0 is, so the loop is the full-causal one (unsigned,
    // so the compiler knows n >= 0 and keeps the loop's % and / unsigned).
    const int n0 = static_cast<int>(static_cast<unsigned>(max(diag_from, window_left) - window_left) / BN);

    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
    const unsigned int sQa = smem_addr(sQ);
    const unsigned int sKa = sQa + kBM * LD * 2;           // [kStages][BN][LD]
    const unsigned int sVa = sKa + kStages * BN * LD * 2;  // [kStages][BN][LD]
    int* sSlot = reinterpret_cast<int*>(smem_raw + (kBM + 2 * kStages * BN) * LD * 2);  // [2][BN]
    // DS: per pair a P tile [32][PLD] bf16, then row maxima / sums float [kWarps/2][2 halves][32 rows].
    const unsigned int sPa = smem_addr(smem_raw) + (kBM + 2 * kStages * BN) * LD * 2 + 2 * BN * 4;
    float* sRed = reinterpret_cast<float*>(smem_raw + (kBM + 2 * kStages * BN) * LD * 2 + 2 * BN * 4 +
                                           (DS ? (kWarps / 2) * 32 * PLD * 2 : 0));

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int wq = DS ? warp >> 1 : warp;  // row group of this warp (its pair with DS)
    const int hw = DS ? warp & 1 : 0;      // DS: key half in S, dim half in O
    const int cr = tid / CPR;  // first row this thread copies
    const int cc = tid % CPR;  // its 16-byte chunk within a row
    constexpr int kRowStep = kThreads / CPR;

    const long long head_stride = static_cast<long long>(num_kv_heads) * D;
    // block_size is a power of two (the stager refuses anything else): a key's page and row by shift
    // and mask, not an integer division per row and tile
    const int bs_shift = __ffs(block_size) - 1;
    const int bs_mask = block_size - 1;

    // Global row (token * Hq + head) of CTA row r (< rows_here).
    auto q_row = [&](int r) -> long long {
        if constexpr (GQA) {
            const int p = m0 + r;
            return static_cast<long long>(row0 + p / G) * num_q_heads + kvh * G + p % G;
        }
        return static_cast<long long>(row0 + m0 + r) * num_q_heads + h;
    };

    // Q tile: rows past the stream's chunk are zero-filled and never read from global memory.
    if constexpr (GQA) {
#pragma unroll
        for (int i = 0; i < QPT; ++i) {
            const int r = cr + i * kRowStep;
            const bool ok = r < rows_here;
            const bf16* src = ok ? q + q_row(r) * D + cc * 8 : q;
            cp_async16(sQa + (r * LD + cc * 8) * 2, src, ok ? 16 : 0);
        }
    } else {
        const bf16* qbase = q + (static_cast<long long>(row0 + m0) * num_q_heads + h) * D + cc * 8;
#pragma unroll
        for (int i = 0; i < QPT; ++i) {
            const int r = cr + i * kRowStep;
            const bool ok = r < rows_here;
            const bf16* src = ok ? qbase + static_cast<long long>(r) * num_q_heads * D : q;
            cp_async16(sQa + (r * LD + cc * 8) * 2, src, ok ? 16 : 0);
        }
    }

    // Pool slot (physical block * block_size + offset) of key position pos, -1 past max_key.
    // DS: reload the block-table pointer (an L1 hit) instead of keeping it live across the loop,
    // where this 64-bit pointer was the one value NVRTC 13.0 spilled (8 bytes) in the D256 DS build.
    auto slot_of = [&](int pos) -> int {
        if constexpr (DS) {
            const int* btr = q12_block_table(m, b);
            return pos <= max_key ? (btr[pos >> bs_shift] << bs_shift) + (pos & bs_mask) : -1;
        } else {
            return pos <= max_key ? (bt[pos >> bs_shift] << bs_shift) + (pos & bs_mask) : -1;
        }
    };
    auto copy_row = [&](int slot, int r, int stage) {
        const bool ok = slot >= 0;
        long long off = 0;
        if (ok) off = static_cast<long long>(slot) * head_stride + static_cast<long long>(kvh) * D + cc * 8;
        const unsigned int dst = ((stage * BN + r) * LD + cc * 8) * 2;
        cp_async16(sKa + dst, k_pool + off, ok ? 16 : 0);
        cp_async16(sVa + dst, v_pool + off, ok ? 16 : 0);
    };
    // K and V of tile n into `stage`, their slots from the [2][BN] array (written by the threads
    // tid < BN beforehand).
    auto issue_kv = [&](int n, int stage) {
        const int* sl = sSlot + (n & 1) * BN;
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int r = cr + i * kRowStep;
            copy_row(sl[r], r, stage);
        }
    };
    int pend_slot = -1;  // slot of row tid of the tile two issues ahead (loaded, not yet stored)

    // Tiles n0 .. n0+kStages-2 now, one commit group each (possibly empty; Q rides in the first).
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (n0 + s < n_tiles) {
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const int r = cr + i * kRowStep;
                copy_row(slot_of((n0 + s) * BN + r), r, (n0 + s) % kStages);
            }
        }
        cp_async_commit();
    }
    // Tile n0+kStages-1 (issued in iteration n0) into the slot array; tile n0+kStages pending in a register.
    if (tid < BN) {
        sSlot[((n0 + kStages - 1) & 1) * BN + tid] = slot_of((n0 + kStages - 1) * BN + tid);
        pend_slot = slot_of((n0 + kStages) * BN + tid);
    }

    const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units: exp(s*scale) = 2^(s*sl2)
    const int wrow = m0 + wq * kWR;                // CTA-row index (stream row without GQA) of this warp's first row
    // Largest causal bound over this warp's valid rows (WSKIP); rows past rows_here see everything
    // the CTA loads and are discarded, so they need no tile.
    const int warp_last = min(wrow + kWR, m0 + rows_here) - 1;
    const int warp_bound = shift + (GQA ? warp_last / G : warp_last);

    // Sub-tile mi of the warp = its rows mi*16 .. mi*16+15; thread rows g and g+8 of each (i = 0, 1).
    float acc[MW][NDW][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi)
#pragma unroll
        for (int j = 0; j < NDW; ++j) acc[mi][j][0] = acc[mi][j][1] = acc[mi][j][2] = acc[mi][j][3] = 0.f;
    float row_max[MW][2];
    float row_sum[MW][2];  // per-thread partial sums, reduced over the quad at the end
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
        row_max[mi][0] = row_max[mi][1] = -ATTN_INF;
        row_sum[mi][0] = row_sum[mi][1] = 0.f;
    }

    const unsigned int q_lane = sQa + ((wq * kWR + (lane & 15)) * LD + (lane >> 4) * 8) * 2;
    const unsigned int k_lane = ((((lane & 7) + ((lane >> 4) << 3)) * LD) + ((lane >> 3) & 1) * 8) * 2;
    const unsigned int v_lane = (((lane & 15) * LD) + (lane >> 4) * 8) * 2;

    for (int n = n0; n < n_tiles; ++n) {
        const int stage = n % kStages;
        cp_async_wait<kStages - 2>();  // the groups of tiles n0..n complete
        __syncthreads();  // ... for every thread; and every warp is done with tile n-1's stage
        const int nn = n + kStages - 1;
        if (nn < n_tiles) issue_kv(nn, nn % kStages);
        cp_async_commit();  // one group per iteration, possibly empty
        // slot array half (nn + 1) & 1 was last read in iteration n - 1 (before the barrier)
        if (tid < BN) {
            sSlot[((nn + 1) & 1) * BN + tid] = pend_slot;
            pend_slot = slot_of((nn + 2) * BN + tid);
        }

        const int kb = n * BN;
        if (!WSKIP || kb <= warp_bound) {

        // ---- S = Q K^T (MW x 16 rows x BN keys per warp); each K fragment feeds MW sub-tiles ----
        float s[MW][NSW][4];
#pragma unroll
        for (int mi = 0; mi < MW; ++mi)
#pragma unroll
            for (int j = 0; j < NSW; ++j) s[mi][j][0] = s[mi][j][1] = s[mi][j][2] = s[mi][j][3] = 0.f;
        const unsigned int kst = sKa + (stage * BN + hw * (BN / 2)) * LD * 2 + k_lane;
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            unsigned int a[MW][4];
#pragma unroll
            for (int mi = 0; mi < MW; ++mi) ldmatrix_x4(a[mi], q_lane + (mi * 16 * LD + kk * 16) * 2);
#pragma unroll
            for (int j2 = 0; j2 < NSW / 2; ++j2) {
                unsigned int bk[4];
                ldmatrix_x4(bk, kst + (j2 * 16 * LD + kk * 16) * 2);
#pragma unroll
                for (int mi = 0; mi < MW; ++mi) {
                    mma_bf16(s[mi][2 * j2], a[mi], bk[0], bk[1]);
                    mma_bf16(s[mi][2 * j2 + 1], a[mi], bk[2], bk[3]);
                }
            }
        }

        // ---- masks (raw scores; the scale is folded in below): -inf past a row's causal bound (its last key),
        // or with `left` below its window (bound - window_left) ----
        auto mask = [&](bool left) {
#pragma unroll
            for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
                for (int j = 0; j < NSW; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = kb + hw * (BN / 2) + j * 8 + 2 * t + (e & 1);
                        const int rr = wrow + mi * 16 + g + (e >> 1) * 8;
                        const int bound = shift + (GQA ? rr / G : rr);
                        if (left ? key < bound - window_left : key > bound) s[mi][j][e] = -ATTN_INF;
                    }
                }
            }
        };
        if (kb + BN - 1 > diag_from) mask(false);  // causal, on diagonal tiles only
        // the window, on the tiles below the last row's first key only; never without one (max_key - INT_MAX <= 0)
        if (kb < max_key - window_left) mask(true);

        // ---- online softmax (row g + 8i of sub-tile mi; element e belongs to i = e >> 1) ----
        // Max over raw scores (scale > 0), kept in log2 units: row_max = max(s) * sl2, and
        // p = 2^(s * sl2 - row_max) = exp(scale * (s - max s)).
        float tmax[MW][2];
#pragma unroll
        for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float mx = -ATTN_INF;
#pragma unroll
                for (int j = 0; j < NSW; ++j) mx = fmaxf(mx, fmaxf(s[mi][j][2 * i], s[mi][j][2 * i + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                tmax[mi][i] = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            }
        }
        if constexpr (DS) {  // the pair's max over both key halves (the partner read the last one before the P barrier)
            if (t == 0) {
#pragma unroll
                for (int mi = 0; mi < MW; ++mi)
#pragma unroll
                    for (int i = 0; i < 2; ++i) sRed[(wq * 2 + hw) * 32 + mi * 16 + g + 8 * i] = tmax[mi][i];
            }
            pair_sync(1 + wq);
#pragma unroll
            for (int mi = 0; mi < MW; ++mi)
#pragma unroll
                for (int i = 0; i < 2; ++i)
                    tmax[mi][i] = fmaxf(tmax[mi][i], sRed[(wq * 2 + (hw ^ 1)) * 32 + mi * 16 + g + 8 * i]);
        }
#pragma unroll
        for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float mx = tmax[mi][i];
                const float mnew = fmaxf(row_max[mi][i], mx * sl2);
                const float muse = mnew == -ATTN_INF ? 0.f : mnew;  // all masked so far: avoid inf - inf
                const float alpha = exp2_ftz(row_max[mi][i] - muse);
                row_max[mi][i] = mnew;
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < NSW; ++j) {
                    s[mi][j][2 * i] = exp2_ftz(fmaf(s[mi][j][2 * i], sl2, -muse));
                    s[mi][j][2 * i + 1] = exp2_ftz(fmaf(s[mi][j][2 * i + 1], sl2, -muse));
                    sum += s[mi][j][2 * i] + s[mi][j][2 * i + 1];
                }
                row_sum[mi][i] = row_sum[mi][i] * alpha + sum;
#pragma unroll
                for (int d = 0; d < NDW; ++d) {
                    acc[mi][d][2 * i] *= alpha;
                    acc[mi][d][2 * i + 1] *= alpha;
                }
            }
        }

        // ---- O += P V; each V fragment feeds MW sub-tiles ----
        const unsigned int vst = sVa + stage * BN * LD * 2 + hw * (D / 2) * 2 + v_lane;
        if constexpr (DS) {  // P of this key half -> the pair's tile; both halves back as A fragments
            unsigned int* sP = reinterpret_cast<unsigned int*>(smem_raw + (sPa - smem_addr(smem_raw)));
#pragma unroll
            for (int mi = 0; mi < MW; ++mi)
#pragma unroll
                for (int j = 0; j < NSW; ++j) {
                    const int r = wq * 32 + mi * 16 + g;
                    const int col = hw * (BN / 2) + j * 8 + 2 * t;
                    sP[(r * PLD + col) / 2] = pack_bf16x2(s[mi][j][0], s[mi][j][1]);
                    sP[((r + 8) * PLD + col) / 2] = pack_bf16x2(s[mi][j][2], s[mi][j][3]);
                }
            pair_sync(1 + wq);
        }
#pragma unroll
        for (int ks = 0; ks < KN; ++ks) {
            unsigned int a[MW][4];
#pragma unroll
            for (int mi = 0; mi < MW; ++mi) {
                if constexpr (DS) {
                    ldmatrix_x4(a[mi], sPa + ((wq * 32 + mi * 16 + (lane & 15)) * PLD + ks * 16 + (lane >> 4) * 8) * 2);
                } else {
                    a[mi][0] = pack_bf16x2(s[mi][2 * ks][0], s[mi][2 * ks][1]);
                    a[mi][1] = pack_bf16x2(s[mi][2 * ks][2], s[mi][2 * ks][3]);
                    a[mi][2] = pack_bf16x2(s[mi][2 * ks + 1][0], s[mi][2 * ks + 1][1]);
                    a[mi][3] = pack_bf16x2(s[mi][2 * ks + 1][2], s[mi][2 * ks + 1][3]);
                }
            }
#pragma unroll
            for (int d2 = 0; d2 < NDW / 2; ++d2) {
                unsigned int bv[4];
                ldmatrix_x4_trans(bv, vst + (ks * 16 * LD + d2 * 16) * 2);
#pragma unroll
                for (int mi = 0; mi < MW; ++mi) {
                    mma_bf16(acc[mi][2 * d2], a[mi], bv[0], bv[1]);
                    mma_bf16(acc[mi][2 * d2 + 1], a[mi], bv[2], bv[3]);
                }
            }
        }
        }  // !WSKIP || tile reaches this warp's rows
    }
    cp_async_wait<0>();  // no key tile (n0 >= n_tiles): the Q copy may still be in flight
    __syncthreads();
    float lsum[MW][2];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float l = row_sum[mi][i];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            lsum[mi][i] = l + __shfl_xor_sync(0xffffffffu, l, 2);
        }
    if constexpr (DS) {  // add the partner's sum over the other key half (a + b == b + a: same in both)
        if (t == 0) {
#pragma unroll
            for (int mi = 0; mi < MW; ++mi)
#pragma unroll
                for (int i = 0; i < 2; ++i) sRed[(wq * 2 + hw) * 32 + mi * 16 + g + 8 * i] = lsum[mi][i];
        }
        __syncthreads();
#pragma unroll
        for (int mi = 0; mi < MW; ++mi)
#pragma unroll
            for (int i = 0; i < 2; ++i) lsum[mi][i] += sRed[(wq * 2 + (hw ^ 1)) * 32 + mi * 16 + g + 8 * i];
    }

    // ---- epilogue: O / l -> bf16 into this warp's own Q rows of smem, then 16-B stores ----
    unsigned int* sO = reinterpret_cast<unsigned int*>(sQ);
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
        float inv[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) inv[i] = lsum[mi][i] > 0.f ? 1.f / lsum[mi][i] : 0.f;
        const int r_lo = wq * kWR + mi * 16 + g;
#pragma unroll
        for (int d = 0; d < NDW; ++d) {
            const int col = hw * (D / 2) + d * 8 + 2 * t;
            sO[(r_lo * LD + col) / 2] = pack_bf16x2(acc[mi][d][0] * inv[0], acc[mi][d][1] * inv[0]);
            sO[((r_lo + 8) * LD + col) / 2] = pack_bf16x2(acc[mi][d][2] * inv[1], acc[mi][d][3] * inv[1]);
        }
    }
    __syncwarp();
    constexpr int CPW = DS ? CPR / 2 : CPR;  // 16-byte chunks of a row this warp wrote (its dim half)
    if constexpr (GQA) {
#pragma unroll
        for (int c = lane; c < kWR * CPW; c += 32) {
            const int r = c / CPW;
            const int ch = hw * CPW + c % CPW;
            const int cr_ = wq * kWR + r;  // CTA row
            if (cr_ < rows_here) {
                const uint4 v = *reinterpret_cast<const uint4*>(sQ + cr_ * LD + ch * 8);
                *reinterpret_cast<uint4*>(o + q_row(cr_) * D + ch * 8) = v;
            }
        }
    } else {
        bf16* obase = o + (static_cast<long long>(row0 + wrow) * num_q_heads + h) * D;
#pragma unroll
        for (int c = lane; c < kWR * CPW; c += 32) {
            const int r = c / CPW;
            const int ch = hw * CPW + c % CPW;
            if (wrow + r < q_len) {
                const uint4 v = *reinterpret_cast<const uint4*>(sQ + (wq * kWR + r) * LD + ch * 8);
                *reinterpret_cast<uint4*>(obase + static_cast<long long>(r) * num_q_heads * D + ch * 8) = v;
            }
        }
    }
}

}  // namespace

extern "C" __global__ void q12_attn_prefill_d64(ATTN_PARAMS) { attn_prefill<64>(ATTN_ARGS); }
extern "C" __global__ void q12_attn_prefill_d128(ATTN_PARAMS) { attn_prefill<128>(ATTN_ARGS); }
extern "C" __global__ void q12_attn_prefill_d256(ATTN_PARAMS) { attn_prefill<256>(ATTN_ARGS); }
