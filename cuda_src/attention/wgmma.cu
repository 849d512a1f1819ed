// attention/wgmma.cu: batched varlen paged causal prefill attention on Hopper's warpgroup MMA (wgmma,
// compiled for sm_90a), warp-specialized (FlashAttention-3 style). Entries q12_attn_wgmma_d128 / _d256,
// ATTN_PARAMS. Same semantics and batched == alone guarantee as attention/mma.cu (see its header):
// stream b = blockIdx.z, bottom-right causal over kv_lens[b] with the optional sliding window (window_left),
// keys and values gathered through the stream's block table (block_size a power of two), GQA kv_head = h /
// (Hq / Hkv). The key tiles start at the tile of the first key the CTA's first row sees (key 0 without a
// window).
//
// CTA: kConsumers consumer warpgroups of 64 rows each (BM = 64 * kConsumers) and one producer
// warpgroup (the last), kCtaThreads threads. Rows are (token, head) pairs of one kv head (blockIdx.y):
// CTA row r is token (m0 + r) / G, query head kvh * G + (m0 + r) % G, G = Hq / Hkv, so one K/V tile
// serves the G query heads that read it; consumer warpgroup w owns rows 64w .. 64w + 63. blockIdx.x
// counts m-tiles from the last (heaviest) one. The tiles per head dim are attn_wg_config(D).
//
// The producer does every copy (cp.async): Q once, announced on its own mbarrier (which the consumers
// wait on even when they have no key tile), then K/V tile n into stage n % kStages, announced by one
// cp.async.mbarrier.arrive.noinc per producer thread on the stage's "full" barrier (count 128); it
// refills a stage once its "empty" barrier (count 128 * kConsumers, every consumer thread arrives)
// says the stage's previous tile was consumed. Its address arithmetic is lean because it shares the
// SM's issue slots with the consumers: a key's page and row by shift and mask, a row's source pointer
// computed once, its 16-byte chunks at immediate offsets of the copy instruction. setmaxnreg moves
// registers from the producer (40) to the consumers (232). There is no CTA-wide barrier after the
// role split: the consumers' epilogue syncs on named barrier 1. Per key tile of BN keys a consumer
// warpgroup waits for the stage's full barrier and computes
//   S[64 x BN] = Q K^T: D/16 wgmma (A = Q, B = K, both K-major from shared memory);
//   the causal mask (and the window's left bound on the tiles below some row's first key) and the
//   online softmax in fp32 registers (exp2 with the scale folded in);
//   O[64 x D] += P V: BN/16 wgmma, A = P from registers (bf16), B = V (MN-major) from shared memory;
// then arrives on the stage's empty barrier. The consumer warpgroups drift up to a tile apart, so one's
// GEMMs overlap the other's softmax.
//
// Shared memory (attn_wg_smem_bytes(D), all dynamic): Q [BM x D] and kStages stages of K and of V
// [BN x D], each tile in the 128-byte swizzled layout of wgmma.cuh, [D/64][rows][128 B] with 16-byte
// chunk j of row r at j ^ (r & 7), on 1024-byte boundaries (the launch adds 1 KiB of slack to align the
// start); then the full[kStages], empty[kStages] and Q mbarriers (8 bytes each). Copies: each warp
// instruction reads 64 contiguous bytes of 8 key rows; a quarter-warp writes 8 rows of one chunk, which
// the swizzle spreads over all 32 banks. The output goes through the K/V stages (row-major, rows padded
// by 16 bytes) to 16-byte global stores.
//
// Numerics: as attention/mma.cu (P rounded to bf16 before P V, ex2.approx.ftz); the wgmma sums may
// round in a different order than mma.sync, so the two kernels agree to bf16 rounding, not bit for bit.
#include "attention/common.cuh"
#include "common/wgmma.cuh"

namespace {

using namespace attn;
using wg::mbar_arrive;
using wg::mbar_arrive_on_copies;
using wg::mbar_init;
using wg::mbar_wait;

// Tiles of the entry for head dim D (128 or 256).
struct AttnWgConfig {
    int block_n;  // BN: keys per K/V tile
};
__host__ __device__ constexpr AttnWgConfig attn_wg_config(int d) {
    // D 256 takes BN 64: Q and two stages of K and V at BN 128 would need 320 KiB of shared memory.
    return d == 128 ? AttnWgConfig{128} : AttnWgConfig{64};
}
constexpr int kConsumers = 2;                       // consumer warpgroups (64 rows each), every head dim
constexpr int kCtaThreads = 128 * (kConsumers + 1);  // and the producer warpgroup
constexpr int kStages = 2;                          // K/V stages
constexpr int kSmemLimit = 227 * 1024;              // dynamic shared memory a CTA may take on sm_90
__host__ __device__ constexpr bool attn_wg_head_dim(int d) { return d == 128 || d == 256; }
__host__ __device__ constexpr int attn_wg_block_m(int) { return 64 * kConsumers; }
// Dynamic shared memory of one CTA: Q, kStages stages of K and V, 2 kStages + 1 mbarriers, and 1 KiB to
// align the swizzled tiles to 1024 bytes.
__host__ __device__ constexpr int attn_wg_smem_bytes(int d) {
    return (attn_wg_block_m(d) + 2 * kStages * attn_wg_config(d).block_n) * d * 2 + 8 * (2 * kStages + 1) + 1024;
}

// The host's launch numbers (q12drv.kernels.attention_wgmma.CONTRACTS) must be the source's.
#if !defined(Q12_ATTN_WG_D128_THREADS) || !defined(Q12_ATTN_WG_D128_BLOCK_M) || !defined(Q12_ATTN_WG_D128_SMEM) || \
    !defined(Q12_ATTN_WG_D256_THREADS) || !defined(Q12_ATTN_WG_D256_BLOCK_M) || !defined(Q12_ATTN_WG_D256_SMEM)
#error "compile through q12drv (registry.compile_defines): it passes the host's tiles (-DQ12_ATTN_WG_D<d>_*)"
#endif
#define ATTN_WG_CONTRACT(D)                                                                                   \
    static_assert(Q12_ATTN_WG_D##D##_THREADS == kCtaThreads, "D" #D ": threads per CTA differ from the host's"); \
    static_assert(Q12_ATTN_WG_D##D##_BLOCK_M == attn_wg_block_m(D), "D" #D ": CTA rows differ from the host's"); \
    static_assert(Q12_ATTN_WG_D##D##_SMEM == attn_wg_smem_bytes(D), "D" #D ": shared memory differs from the host's"); \
    static_assert(attn_wg_smem_bytes(D) <= kSmemLimit, "D" #D ": more shared memory than an SM has");
ATTN_WG_CONTRACT(128)
ATTN_WG_CONTRACT(256)
#undef ATTN_WG_CONTRACT

// Named barrier `id` over `n` threads (bar.sync). Id 0 is __syncthreads(); 1 is the consumer
// warpgroups' epilogue.
template <int ID, int N>
__device__ __forceinline__ void named_sync() {
    asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "n"(N) : "memory");
}
// Per-thread register budget of the calling warpgroup (every warp of the warpgroup executes it).
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

// Which (row, 16-byte chunk) pairs a thread copies of a [ROWS x CPR chunks] tile when NW warps share
// the copy: warp w takes blocks of 8 rows x 4 chunks, block b = w + NW * i (i < PT); in a block lane
// l copies row l & 7, chunk l >> 3. Each copy instruction of a warp then reads 64 contiguous bytes of 8
// rows (whole 32-byte sectors) and each quarter-warp writes 8 rows of one chunk: 8 different bank
// groups in the swizzled layout (tile_off), no bank conflicts. A thread touches NR distinct rows (one
// page lookup each); copy i is in row slot slot(i).
template <int ROWS, int CPR, int NW>
struct CopyMap {
    static constexpr int RB = ROWS / 8, CB = CPR / 4;
    static constexpr int PT = RB * CB / NW;
    static constexpr int NR = RB % NW == 0 ? RB / NW : 1;
    static_assert(ROWS % 8 == 0 && CPR % 4 == 0 && PT * NW == RB * CB && (RB % NW == 0 || NW % RB == 0),
                  "copy map: 8 x 4 blocks shared evenly by the warps");
    __device__ static int slot(int i) { return NR > 1 ? i % NR : 0; }
    __device__ static int row(int w, int lane, int j) { return 8 * (RB % NW == 0 ? w + NW * j : w % RB) + (lane & 7); }
    __device__ static int chunk(int w, int lane, int i) {
        return 4 * (RB % NW == 0 ? i / NR : w / RB + (NW / RB) * i) + (lane >> 3);
    }
};

// Byte offset of row r's 16-byte chunk cg (elements 8cg .. 8cg+7) in a [ROWS x D] bf16 operand tile in
// the 128-byte swizzle: [D/64][ROWS][128 B] with chunk cg % 8 of row r at position (cg % 8) ^ (r & 7)
// (the tile starts on a 1024-byte boundary).
template <int ROWS>
__device__ __forceinline__ unsigned tile_off(int r, int cg) {
    return (cg >> 3) * (ROWS * 128) + r * 128 + (((cg & 7) ^ (r & 7)) << 4);
}

template <int D>
__device__ __forceinline__ void attn_wgmma(const Q12Meta& m, const bf16* q, const bf16* k_pool, const bf16* v_pool,
                                           bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale,
                                           int window_left) {
    static_assert(attn_wg_head_dim(D), "head dims 128 and 256");
    constexpr int BN = attn_wg_config(D).block_n;
    constexpr int kThreads = kConsumers * 128;  // computing threads (the consumer warpgroups)
    constexpr int kBM = attn_wg_block_m(D);     // CTA rows ((token, head) pairs)
    constexpr int CPR = D / 8;                  // 16-byte chunks per row
    constexpr int KD = D / 16;                  // k-steps of S = Q K^T
    constexpr int KN = BN / 16;                 // k-steps of O += P V
    constexpr int NS = BN / 8;                  // 8-key tiles of S
    constexpr int ND = D / 8;                   // 8-dim tiles of O
    using KVMap = CopyMap<BN, CPR, 4>;          // the producer warpgroup's 4 warps copy
    using QMap = CopyMap<kBM, CPR, 4>;
    constexpr unsigned kQBytes = kBM * D * 2;
    constexpr unsigned kTileBytes = BN * D * 2;  // one stage of K (or V)
    constexpr int OLD = D + 8;                   // epilogue row stride (elements)
    static_assert(kBM * OLD * 2 <= 2 * kStages * kTileBytes, "the output tile must fit the K/V stages");

    const int b = blockIdx.z;
    if (b >= static_cast<int>(m.batch_size)) return;
    const int kvh = blockIdx.y;
    if (kvh >= num_kv_heads) return;
    const int G = num_q_heads / num_kv_heads;
    const int mt = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);  // heaviest tiles first
    const int* cu = q12_cu_seqlens(m);
    const int row0 = cu[b];
    const int q_len = cu[b + 1] - row0;
    const int m0 = mt * kBM;
    if (m0 >= q_len * G) return;
    const int kv_len = q12_kv_lens(m)[b];
    const int* bt = q12_block_table(m, b);
    const int rows_here = min(kBM, q_len * G - m0);
    const int shift = kv_len - q_len;  // token r sees keys <= shift + r
    const int max_key = shift + (m0 + rows_here - 1) / G;
    // Key tile n holds keys kv0 + n * BN ..: the first is the tile of the first key the CTA's first row sees
    // (its causal bound - window_left, written so that it cannot overflow; unsigned, so the compiler knows
    // kv0 >= 0; 0 without a window).
    const int kv0 = static_cast<int>(static_cast<unsigned>(max(shift + m0 / G, window_left) - window_left) / BN) * BN;
    const int n_tiles = max_key >= kv0 ? (max_key - kv0) / BN + 1 : 0;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    // the tiles start on a 1024-byte boundary (the launch adds 1 KiB of slack)
    const unsigned sQa = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned sKa = sQa + kQBytes;
    const unsigned sVa = sKa + kStages * kTileBytes;  // [kStages][D/64][BN][128 B]

    const int tid = threadIdx.x;
    const long long head_stride = static_cast<long long>(num_kv_heads) * D;
    // block_size is a power of two (the stager refuses anything else): page and row by shift and mask,
    // not the ~30-instruction integer division per key row
    const int bs_shift = __ffs(block_size) - 1;
    const int bs_mask = block_size - 1;
    auto q_row = [&](int r) -> long long {  // global row (token * Hq + head) of CTA row r
        const int p = m0 + r;
        return static_cast<long long>(row0 + p / G) * num_q_heads + kvh * G + p % G;
    };

    const int cw = (tid >> 5) & 3;  // warp in the warpgroup (the producer's: its copy maps)
    const int lane = tid & 31;
    // The physical blocks of this thread's KVMap::NR key rows of tile n (-1 past max_key): loaded one
    // tile before the copies that use them, so the copies never wait for the block-table read.
    auto load_pages = [&](int n, int (&pg)[KVMap::NR]) {
#pragma unroll
        for (int j = 0; j < KVMap::NR; ++j) {
            const int pos = kv0 + n * BN + KVMap::row(cw, lane, j);
            pg[j] = pos > max_key ? -1 : bt[pos >> bs_shift];
        }
    };
    // The copies, row by row: a row's source pointer is computed once (it includes this thread's first
    // chunk) and serves its chunks at immediate offsets, K and V alike, so the producer spends few
    // instructions and registers. Rows past the stream (Q) or past max_key (K/V) are zero-filled: their
    // source is a valid address the zero-size copies never read.
    auto copy_q = [&]() {  // the Q tile
        const int c0 = QMap::chunk(cw, lane, 0);  // this thread's first chunk; the others are c0 + constants
#pragma unroll
        for (int j = 0; j < QMap::NR; ++j) {
            const int r = QMap::row(cw, lane, j);
            const bool ok = r < rows_here;
            const bf16* src = q + (ok ? q_row(r) * D : 0) + c0 * 8;
#pragma unroll
            for (int i = j; i < QMap::PT; i += QMap::NR) {  // the copies of row slot j, at immediate offsets
                const int c = QMap::chunk(cw, lane, i);
                cp_async16(sQa + tile_off<kBM>(r, c), src + (c - c0) * 8, ok ? 16 : 0);
            }
        }
    };
    auto issue_kv = [&](int n, const int (&pg)[KVMap::NR], int stage) {  // K and V of tile n into `stage`
        const int c0 = KVMap::chunk(cw, lane, 0);  // this thread's first chunk; the others are c0 + constants
#pragma unroll
        for (int j = 0; j < KVMap::NR; ++j) {
            const int r = KVMap::row(cw, lane, j);
            const bool ok = pg[j] >= 0;
            const long long off = (ok ? ((static_cast<long long>(pg[j]) << bs_shift) + ((kv0 + n * BN + r) & bs_mask)) * head_stride +
                                            static_cast<long long>(kvh) * D
                                      : 0) + c0 * 8;
            const bf16* ks = k_pool + off;
            const bf16* vs = v_pool + off;
#pragma unroll
            for (int i = j; i < KVMap::PT; i += KVMap::NR) {  // (c - c0) * 8 is a constant: an immediate offset
                const int c = KVMap::chunk(cw, lane, i);
                const unsigned dst = stage * kTileBytes + tile_off<BN>(r, c);
                cp_async16(sKa + dst, ks + (c - c0) * 8, ok ? 16 : 0);
                cp_async16(sVa + dst, vs + (c - c0) * 8, ok ? 16 : 0);
            }
        }
    };

    const int w = tid >> 7;            // warpgroup
    const int warp = (tid >> 5) & 3;   // warp in the warpgroup
    const int g = lane >> 2;
    const int t = lane & 3;
    const int wrow = m0 + w * 64 + warp * 16;  // CTA-row index of this warp's first row
    const int bound[2] = {shift + (wrow + g) / G, shift + (wrow + g + 8) / G};  // last key rows g, g+8 see
    const int wg_from = shift + (m0 + w * 64) / G;  // smallest bound in the warpgroup
    // largest first key (causal bound - window_left) in the warpgroup; <= 0 without a window (INT_MAX)
    const int wg_to = shift + (m0 + w * 64 + 63) / G - window_left;
    const float sl2 = scale * 1.4426950408889634f;

    float acc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;
    float row_max[2] = {-ATTN_INF, -ATTN_INF};
    float row_sum[2] = {0.f, 0.f};  // per-thread partial sums, reduced over the quad at the end
    const unsigned q_wg = sQa + w * 64 * 128;  // this warpgroup's 64 rows of Q

    // S = Q K^T of the K tile in `stage` (issued and committed; the caller waits).
    auto gemm_s = [&](float (&s)[BN / 2], int stage) {
        const unsigned kst = sKa + stage * kTileBytes;
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)  // k-step kk: atom kk / 4, 32 bytes per step inside it
            wg::mma_ss<BN>(s, wg::smem_desc_sw128(q_wg + (kk >> 2) * (kBM * 128) + (kk & 3) * 32, 16, 1024),
                           wg::smem_desc_sw128(kst + (kk >> 2) * (BN * 128) + (kk & 3) * 32, 16, 1024), kk > 0);
        wg::commit();
    };
    // Causal mask of key tile n, the window's left bound, and the online softmax's exponentials (rows g and
    // g + 8; element e of a tile belongs to row i = e >> 1): s becomes P (fp32), alpha the rescale of O's rows.
    auto softmax = [&](float (&s)[BN / 2], int n, float (&alpha)[2]) {
        const int kb = kv0 + n * BN;
        if (kb + BN - 1 > wg_from) {
#pragma unroll
            for (int j = 0; j < NS; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (kb + j * 8 + 2 * t + (e & 1) > bound[e >> 1]) s[4 * j + e] = -ATTN_INF;
        }
        if (kb < wg_to) {  // keys below a row's window
#pragma unroll
            for (int j = 0; j < NS; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (kb + j * 8 + 2 * t + (e & 1) < bound[e >> 1] - window_left) s[4 * j + e] = -ATTN_INF;
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = -ATTN_INF;
#pragma unroll
            for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(row_max[i], mx * sl2);
            const float muse = mnew == -ATTN_INF ? 0.f : mnew;  // all masked so far: avoid inf - inf
            alpha[i] = exp2_ftz(row_max[i] - muse);
            row_max[i] = mnew;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < NS; ++j) {
                s[4 * j + 2 * i] = exp2_ftz(fmaf(s[4 * j + 2 * i], sl2, -muse));
                s[4 * j + 2 * i + 1] = exp2_ftz(fmaf(s[4 * j + 2 * i + 1], sl2, -muse));
                sum += s[4 * j + 2 * i] + s[4 * j + 2 * i + 1];
            }
            row_sum[i] = row_sum[i] * alpha[i] + sum;
        }
    };
    // O's rows scaled by alpha; P packed to bf16 A fragments (key step ks = S tiles 2ks, 2ks + 1).
    auto rescale_pack = [&](const float (&s)[BN / 2], const float (&alpha)[2], unsigned (&pa)[KN][4]) {
#pragma unroll
        for (int d = 0; d < ND; ++d) {
            acc[4 * d] *= alpha[0];
            acc[4 * d + 1] *= alpha[0];
            acc[4 * d + 2] *= alpha[1];
            acc[4 * d + 3] *= alpha[1];
        }
#pragma unroll
        for (int ks = 0; ks < KN; ++ks) {
            pa[ks][0] = pack_bf16x2(s[8 * ks + 0], s[8 * ks + 1]);
            pa[ks][1] = pack_bf16x2(s[8 * ks + 2], s[8 * ks + 3]);
            pa[ks][2] = pack_bf16x2(s[8 * ks + 4], s[8 * ks + 5]);
            pa[ks][3] = pack_bf16x2(s[8 * ks + 6], s[8 * ks + 7]);
        }
    };
    // O += P V of the V tile in `stage` (issued and committed; the caller waits).
    auto gemm_pv = [&](unsigned (&pa)[KN][4], int stage) {
        const unsigned vst = sVa + stage * kTileBytes;
        wg::fence();
#pragma unroll
        for (int ks = 0; ks < KN; ++ks)  // keys 16ks .. 16ks + 15
            wg::mma_rs<D>(acc, pa[ks], wg::smem_desc_sw128(vst + ks * 2048, BN * 128, 1024), 1);
        wg::commit();
    };

    // Key tile n from `stage`: S, softmax, P V, each GEMM waited before the next step.
    auto compute_tile = [&](int n, int stage) {
        float s[BN / 2], alpha[2];
        unsigned pa[KN][4];
        gemm_s(s, stage);
        wg::wait<0>();
        wg::pin(s);
        softmax(s, n, alpha);
        rescale_pack(s, alpha, pa);
        gemm_pv(pa, stage);
        wg::wait<0>();
        wg::pin(acc);
#pragma unroll
        for (int ks = 0; ks < KN; ++ks) wg::pin(pa[ks]);
    };

    int pg_a[KVMap::NR];
    // Barriers (8 bytes each, after the K/V stages):
    //   full[kStages]  count 128: each producer thread's copies of the stage's tile landed (its
    //                  cp.async.mbarrier.arrive.noinc fires when all its earlier cp.async did);
    //   empty[kStages] count kThreads: every consumer thread is done with the stage's tile (it arrives
    //                  after its warpgroup's wgmma.wait_group, so no wgmma reads the stage any more);
    //   qbar           count 128: the Q copies landed. The consumers wait on it before any tile, also
    //                  when n_tiles == 0 (rows that see no key), so no copy is in flight when the
    //                  epilogue reuses shared memory.
    // Tile n goes through stage n % kStages and is that stage's (n / kStages)-th fill: consumers wait
    // on full with parity (n / kStages) & 1; the producer refills the stage for tile n >= kStages once
    // tile n - kStages was consumed, empty's phase n / kStages - 1, parity ((n / kStages) - 1) & 1.
    // Neither barrier can run two phases ahead of a waiter (a fill needs the previous tile's empty, an
    // empty arrive the tile's full), so the parity test is never ambiguous. The producer copies no tile
    // past n_tiles - 1, and every one of those was waited on as full by every consumer thread.
    const unsigned full = sKa + 2 * kStages * kTileBytes, empty = full + 8 * kStages, qbar = full + 16 * kStages;
    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < kStages; ++i) {
            mbar_init(full + 8 * i, 128);
            mbar_init(empty + 8 * i, kThreads);
        }
        mbar_init(qbar, 128);
    }
    __syncthreads();  // the last CTA-wide barrier: the roles split here
    // Registers: the launch gives every thread 65536 / kCtaThreads rounded down to 8 (168); the producer
    // hands most of its share to the consumers (setmaxnreg is .sync.aligned: the role test is uniform per
    // warpgroup).
    constexpr int kProdRegs = 40, kConsRegs = 232;
    static_assert(128 * kProdRegs + kConsumers * 128 * kConsRegs <= (65536 / kCtaThreads) / 8 * 8 * kCtaThreads,
                  "setmaxnreg: the producer's and consumers' registers must fit the launch's");
    if (w == kConsumers) {  // producer
        setmaxnreg_dec<kProdRegs>();
        copy_q();
        mbar_arrive_on_copies(qbar);
        load_pages(0, pg_a);  // pg_a: tile n's pages, loaded while the stage drains
        for (int n = 0; n < n_tiles; ++n) {
            const int stage = n % kStages;
            if (n >= kStages) mbar_wait(empty + 8 * stage, ((n / kStages) - 1) & 1);  // tile n - kStages consumed
            issue_kv(n, pg_a, stage);
            mbar_arrive_on_copies(full + 8 * stage);
            load_pages(n + 1, pg_a);
        }
        cp_async_commit();
        cp_async_wait<0>();  // leave no copy of this thread in flight behind it
        return;
    }
    setmaxnreg_inc<kConsRegs>();
    mbar_wait(qbar, 0);
    for (int n = 0; n < n_tiles; ++n) {
        const int stage = n % kStages;
        mbar_wait(full + 8 * stage, (n / kStages) & 1);  // tile n landed
        wg::fence_proxy_async();                         // ... visible to wgmma
        compute_tile(n, stage);
        mbar_arrive(empty + 8 * stage);  // this thread is done with tile n
    }
    // The output tile goes to the K/V stages once every wgmma is done with them: the consumer
    // warpgroups only (named barrier 1; the producer has left), every copy landed (see above).
    named_sync<1, kThreads>();

    float inv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float l = row_sum[i];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[i] = l > 0.f ? 1.f / l : 0.f;
    }
    bf16* sO = reinterpret_cast<bf16*>(smem_raw + (sKa - smem_addr(smem_raw)));
    unsigned* sO32 = reinterpret_cast<unsigned*>(sO);
    const int rl = w * 64 + warp * 16 + g;
#pragma unroll
    for (int d = 0; d < ND; ++d) {
        const int col = d * 8 + 2 * t;
        sO32[(rl * OLD + col) / 2] = pack_bf16x2(acc[4 * d] * inv[0], acc[4 * d + 1] * inv[0]);
        sO32[((rl + 8) * OLD + col) / 2] = pack_bf16x2(acc[4 * d + 2] * inv[1], acc[4 * d + 3] * inv[1]);
    }
    named_sync<1, kThreads>();
    for (int c = tid; c < kBM * CPR; c += kThreads) {
        const int r = c / CPR;
        const int ch = c % CPR;
        if (r < rows_here)
            *reinterpret_cast<uint4*>(o + q_row(r) * D + ch * 8) = *reinterpret_cast<const uint4*>(sO + r * OLD + ch * 8);
    }
}

}  // namespace

// The second bound (1 CTA per SM) makes ptxas budget 65536 / kCtaThreads registers a thread, the pool
// setmaxnreg redistributes.
extern "C" __global__ __launch_bounds__(kCtaThreads, 1) void q12_attn_wgmma_d128(ATTN_PARAMS) { attn_wgmma<128>(ATTN_ARGS); }
extern "C" __global__ __launch_bounds__(kCtaThreads, 1) void q12_attn_wgmma_d256(ATTN_PARAMS) { attn_wgmma<256>(ATTN_ARGS); }
