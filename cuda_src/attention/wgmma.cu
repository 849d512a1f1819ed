// attn_wgmma.cu: batched varlen paged causal prefill attention on Hopper's warpgroup MMA (wgmma,
// compiled for sm_90a). Same entry parameters, semantics and batched == alone guarantee as
// attn_prefill.cu (see its header): stream b = blockIdx.z, bottom-right causal over kv_lens[b],
// keys and values gathered through the stream's block table, GQA kv_head = h / (Hq / Hkv).
// ops.attention's algo "auto" (the default) takes this kernel on Hopper for head dims 128 and 256.
//
// CTA: WG warpgroups (128 threads each), BM = 64 * WG rows. Rows are (token, head) pairs of one kv
// head (blockIdx.y): CTA row r is token (m0 + r) / G, query head kvh * G + (m0 + r) % G, G = Hq / Hkv,
// so one K/V tile serves the G query heads that read it. Warpgroup w owns rows 64w .. 64w + 63.
// Per key tile of BN keys (two-stage cp.async ring; with WS 0 every thread copies and computes):
//   S[64 x BN] = Q K^T: D/16 wgmma (A = Q, B = K, both K-major from shared memory);
//   causal mask, online softmax in fp32 registers (exp2 with the scale folded in, as attn_prefill);
//   O[64 x D] += P V: BN/16 wgmma, A = P from registers (bf16), B = V (MN-major) from shared memory.
// Stage hand-off (MB 1): per stage a "full" mbarrier (every thread's cp.async of the tile landed) and
// an "empty" one (every thread is done with it), instead of a CTA barrier per tile, so the two
// warpgroups drift up to a tile apart and one's GEMMs overlap the other's softmax.
// Warp specialization (WS 1, FlashAttention-3 style; measured: 1.16-1.28x faster than WS 0 on every
// case, D128 fresh 340-389 TFLOP/s, D256 447-476, run Z): one more warpgroup, the producer (the last;
// block 128 (WG + 1)), does every copy: Q once (its own mbarrier, which the consumers wait on even
// when they have no key tile), then K/V tile n into stage n % ST, announced by
// one cp.async.mbarrier.arrive.noinc per producer thread on the stage's "full" barrier (count 128); it
// refills a stage once its "empty" barrier (count WG * 128, every consumer thread arrives) says the
// stage's previous tile was consumed. The WG consumer warpgroups only wait, compute (the same
// compute_tile) and release; setmaxnreg moves registers from the producer (40) to them (232). No
// CTA-wide barrier after the role split: the consumers' epilogue syncs on named barrier 1.
// ST (WS 1 only): K/V stages, 2 by default; 3 fits at D128 (230,456 bytes).
// The producer's address arithmetic is what limited WS (ncu and probes, runs AB-AD: the consumers share the SM's
// issue slots with it): the page and row of a key came from an integer division by block_size (about
// 30 instructions per row) and every 16-byte copy recomputed its 64-bit source (6-7 instructions).
// block_size is a power of two, so shift and mask; a row's source pointer includes this thread's first
// chunk and the other chunks are immediate offsets of the copy instruction. Run AE: D128 fresh 418-466
// TFLOP/s (1.22x cuDNN's time), chunked 510-515; D256 fresh 457-500, chunked 468-532.
// Measured on top of WS and dropped (runs Y / Z / AA, tests/GPU.md): PP (ping-pong turns, FA3): 0-20%
// slower than WS alone; OV (S of the next tile before P V of this one inside a warpgroup, first and last
// tiles peeled so ptxas does not serialize): ~15% slower than WS alone, as fast as the session-4 kernel,
// and still 8-33% slower after the producer's address fix (run AJ);
// ST 3: as fast as 2; PS (a persistent CTA per SM looping over row tiles heaviest first, the producer
// streaming the next tile's K/V and Q while the consumers finish, O stored from registers): run AA,
// D128 fresh 8 x 2048 3% faster, everything else 2-26% slower (ragged worst: the static round-robin
// over items balances badly); removed.
// Shared memory (SW 1): Q, K and V tiles in the 128-byte swizzled layout of wgmma.cuh, [D/64][rows][128 B]
// with 16-byte chunk j of row r at j ^ (r & 7), tiles on 1024-byte boundaries. Copies: each warp
// instruction reads 64 contiguous bytes of 8 key rows; a quarter-warp writes 8 rows of one chunk,
// which the swizzle spreads over all 32 banks. The output goes through shared memory (row-major,
// rows padded by 16 bytes) to 16-byte global stores.
// Measured on the H200 (tests/GPU.md runs P-U; Hq 16, Hkv 2, block 16), TFLOP/s by the pairs formula:
// the interleaved (no-swizzle) layout ran at 188-240 whatever the pipelining (lockstep, mbarriers, S of
// the next tile during the softmax): the tensor pipe idled at 22% (ncu). The 128-byte swizzle: D128
// 284-334, D256 344-382 (run U); with the mbarriers D128 295-341, D256 367-399: 0.72-0.95 of torch FA2's
// time on every case, 0.56-0.80 of cuDNN's on chunked prefill, 1.0-1.7x cuDNN's time fresh.
// Numerics: as attn_prefill.cu (P rounded to bf16 before P V, ex2.approx.ftz); the wgmma sums may
// round in a different order than mma.sync, so the two kernels agree to bf16 rounding, not bit for bit.
#include "common/q12_meta.cuh"
#include "common/wgmma.cuh"

namespace {

#define ATTNW_INF __int_as_float(0x7f800000)

__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

using wg::mbar_arrive;
using wg::mbar_arrive_on_copies;
using wg::mbar_init;
using wg::mbar_wait;

// Named barrier `id` over `n` threads (bar.sync). Id 0 is __syncthreads(); WS uses 1 for the consumer
// warpgroups' epilogue.
template <int ID, int N>
__device__ __forceinline__ void named_sync() {
    asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "n"(N) : "memory");
}
// Per-thread register budget of the calling warpgroup (WS; every warp of the warpgroup executes it).
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned pack_bf16x2(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<unsigned*>(&v);
}

// Which (row, 16-byte chunk) pairs a thread copies of a [ROWS x CPR chunks] tile when NW warps share
// the copy: warp w takes blocks of 8 rows x 4 chunks, block b = w + NW * i (i < PT); in a block lane
// l copies row l & 7, chunk l >> 3. Each copy instruction of a warp then reads 64 contiguous bytes of 8
// rows (whole 32-byte sectors) and each quarter-warp writes 8 rows of one chunk: 128 contiguous bytes
// in the interleaved layout, 8 different bank groups in the swizzled one (tile_off); no bank conflicts
// either way. A thread touches NR distinct rows (one page lookup each); copy i is in row slot slot(i).
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

// Byte offset of row r's 16-byte chunk cg (elements 8cg .. 8cg+7) in a [ROWS x D] bf16 operand tile:
// SW 0, no swizzle: [D/8][ROWS][16 B]; SW 1, 128-byte swizzle: [D/64][ROWS][128 B] with chunk
// cg % 8 of row r at position (cg % 8) ^ (r & 7) (the tile must start on a 1024-byte boundary).
template <int ROWS, int SW>
__device__ __forceinline__ unsigned tile_off(int r, int cg) {
    if constexpr (SW) return (cg >> 3) * (ROWS * 128) + r * 128 + (((cg & 7) ^ (r & 7)) << 4);
    else return cg * (ROWS * 16) + r * 16;
}

template <int D, int BN, int WG, int MB, int SW, int WS, int ST>
__device__ __forceinline__ void attn_wgmma(const Q12Meta& m, const bf16* q, const bf16* k_pool, const bf16* v_pool,
                                           bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
    constexpr int kThreads = WG * 128;         // computing threads (WS: the consumer warpgroups)
    constexpr int kBM = WG * 64;               // CTA rows ((token, head) pairs)
    constexpr int CPR = D / 8;                 // 16-byte chunks per row
    constexpr int KD = D / 16;                 // k-steps of S = Q K^T
    constexpr int KN = BN / 16;                // k-steps of O += P V
    constexpr int NS = BN / 8;                 // 8-key tiles of S
    constexpr int ND = D / 8;                  // 8-dim tiles of O
    constexpr int kCopyWarps = WS ? 4 : WG * 4;  // WS: the producer warpgroup copies alone
    using KVMap = CopyMap<BN, CPR, kCopyWarps>;
    using QMap = CopyMap<kBM, CPR, kCopyWarps>;
    constexpr unsigned kQBytes = kBM * D * 2;
    constexpr unsigned kTileBytes = BN * D * 2;  // one stage of K (or V)
    constexpr int OLD = D + 8;                   // epilogue row stride (elements)
    static_assert(kBM * OLD * 2 <= 2 * ST * kTileBytes, "the output tile must fit the K/V stages");
    static_assert(WS == 0 || (WS == 1 && MB == 1 && ST >= 2 && ST <= 4), "WS 0 or 1; WS 1 takes MB 1 and 2-4 stages");
    static_assert(WS == 1 || ST == 2, "without WS the ring has two stages");

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
    const int n_tiles = max_key >= 0 ? max_key / BN + 1 : 0;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    // SW: the tiles start on a 1024-byte boundary (the launch adds 1 KiB of slack)
    const unsigned sQa = SW ? (smem_u32(smem_raw) + 1023u) & ~1023u : smem_u32(smem_raw);
    const unsigned sKa = sQa + kQBytes;
    const unsigned sVa = sKa + ST * kTileBytes;  // [ST][D/8][BN][8]

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

    const int cw = WS ? (tid >> 5) & 3 : tid >> 5;  // warp among the copying warps (copy maps)
    const int lane = tid & 31;
    // The physical blocks of this thread's KVMap::NR key rows of tile n (-1 past max_key): loaded one
    // tile before the copies that use them, so the copies never wait for the block-table read.
    auto load_pages = [&](int n, int (&pg)[KVMap::NR]) {
#pragma unroll
        for (int j = 0; j < KVMap::NR; ++j) {
            const int pos = n * BN + KVMap::row(cw, lane, j);
            pg[j] = pos > max_key ? -1 : bt[pos >> bs_shift];
        }
    };
    // The copies, row by row: a row's source pointer is computed once (it includes this thread's first
    // chunk) and serves its chunks at immediate offsets, K and V alike, so the copying threads spend
    // few instructions and, under WS, few registers. Rows past the stream (Q) or past max_key (K/V)
    // are zero-filled: their source is a valid address the zero-size copies never read.
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
                cp_async16(sQa + tile_off<kBM, SW>(r, c), src + (c - c0) * 8, ok ? 16 : 0);
            }
        }
    };
    auto issue_kv = [&](int n, const int (&pg)[KVMap::NR], int stage) {  // K and V of tile n into `stage`
        const int c0 = KVMap::chunk(cw, lane, 0);  // this thread's first chunk; the others are c0 + constants
#pragma unroll
        for (int j = 0; j < KVMap::NR; ++j) {
            const int r = KVMap::row(cw, lane, j);
            const bool ok = pg[j] >= 0;
            const long long off = (ok ? ((static_cast<long long>(pg[j]) << bs_shift) + ((n * BN + r) & bs_mask)) * head_stride +
                                            static_cast<long long>(kvh) * D
                                      : 0) + c0 * 8;
            const bf16* ks = k_pool + off;
            const bf16* vs = v_pool + off;
#pragma unroll
            for (int i = j; i < KVMap::PT; i += KVMap::NR) {  // (c - c0) * 8 is a constant: an immediate offset
                const int c = KVMap::chunk(cw, lane, i);
                const unsigned dst = stage * kTileBytes + tile_off<BN, SW>(r, c);
                cp_async16(sKa + dst, ks + (c - c0) * 8, ok ? 16 : 0);
                cp_async16(sVa + dst, vs + (c - c0) * 8, ok ? 16 : 0);
            }
        }
    };
    if constexpr (!WS) copy_q();  // WS: the producer's first copy

    const int w = tid >> 7;            // warpgroup
    const int warp = (tid >> 5) & 3;   // warp in the warpgroup
    const int g = lane >> 2;
    const int t = lane & 3;
    const int wrow = m0 + w * 64 + warp * 16;  // CTA-row index of this warp's first row
    const int bound[2] = {shift + (wrow + g) / G, shift + (wrow + g + 8) / G};  // last key rows g, g+8 see
    const int wg_from = shift + (m0 + w * 64) / G;  // smallest bound in the warpgroup
    const float sl2 = scale * 1.4426950408889634f;

    float acc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;
    float row_max[2] = {-ATTNW_INF, -ATTNW_INF};
    float row_sum[2] = {0.f, 0.f};  // per-thread partial sums, reduced over the quad at the end
    const unsigned q_wg = sQa + w * 64 * (SW ? 128 : 16);  // this warpgroup's 64 rows of Q

    // S = Q K^T of the K tile in `stage` (issued and committed; the caller waits).
    auto gemm_s = [&](float (&s)[BN / 2], int stage) {
        const unsigned kst = sKa + stage * kTileBytes;
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)
            if constexpr (SW)  // k-step kk: atom kk / 4, 32 bytes per step inside it
                wg::mma_ss<BN>(s, wg::smem_desc_sw128(q_wg + (kk >> 2) * (kBM * 128) + (kk & 3) * 32, 16, 1024),
                               wg::smem_desc_sw128(kst + (kk >> 2) * (BN * 128) + (kk & 3) * 32, 16, 1024), kk > 0);
            else  // k-step kk: chunks 2kk, 2kk + 1
                wg::mma_ss<BN>(s, wg::smem_desc(q_wg + kk * 2 * kBM * 16, kBM * 16, 128),
                               wg::smem_desc(kst + kk * 2 * BN * 16, BN * 16, 128), kk > 0);
        wg::commit();
    };
    // Causal mask of key tile n and the online softmax's exponentials (rows g and g + 8; element e of
    // a tile belongs to row i = e >> 1): s becomes P (fp32), alpha the rescale of O's rows.
    auto softmax = [&](float (&s)[BN / 2], int n, float (&alpha)[2]) {
        const int kb = n * BN;
        if (kb + BN - 1 > wg_from) {
#pragma unroll
            for (int j = 0; j < NS; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (kb + j * 8 + 2 * t + (e & 1) > bound[e >> 1]) s[4 * j + e] = -ATTNW_INF;
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = -ATTNW_INF;
#pragma unroll
            for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(row_max[i], mx * sl2);
            const float muse = mnew == -ATTNW_INF ? 0.f : mnew;  // all masked so far: avoid inf - inf
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
        for (int ks = 0; ks < KN; ++ks) {  // keys 16ks .. 16ks + 15
            if constexpr (SW) wg::mma_rs<D>(acc, pa[ks], wg::smem_desc_sw128(vst + ks * 2048, BN * 128, 1024), 1);
            else wg::mma_rs<D>(acc, pa[ks], wg::smem_desc(vst + ks * 256, 128, BN * 16), 1);
        }
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
    if constexpr (WS) {
        // Warp specialization (WS 1): warpgroup WG (the last) is the producer and does every copy;
        // warpgroups 0 .. WG-1 only compute. Barriers (8 bytes each, after the K/V stages):
        //   full[ST]  count 128: each producer thread's copies of the stage's tile landed (its
        //             cp.async.mbarrier.arrive.noinc fires when all its earlier cp.async did);
        //   empty[ST] count WG * 128: every consumer thread is done with the stage's tile (it arrives
        //             after its warpgroup's wgmma.wait_group, so no wgmma reads the stage any more);
        //   qbar      count 128: the Q copies landed. The consumers wait on it before any tile, also
        //             when n_tiles == 0 (rows that see no key), so no copy is in flight when the
        //             epilogue reuses shared memory.
        // Tile n goes through stage n % ST and is that stage's (n / ST)-th fill: consumers wait on
        // full with parity (n / ST) & 1; the producer refills the stage for tile n >= ST once tile
        // n - ST was consumed, empty's phase n / ST - 1, parity ((n / ST) - 1) & 1. Neither barrier can
        // run two phases ahead of a waiter (a fill needs the previous tile's empty, an empty arrive the
        // tile's full), so the parity test is never ambiguous. The producer copies no tile past
        // n_tiles - 1, and every one of those was waited on as full by every consumer thread.
        const unsigned full = sKa + 2 * ST * kTileBytes, empty = full + 8 * ST, qbar = full + 16 * ST;
        if (tid == 0) {
#pragma unroll
            for (int i = 0; i < ST; ++i) {
                mbar_init(full + 8 * i, 128);
                mbar_init(empty + 8 * i, kThreads);
            }
            mbar_init(qbar, 128);
        }
        __syncthreads();  // the last CTA-wide barrier: the roles split here
        // Registers: the launch gives every thread 65536 / (128 (WG + 1)) rounded down to 8 (168 for
        // WG 2); the producer hands most of its share to the consumers (setmaxnreg is .sync.aligned:
        // the role test is uniform per warpgroup). WG 1 (255 each) has no use for it.
        constexpr int kProdRegs = 40, kConsRegs = 232;
        static_assert(128 * kProdRegs + WG * 128 * kConsRegs <= (65536 / ((WG + 1) * 128)) / 8 * 8 * (WG + 1) * 128,
                      "setmaxnreg: the producer's and consumers' registers must fit the launch's");
        if (w == WG) {  // producer
            if constexpr (WG == 2) setmaxnreg_dec<kProdRegs>();
            copy_q();
            mbar_arrive_on_copies(qbar);
            load_pages(0, pg_a);  // pg_a: tile n's pages, loaded while the stage drains
            for (int n = 0; n < n_tiles; ++n) {
                const int stage = n % ST;
                if (n >= ST) mbar_wait(empty + 8 * stage, ((n / ST) - 1) & 1);  // tile n - ST consumed
                issue_kv(n, pg_a, stage);
                mbar_arrive_on_copies(full + 8 * stage);
                load_pages(n + 1, pg_a);
            }
            cp_async_commit();
            cp_async_wait_all();  // leave no copy of this thread in flight behind it
            return;
        }
        if constexpr (WG == 2) setmaxnreg_inc<kConsRegs>();
        mbar_wait(qbar, 0);
        for (int n = 0; n < n_tiles; ++n) {
            const int stage = n % ST;
            mbar_wait(full + 8 * stage, (n / ST) & 1);  // tile n landed
            wg::fence_proxy_async();                    // ... visible to wgmma
            compute_tile(n, stage);
            mbar_arrive(empty + 8 * stage);  // this thread is done with tile n
        }
    } else if constexpr (MB) {
        // One K/V tile per iteration as below, without the CTA-wide barrier: stage s has a "full"
        // mbarrier (every thread's copies of the tile landed; phase = fill count & 1) and an "empty"
        // one (every thread is done with the tile). A thread refills a stage once both warpgroups
        // consumed its previous tile, so the warpgroups drift up to a tile apart and one's GEMMs run
        // while the other computes its softmax.
        const unsigned bars = sKa + 4 * kTileBytes;  // full[2], empty[2] (8 bytes each)
        if (tid == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) mbar_init(bars + 8 * i, kThreads);
        }
        __syncthreads();
        load_pages(0, pg_a);
        if (n_tiles > 0) {
            issue_kv(0, pg_a, 0);
            mbar_arrive_on_copies(bars);  // full[0], phase 0: Q and tile 0
        }
        load_pages(1, pg_a);  // pg_a: tile n + 1's pages
        for (int n = 0; n < n_tiles; ++n) {
            const int stage = n & 1;
            if (n + 1 < n_tiles) {
                if (n >= 1) mbar_wait(bars + 16 + 8 * (stage ^ 1), ((n - 1) >> 1) & 1);  // tile n - 1 consumed
                issue_kv(n + 1, pg_a, stage ^ 1);
                mbar_arrive_on_copies(bars + 8 * (stage ^ 1));
            }
            load_pages(n + 2, pg_a);
            mbar_wait(bars + 8 * stage, (n >> 1) & 1);  // tile n landed for every thread
            wg::fence_proxy_async();                    // ... visible to wgmma
            compute_tile(n, stage);
            mbar_arrive(bars + 16 + 8 * stage);  // this thread is done with tile n
        }
    } else {
        // One K/V tile per iteration behind a CTA barrier.
        load_pages(0, pg_a);
        if (n_tiles > 0) {
            issue_kv(0, pg_a, 0);
        }
        cp_async_commit();  // Q + tile 0
        load_pages(1, pg_a);  // pg_a: tile n + 1's pages
        for (int n = 0; n < n_tiles; ++n) {
            const int stage = n & 1;
            cp_async_wait_all();     // tile n (and Q) landed for this thread
            wg::fence_proxy_async(); // ... visible to wgmma
            __syncthreads();         // ... for every thread; every warpgroup is done with tile n - 1's stage
            if (n + 1 < n_tiles) {
                issue_kv(n + 1, pg_a, stage ^ 1);
            }
            cp_async_commit();
            load_pages(n + 2, pg_a);
            compute_tile(n, stage);
        }
    }
    // The output tile goes to the K/V stages once every wgmma is done with them. WS: the consumer
    // warpgroups only (named barrier 1; the producer has left), every copy landed (see above).
    if constexpr (WS) {
        named_sync<1, kThreads>();
    } else {
        cp_async_wait_all();  // n_tiles == 0: the Q copy may still be in flight
        __syncthreads();
    }

    float inv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float l = row_sum[i];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[i] = l > 0.f ? 1.f / l : 0.f;
    }
    bf16* sO = reinterpret_cast<bf16*>(smem_raw + (sKa - smem_u32(smem_raw)));
    unsigned* sO32 = reinterpret_cast<unsigned*>(sO);
    const int rl = w * 64 + warp * 16 + g;
#pragma unroll
    for (int d = 0; d < ND; ++d) {
        const int col = d * 8 + 2 * t;
        sO32[(rl * OLD + col) / 2] = pack_bf16x2(acc[4 * d] * inv[0], acc[4 * d + 1] * inv[0]);
        sO32[((rl + 8) * OLD + col) / 2] = pack_bf16x2(acc[4 * d + 2] * inv[1], acc[4 * d + 3] * inv[1]);
    }
    if constexpr (WS) named_sync<1, kThreads>();
    else __syncthreads();
    for (int c = tid; c < kBM * CPR; c += kThreads) {
        const int r = c / CPR;
        const int ch = c % CPR;
        if (r < rows_here)
            *reinterpret_cast<uint4*>(o + q_row(r) * D + ch * 8) = *reinterpret_cast<const uint4*>(sO + r * OLD + ch * 8);
    }
}

}  // namespace

// Tiles (macros, for tests/gpu/attn_variants.py): ATTN_WG_D<d>_BN keys per tile, ATTN_WG_D<d>_WG warpgroups,
// ATTN_WG_D<d>_MB 1: per-stage mbarriers instead of the CTA barrier per tile (0: __syncthreads),
// ATTN_WG_D<d>_SW 1: Q, K and V tiles in the 128-byte swizzled layout (0: the interleaved one),
// ATTN_WG_D<d>_WS 1: one more warpgroup, the producer, does every copy (0: every thread copies and computes),
// ATTN_WG_D<d>_ST K/V stages (2; 3 or 4 only with WS 1, where shared memory holds them).
#ifndef ATTN_WG_D128_SW
#define ATTN_WG_D128_SW 1
#endif
#ifndef ATTN_WG_D256_SW
#define ATTN_WG_D256_SW 1
#endif
#ifndef ATTN_WG_D128_MB
#define ATTN_WG_D128_MB 1
#endif
#ifndef ATTN_WG_D256_MB
#define ATTN_WG_D256_MB 1
#endif
#ifndef ATTN_WG_D128_BN
#define ATTN_WG_D128_BN 128
#endif
#ifndef ATTN_WG_D128_WG
#define ATTN_WG_D128_WG 2
#endif
#ifndef ATTN_WG_D256_BN
#define ATTN_WG_D256_BN 64
#endif
#ifndef ATTN_WG_D256_WG
#define ATTN_WG_D256_WG 2
#endif
#ifndef ATTN_WG_D128_WS
#define ATTN_WG_D128_WS 1
#endif
#ifndef ATTN_WG_D256_WS
#define ATTN_WG_D256_WS 1
#endif
#ifndef ATTN_WG_D128_ST
#define ATTN_WG_D128_ST 2
#endif
#ifndef ATTN_WG_D256_ST
#define ATTN_WG_D256_ST 2
#endif

// Block: WG warpgroups, plus the producer with WS 1. The second bound (min CTAs per SM) is WS: 1 with WS
// budgets 65536 / threads registers a thread (168 for 384), the pool setmaxnreg redistributes; 0 (none)
// keeps the WS 0 build as it was (1 there lets ptxas take more registers).
extern "C" __global__ __launch_bounds__((ATTN_WG_D128_WG + ATTN_WG_D128_WS) * 128, ATTN_WG_D128_WS) void q12_attn_wgmma_d128(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
    attn_wgmma<128, ATTN_WG_D128_BN, ATTN_WG_D128_WG, ATTN_WG_D128_MB, ATTN_WG_D128_SW, ATTN_WG_D128_WS,
               ATTN_WG_D128_ST>(m, q, k_pool, v_pool, o, num_q_heads, num_kv_heads, block_size, scale);
}

extern "C" __global__ __launch_bounds__((ATTN_WG_D256_WG + ATTN_WG_D256_WS) * 128, ATTN_WG_D256_WS) void q12_attn_wgmma_d256(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
    attn_wgmma<256, ATTN_WG_D256_BN, ATTN_WG_D256_WG, ATTN_WG_D256_MB, ATTN_WG_D256_SW, ATTN_WG_D256_WS,
               ATTN_WG_D256_ST>(m, q, k_pool, v_pool, o, num_q_heads, num_kv_heads, block_size, scale);
}
