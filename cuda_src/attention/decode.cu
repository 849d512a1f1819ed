// attention/decode.cu: split-KV paged decode attention (sm_90, mma.sync) for passes whose every stream has few new
// tokens (at most kMaxQLen, and q_len * Hq / Hkv <= kMaxRows). Entries q12_attn_decode_d64 / _d128 / _d256
// (DECODE_PARAMS, bf16 pools), q12_attn_decode_fp8_d64 / _d128 / _d256 (DECODE_FP8_PARAMS, FP8 e4m3 pools, the same
// template with one-byte K/V elements: "FP8 pools" below) and their merges q12_attn_decode_merge_d64 / _d128 / _d256
// (DECODE_MERGE_PARAMS, shared by both).
//
// Semantics, as the prefill kernels (attention/mma.cu): stream b owns the packed rows cu[b] .. cu[b+1] of Q and O
// ([T, Hq, D] bf16); q_len = cu[b+1] - cu[b], kv_len = kv_lens[b]; token i (0-based in the stream's chunk) of query
// head h sees keys 0 .. kv_len - q_len + i (bottom-right causal), of them only those from kv_len - q_len + i -
// window_left on (the sliding window, FlashAttention's window_size=(window_left, 0); INT_MAX: none), of kv head
// h / (Hq / Hkv), gathered from the paged pools ([num_blocks, block_size, Hkv, D] bf16, block_size a power of two)
// through the stream's block table. Softmax of scale * q.k in fp32 (scale > 0).
//
// Split kernel: grid (num_splits, Hkv, n), kThreads threads. CTA (s, kvh, b) holds the G = Hq / Hkv query heads of kv
// head kvh and the stream's q_len tokens (GQA packing: CTA row r is token r / G, head kvh * G + r % G), so every K/V
// byte of the stream's kv head is read by one CTA once. The stream's key tiles (BN keys each) from t_lo, the tile
// of the first key its first token sees (0 without a window), up to n_tiles = ceil(kv_len / BN) are split into
// contiguous ranges of tps = ceil((n_tiles - t_lo) / num_splits) tiles; CTA s takes tiles t_lo + s * tps .. up to
// (none past the last: it exits). The partition depends only on the stream's q_len, kv_len, the window and
// num_splits, so a stream computes the same bits batched or alone.
//   The CTA walks its tiles through a decode_config(D).stages-deep cp.async ring with one __syncthreads per tile
// (tile j + stages - 1 issued right after the barrier that proves tile j - 1's stage free; the key rows' pool slots
// looked up by the threads tid < BN two tiles ahead into an int [2][BN] slot array), 16-byte copies of every K and V
// row. The math: the CTA's rows form MT = 1, 2 or 4 m-tiles of 16 (the smallest that holds q_len * G, per stream);
// warp w < MT * KW computes m-tile w % MT over key group w / MT, the group's KPW = BN / KW keys of every tile, KW =
// min(kWarps / MT, BN / 16) (the other warps only copy). Per tile S = Q K^T and O += P V on mma.sync.m16n8k16
// (bf16 in, fp32 accumulate, P rounded to bf16), online softmax in log2 units with ex2.approx.ftz, fp32 row sums,
// as attention/mma.cu. After the last tile the KW key groups of each row are combined through shared memory (max,
// rescale by 2^(m_k - M), sum, in group order), then num_splits == 1: O / L -> bf16 straight into O; num_splits > 1:
// the split's normalised O / L (fp32) and its log-sum-exp M + log2 L (log2 units, -inf where the row saw no key of
// the split) into the workspace `partial`:
//     partial_o[s][t][h][D] fp32, then partial_lse[s][t][h] fp32,  t < T = m.total_tokens (the packed row).
// Merge kernel (only where num_splits > 1): grid (ceil(max q_len * Hq / rows per CTA), 1, n), kMergeThreads
// threads, D / 8 threads per (token, head) row, 8 dims each: over the stream's non-empty splits (ns = ceil((n_tiles -
// t_lo) / tps)), M* = max lse_s, w_s = 2^(lse_s - M*), O = sum_s w_s O_s / sum_s w_s (in split order) -> bf16. It
// waits for the split grid with griddepcontrol.wait (launched as a programmatic dependent launch: the split kernel
// triggers nothing early, so the merge is set up while the split grid's last CTAs run and starts as they exit;
// launched plainly the wait is a no-op).
//
// Shared memory of the split kernel (decode_smem_bytes(D), dynamic): Q [kMaxRows][LD] (only MT * 16 rows used), K
// and V [stages][BN][LD] each (LD = D + 8: the padding that makes ldmatrix conflict-free, as attention/mma.cu), the
// slot array int [2][BN]. After the loop the K/V stages hold the key groups' exchange: acc float [warps][16][D + 4],
// then the row maxima and sums float [warps][2][16].
// Fragment layouts: attention/mma.cu's header comment (Q as A, K as B, P as A from the S accumulators, V as B by
// ldmatrix.trans).
//
// FP8 pools (q12_kv_write_fp8's: a value is stored as e4m3(x * rcp(scale[h])), h its kv head, and stands for
// q * scale[h]; k_scale, v_scale fp32 [Hkv]): the 16-byte cp.async copies move e4m3 rows (D bytes, half the bf16
// bytes) into a ring of decode_config(D).fp8_stages stages; all the CTA's threads convert each tile, 8 values at a
// time, e4m3 -> f16x2 (cvt) -> fp32 -> bf16x2, exactly (every e4m3 value is a bf16 value), into two bf16 tiles of the
// bf16 entries' layout, which the same MMA code reads. Iteration j computes bf16 tile j & 1 (converted in iteration
// j - 1, tile 0 before the loop) and converts tile j + 1 into the other one, so one __syncthreads a tile still
// separates every write from its reads; it waits for tile j + 1's copies (not tile j's) and issues tile j +
// fp8_stages into the ring stage tile j left. The scales are not multiplied into the elements: the MMAs see the raw
// e4m3 values, the scores' one constant is (scale * k_scale[kvh]) * log2(e) (computed in that order, once a CTA), and
// V's scale multiplies the row's normaliser where the key groups are combined: O = x * ((1 / L) * v_scale[kvh]), x
// the combined fp32 accumulator, before the bf16 store (one split) or the split's fp32 partial (the merge, linear in
// the partials, is the bf16 entries'; the log-sum-exp does not involve V). Shared memory (decode_smem_bytes(D, true)):
// Q, then K and V [2][BN][LD] bf16 each, then the e4m3 ring K and V [fp8_stages][BN][D] each, then the slot array.
#include "attention/common.cuh"
#include "common/mma_sync.cuh"

// Every bf16 split entry takes these parameters (q12drv.core.launch.parse_signatures reads the macro); partial is the
// workspace (NULL and unread where num_splits == 1).
#define DECODE_PARAMS                                                                                             \
    Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, float* partial, int num_q_heads, \
        int num_kv_heads, int block_size, float scale, int window_left, int num_splits
#define DECODE_ARGS                                                                                         \
    m, q, k_pool, v_pool, nullptr, nullptr, o, partial, num_q_heads, num_kv_heads, block_size, scale, window_left, \
        num_splits
// The FP8 split entries: e4m3 pools (one byte an element, [num_blocks, block_size, Hkv, D]) and each kv head's fp32
// scales k_scale, v_scale [Hkv] (a value is q * scale).
#define DECODE_FP8_PARAMS                                                                                        \
    Q12Meta m, const bf16* q, const unsigned char* k_pool, const unsigned char* v_pool, const float* k_scale,  \
        const float* v_scale, bf16* o, float* partial, int num_q_heads, int num_kv_heads, int block_size, float scale, \
        int window_left, int num_splits
#define DECODE_FP8_ARGS \
    m, q, k_pool, v_pool, k_scale, v_scale, o, partial, num_q_heads, num_kv_heads, block_size, scale, window_left, num_splits
// Every merge entry takes these.
#define DECODE_MERGE_PARAMS \
    Q12Meta m, const float* partial, bf16* o, int num_q_heads, int num_kv_heads, int window_left, int num_splits
#define DECODE_MERGE_ARGS m, partial, o, num_q_heads, num_kv_heads, window_left, num_splits

namespace {

using namespace attn;
using namespace mma_sync;

// Tiles of the entry for head dim D (64, 128 or 256).
struct DecodeConfig {
    int block_n;     // BN: keys per K/V tile
    int stages;      // K/V stages of the cp.async ring (bf16 pools)
    int fp8_stages;  // e4m3 K/V stages of the cp.async ring (FP8 pools)
};
__host__ __device__ constexpr DecodeConfig decode_config(int d) {
    // D 64 and 128: BN 64, so that four warps of 16 keys compute a one-m-tile CTA; four stages. D 256: BN 32 and five
    // stages (four tiles, 128 KiB, in flight) inside the shared memory one CTA may have. FP8 pools: the most e4m3
    // stages beside the two bf16 tiles the MMAs read that keep D 64 at two CTAs an SM and D 128 / 256 inside one
    // CTA's 227 KiB (8, 8, 7: 56, 112 and 96 KiB in flight a CTA).
    return d == 256 ? DecodeConfig{32, 5, 7} : DecodeConfig{64, 4, 8};
}
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxQLen = 8;    // new tokens a stream may have
constexpr int kMaxRows = 64;   // CTA rows (q_len * G) a stream may have: four m-tiles of 16
constexpr int kPad = 8;        // bf16 of padding per K/V/Q smem row
constexpr int kAccPad = 4;     // fp32 of padding per row of the key groups' exchange
constexpr int kMergeThreads = 128;
__host__ __device__ constexpr bool decode_head_dim(int d) { return d == 64 || d == 128 || d == 256; }
// The K and V stages: bf16 pools [stages][BN][LD] each; FP8 pools the two bf16 tiles [2][BN][LD] each the MMAs read,
// then the e4m3 ring [fp8_stages][BN][D] each.
__host__ __device__ constexpr int decode_kv_bytes(int d, bool fp8 = false) {
    return fp8 ? 2 * 2 * decode_config(d).block_n * (d + kPad) * 2 + 2 * decode_config(d).fp8_stages * decode_config(d).block_n * d
               : 2 * decode_config(d).stages * decode_config(d).block_n * (d + kPad) * 2;
}
// Dynamic shared memory of one split CTA (the layout in the header).
__host__ __device__ constexpr int decode_smem_bytes(int d, bool fp8 = false) {
    return kMaxRows * (d + kPad) * 2 + decode_kv_bytes(d, fp8) + 2 * decode_config(d).block_n * 4;
}
// The key groups' exchange after the loop, inside the K/V stages: acc, then the row maxima and sums.
__host__ __device__ constexpr int decode_exchange_bytes(int d) {
    return kWarps * 16 * (d + kAccPad) * 4 + kWarps * 2 * 16 * 4;
}

// The host's launch numbers (q12drv.kernels.attention_decode.CONTRACTS) must be the source's.
#if !defined(Q12_DECODE_MAX_Q_LEN) || !defined(Q12_DECODE_MAX_ROWS) || !defined(Q12_DECODE_MERGE_THREADS) ||    \
    !defined(Q12_DECODE_D64_THREADS) || !defined(Q12_DECODE_D64_BLOCK_N) || !defined(Q12_DECODE_D64_SMEM) ||    \
    !defined(Q12_DECODE_D128_THREADS) || !defined(Q12_DECODE_D128_BLOCK_N) || !defined(Q12_DECODE_D128_SMEM) || \
    !defined(Q12_DECODE_D256_THREADS) || !defined(Q12_DECODE_D256_BLOCK_N) || !defined(Q12_DECODE_D256_SMEM) || \
    !defined(Q12_DECODE_D64_FP8_SMEM) || !defined(Q12_DECODE_D128_FP8_SMEM) || !defined(Q12_DECODE_D256_FP8_SMEM)
#error "compile through q12drv (registry.compile_defines): it passes the host's tiles (-DQ12_DECODE_*)"
#endif
static_assert(Q12_DECODE_MAX_Q_LEN == kMaxQLen, "the new tokens a stream may have differ from the host's");
static_assert(Q12_DECODE_MAX_ROWS == kMaxRows, "the CTA rows a stream may have differ from the host's");
static_assert(Q12_DECODE_MERGE_THREADS == kMergeThreads, "the merge's threads per CTA differ from the host's");
#define DECODE_CONTRACT(D)                                                                                         \
    static_assert(Q12_DECODE_D##D##_THREADS == kThreads, "D" #D ": threads per CTA differ from the host's");       \
    static_assert(Q12_DECODE_D##D##_BLOCK_N == decode_config(D).block_n, "D" #D ": keys per tile differ from the host's"); \
    static_assert(Q12_DECODE_D##D##_SMEM == decode_smem_bytes(D), "D" #D ": shared memory differs from the host's");  \
    static_assert(Q12_DECODE_D##D##_FP8_SMEM == decode_smem_bytes(D, true),                                       \
                  "D" #D ": shared memory (FP8 pools) differs from the host's");                                   \
    static_assert(decode_exchange_bytes(D) <= decode_kv_bytes(D), "D" #D ": the exchange must fit the K/V stages");  \
    static_assert(decode_exchange_bytes(D) <= decode_kv_bytes(D, true), "D" #D ": the exchange must fit (FP8)");
DECODE_CONTRACT(64)
DECODE_CONTRACT(128)
DECODE_CONTRACT(256)
#undef DECODE_CONTRACT

// The key tiles a stream's splits share: from the tile of the first key its first token sees (the causal bound
// kv_len - q_len less window_left, written so that it cannot overflow; 0 without a window) to the last.
struct KeyTiles {
    int t_lo, n_tiles;
};
template <int BN>
__device__ __forceinline__ KeyTiles key_tiles(int q_len, int kv_len, int window_left) {
    const int shift = kv_len - q_len;
    return {(max(shift, window_left) - window_left) / BN, kv_len > 0 ? (kv_len + BN - 1) / BN : 0};
}
// Key tiles per split: the stream's tiles cut into num_splits contiguous ranges (at least one tile each).
__device__ __forceinline__ int tiles_per_split(KeyTiles k, int num_splits) {
    return max(1, (k.n_tiles - k.t_lo + num_splits - 1) / num_splits);
}

// Wait for the grid this one depends on (a programmatic dependent launch) and its memory; a no-op otherwise.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// x += a * src[0..7] (two 16-byte loads of fp32).
__device__ __forceinline__ void axpy8(float (&x)[8], float a, const float* src) {
    const float4 lo = reinterpret_cast<const float4*>(src)[0];
    const float4 hi = reinterpret_cast<const float4*>(src)[1];
    x[0] += a * lo.x; x[1] += a * lo.y; x[2] += a * lo.z; x[3] += a * lo.w;
    x[4] += a * hi.x; x[5] += a * hi.y; x[6] += a * hi.z; x[7] += a * hi.w;
}
// x[0..7] * s as bf16 into dst (one 16-byte store).
__device__ __forceinline__ void store_bf16x8(bf16* dst, const float (&x)[8], float s) {
    uint4 v;
    v.x = pack_bf16x2(x[0] * s, x[1] * s);
    v.y = pack_bf16x2(x[2] * s, x[3] * s);
    v.z = pack_bf16x2(x[4] * s, x[5] * s);
    v.w = pack_bf16x2(x[6] * s, x[7] * s);
    *reinterpret_cast<uint4*>(dst) = v;
}

// Eight e4m3 values (8 bytes, the first in the low byte) as eight bf16 (16 bytes), exactly: every e4m3 value is a bf16
// value. cvt gives f16x2 (the low byte in the low half), each half widened to fp32 and the pair packed as bf16x2.
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(const uint2 v) {
    const unsigned int w[2] = {v.x, v.y};
    unsigned int r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned short pair = static_cast<unsigned short>(w[i >> 1] >> (16 * (i & 1)));
        unsigned int h;
        float lo, hi;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(pair));
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(lo) : "h"(static_cast<unsigned short>(h & 0xffffu)));
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(hi) : "h"(static_cast<unsigned short>(h >> 16)));
        r[i] = pack_bf16x2(lo, hi);
    }
    return make_uint4(r[0], r[1], r[2], r[3]);
}

// What every warp of a split CTA knows about its work.
struct DecodeCta {
    int b, kvh, split, G;
    int row0, q_len, kv_len, rows;  // rows = q_len * G
    int t0, t1;                     // the split's key tiles
};

// KV: the pools' element type, bf16 or e4m3 (one byte; k_scale and v_scale the kv head's scales, unread for bf16).
template <typename KV, int D, int MT>
__device__ __forceinline__ void decode_body(const Q12Meta& m, const bf16* q, const KV* k_pool, const KV* v_pool,
                                            bf16* o, float* partial, int num_q_heads, int num_kv_heads,
                                            int block_size, float scale, int window_left, int num_splits,
                                            const DecodeCta& c, float k_scale, float v_scale) {
    constexpr bool kFp8 = sizeof(KV) == 1;
    constexpr DecodeConfig C = decode_config(D);
    constexpr int BN = C.block_n;
    constexpr int ST = C.stages;
    constexpr int SF = C.fp8_stages;
    constexpr int RING = kFp8 ? SF : ST;    // stages of the cp.async ring
    constexpr int PRO = kFp8 ? SF : ST - 1; // tiles the prologue issues; iteration j issues tile j + PRO
    constexpr int KST = kFp8 ? 2 : ST;      // bf16 K/V tiles the MMAs read: the ring itself, or two converted ones
    constexpr int KW = kWarps / MT < BN / 16 ? kWarps / MT : BN / 16;  // key groups
    constexpr int CW = MT * KW;                                        // warps that compute
    constexpr int KPW = BN / KW;     // keys of a tile per computing warp
    constexpr int LD = D + kPad;     // smem row stride (elements)
    constexpr int ALD = D + kAccPad; // exchange row stride (floats)
    constexpr int CPR = D / 8;       // 16-byte chunks per row
    constexpr int KD = D / 16;       // k-steps of S = Q K^T
    constexpr int NSW = KPW / 8;     // 8-key n-tiles of S per warp
    constexpr int KN = KPW / 16;     // 16-key k-steps of O += P V per warp
    constexpr int ND = D / 8;        // 8-dim n-tiles of O
    constexpr int RPT = BN * CPR / kThreads;      // K/V rows each thread copies per tile
    constexpr int QPT = MT * 16 * CPR / kThreads; // Q rows each thread copies
    constexpr int kRowStep = kThreads / CPR;
    constexpr int KCE = 16 / static_cast<int>(sizeof(KV));  // K/V elements a 16-byte copy moves
    constexpr int KCPR = D / KCE;                            // 16-byte copies per K/V row
    constexpr int KRPT = BN * KCPR / kThreads;               // K/V rows each thread copies per tile
    constexpr int kKvRowStep = kThreads / KCPR;
    constexpr int UPT = BN * (D / 8) / kThreads;  // FP8: 8-value units of a tile each thread converts, K and V each
    static_assert(kThreads % CPR == 0 && RPT * kThreads == BN * CPR && QPT >= 1 && QPT * kThreads == MT * 16 * CPR,
                  "copy split");
    static_assert(kThreads % KCPR == 0 && KRPT * kThreads == BN * KCPR && UPT * kThreads == BN * (D / 8),
                  "K/V copy split");
    static_assert(KPW % 16 == 0 && KW * KPW == BN && CW <= kWarps && MT * 16 <= kMaxRows, "warp split");
    static_assert(BN <= kThreads, "one thread per key row fills the slot array");
    static_assert(ST >= 2 && SF >= 3, "a ring of at least two stages (FP8: three, one being converted)");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const unsigned int sQa = smem_addr(smem_raw);
    const unsigned int sKa = sQa + kMaxRows * LD * 2;  // [KST][BN][LD]
    const unsigned int sVa = sKa + KST * BN * LD * 2;  // [KST][BN][LD]
    // FP8: the e4m3 ring after them, K [SF][BN][D] then V (byte offsets in smem_raw)
    constexpr int kRing8 = kMaxRows * LD * 2 + 2 * KST * BN * LD * 2;
    int* sSlot = reinterpret_cast<int*>(smem_raw + kMaxRows * LD * 2 + decode_kv_bytes(D, kFp8));  // [2][BN]
    float* sAcc = reinterpret_cast<float*>(smem_raw + kMaxRows * LD * 2);  // after the loop: [kWarps][16][ALD]
    float* sStat = sAcc + kWarps * 16 * ALD;                                // [kWarps][2][16]: max, sum

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int cr = tid / CPR;  // first Q row this thread copies
    const int cc = tid % CPR;  // its 16-byte chunk within a row
    const int kcr = tid / KCPR;  // and of K/V
    const int kcc = tid % KCPR;
    const int G = c.G;
    const long long head_stride = static_cast<long long>(num_kv_heads) * D;
    const int bs_shift = __ffs(block_size) - 1;
    const int bs_mask = block_size - 1;
    const int* bt = q12_block_table(m, c.b);
    const int max_key = c.kv_len - 1;   // the last key any row sees
    const int shift = c.kv_len - c.q_len;  // token i sees keys <= shift + i (and >= shift + i - window_left)
    // the largest first key over the CTA's tokens (0 without a window): tiles before it need the left mask
    const int left_to = max(shift + c.q_len - 1, window_left) - window_left;

    // Global row (token * Hq + head) of CTA row r (< rows).
    auto q_row = [&](int r) -> long long {
        return static_cast<long long>(c.row0 + r / G) * num_q_heads + c.kvh * G + r % G;
    };

    // Q rows 0 .. MT * 16 - 1: rows past the stream's are zero-filled and never read from global memory.
#pragma unroll
    for (int i = 0; i < QPT; ++i) {
        const int r = cr + i * kRowStep;
        const bool ok = r < c.rows;
        const bf16* src = ok ? q + q_row(r) * D + cc * 8 : q;
        cp_async16(sQa + (r * LD + cc * 8) * 2, src, ok ? 16 : 0);
    }

    // Pool slot (physical block * block_size + offset) of key position pos, -1 past max_key.
    auto slot_of = [&](int pos) -> int {
        return pos <= max_key ? (bt[pos >> bs_shift] << bs_shift) + (pos & bs_mask) : -1;
    };
    auto copy_row = [&](int slot, int r, int stage) {
        const bool ok = slot >= 0;
        long long off = 0;
        if (ok) off = static_cast<long long>(slot) * head_stride + static_cast<long long>(c.kvh) * D + kcc * KCE;
        if constexpr (kFp8) {
            const unsigned int dst = sQa + kRing8 + (stage * BN + r) * D + kcc * 16;
            cp_async16(dst, k_pool + off, ok ? 16 : 0);
            cp_async16(dst + SF * BN * D, v_pool + off, ok ? 16 : 0);
        } else {
            const unsigned int dst = ((stage * BN + r) * LD + kcc * 8) * 2;
            cp_async16(sKa + dst, k_pool + off, ok ? 16 : 0);
            cp_async16(sVa + dst, v_pool + off, ok ? 16 : 0);
        }
    };
    // K and V of the split's tile j into `stage`, their slots from the [2][BN] array (written by the threads
    // tid < BN beforehand).
    auto issue_kv = [&](int j, int stage) {
        const int* sl = sSlot + (j & 1) * BN;
#pragma unroll
        for (int i = 0; i < KRPT; ++i) {
            const int r = kcr + i * kKvRowStep;
            copy_row(sl[r], r, stage);
        }
    };
    // FP8: the e4m3 tile in ring stage fs as bf16 into tile b of the K and V the MMAs read, 8 values a unit, the
    // units of a warp contiguous (conflict-free 8-byte loads and 16-byte stores).
    auto convert_kv = [&](int fs, int b) {
        constexpr int UPR = D / 8;  // units per row
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int u = tid + i * kThreads;
            const int r = u / UPR;
            const int col = u % UPR;
            const unsigned char* src = smem_raw + kRing8 + (fs * BN + r) * D + col * 8;
            unsigned char* dst = smem_raw + kMaxRows * LD * 2 + ((b * BN + r) * LD + col * 8) * 2;
            *reinterpret_cast<uint4*>(dst) = e4m3x8_to_bf16x8(*reinterpret_cast<const uint2*>(src));
            *reinterpret_cast<uint4*>(dst + KST * BN * LD * 2) =
                e4m3x8_to_bf16x8(*reinterpret_cast<const uint2*>(src + SF * BN * D));
        }
    };
    const int nt = c.t1 - c.t0;  // tiles of this split; tile j holds keys (t0 + j) * BN ..
    const int key0 = c.t0 * BN;
    int pend_slot = -1;  // slot of row tid of the tile two issues ahead (loaded, not yet stored)

    // Tiles 0 .. PRO-1 now, one commit group each (possibly empty; Q rides in the first).
#pragma unroll
    for (int s = 0; s < PRO; ++s) {
        if (s < nt) {
#pragma unroll
            for (int i = 0; i < KRPT; ++i) {
                const int r = kcr + i * kKvRowStep;
                copy_row(slot_of(key0 + s * BN + r), r, s);
            }
        }
        cp_async_commit();
    }
    // Tile PRO (issued in iteration 0) into the slot array; tile PRO + 1 pending in a register.
    if (tid < BN) {
        sSlot[(PRO & 1) * BN + tid] = slot_of(key0 + PRO * BN + tid);
        pend_slot = slot_of(key0 + (PRO + 1) * BN + tid);
    }
    // FP8: iteration j computes bf16 tile j & 1, converted in iteration j - 1 (tile 0 here), and converts tile j + 1
    // into the other, which every warp finished reading in iteration j - 1; so the ring holds tiles j + 1 (being
    // converted) .. j + SF (issued in iteration j into the stage tile j left before that iteration's barrier).
    if constexpr (kFp8) {
        cp_async_wait<SF - 1>();  // group 0 (tile 0 and Q) complete
        __syncthreads();
        if (nt > 0) convert_kv(0, 0);
    }

    // scores in log2 units: exp(s*scale) = 2^(s*sl2); FP8: the raw e4m3 keys' scores, so scale * k_scale (one
    // constant a CTA, (scale * k_scale) * log2(e) in that order) instead of a product per key element
    const float sl2 = (kFp8 ? scale * k_scale : scale) * 1.4426950408889634f;
    const bool computes = warp < CW;
    const int mw = warp % MT;  // this warp's m-tile
    const int kg = warp / MT;  // and key group
    // Causal bounds of the thread's rows mw*16 + g and + 8 (rows past the stream's see every key loaded: never stored);
    // their first keys (max(bound, window_left) - window_left) are computed where a tile needs them.
    const int bound0 = shift + (mw * 16 + g) / G;
    const int bound1 = shift + (mw * 16 + g + 8) / G;

    float acc[ND][4];
#pragma unroll
    for (int j = 0; j < ND; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float row_max[2] = {-ATTN_INF, -ATTN_INF};
    float row_sum[2] = {0.f, 0.f};  // per-thread partial sums, reduced over the quad at the end

    const unsigned int q_lane = sQa + ((mw * 16 + (lane & 15)) * LD + (lane >> 4) * 8) * 2;
    const unsigned int k_lane = ((((lane & 7) + ((lane >> 4) << 3)) * LD) + ((lane >> 3) & 1) * 8) * 2;
    const unsigned int v_lane = (((lane & 15) * LD) + (lane >> 4) * 8) * 2;

    for (int j = 0; j < nt; ++j) {
        const int stage = kFp8 ? (j & 1) : j % ST;  // the bf16 tile the MMAs read
        // bf16: groups 0..j (tiles 0..j) complete; FP8: groups 0..j+1 (tile j+1, converted in this iteration)
        cp_async_wait<kFp8 ? SF - 2 : ST - 2>();
        __syncthreads();  // ... for every thread; and every warp is done with tile j-1's stage (FP8: and bf16 tile)
        const int jj = j + PRO;
        if (jj < nt) issue_kv(jj, jj % RING);
        cp_async_commit();  // one group per iteration, possibly empty
        // slot array half (jj + 1) & 1 was last read in iteration j - 1 (before the barrier)
        if (tid < BN) {
            sSlot[((jj + 1) & 1) * BN + tid] = pend_slot;
            pend_slot = slot_of(key0 + (jj + 2) * BN + tid);
        }
        if constexpr (kFp8) {
            if (j + 1 < nt) convert_kv((j + 1) % SF, (j + 1) & 1);
        }
        if (!computes) continue;

        // ---- S = Q K^T: the warp's 16 rows x its KPW keys ----
        float s[NSW][4];
#pragma unroll
        for (int i = 0; i < NSW; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
        const unsigned int kst = sKa + (stage * BN + kg * KPW) * LD * 2 + k_lane;
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            unsigned int a[4];
            ldmatrix_x4(a, q_lane + kk * 16 * 2);
#pragma unroll
            for (int j2 = 0; j2 < NSW / 2; ++j2) {
                unsigned int bk[4];
                ldmatrix_x4(bk, kst + (j2 * 16 * LD + kk * 16) * 2);
                mma_bf16(s[2 * j2], a, bk[0], bk[1]);
                mma_bf16(s[2 * j2 + 1], a, bk[2], bk[3]);
            }
        }

        // ---- causal and window masks (raw scores), on the tiles past the first row's bound or before the last
        // row's first key only ----
        const int kb = key0 + j * BN + kg * KPW;
        if (kb + KPW - 1 > shift || kb < left_to) {
            const int first0 = max(bound0, window_left) - window_left;
            const int first1 = max(bound1, window_left) - window_left;
#pragma unroll
            for (int i = 0; i < NSW; ++i) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kb + i * 8 + 2 * t + (e & 1);
                    if (key > (e < 2 ? bound0 : bound1) || key < (e < 2 ? first0 : first1)) s[i][e] = -ATTN_INF;
                }
            }
        }

        // ---- online softmax (row g + 8i; element e belongs to i = e >> 1), as attention/mma.cu ----
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = -ATTN_INF;
#pragma unroll
            for (int n = 0; n < NSW; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(row_max[i], mx * sl2);
            const float muse = mnew == -ATTN_INF ? 0.f : mnew;  // all masked so far: avoid inf - inf
            const float alpha = exp2_ftz(row_max[i] - muse);
            row_max[i] = mnew;
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < NSW; ++n) {
                s[n][2 * i] = exp2_ftz(fmaf(s[n][2 * i], sl2, -muse));
                s[n][2 * i + 1] = exp2_ftz(fmaf(s[n][2 * i + 1], sl2, -muse));
                sum += s[n][2 * i] + s[n][2 * i + 1];
            }
            row_sum[i] = row_sum[i] * alpha + sum;
#pragma unroll
            for (int d = 0; d < ND; ++d) {
                acc[d][2 * i] *= alpha;
                acc[d][2 * i + 1] *= alpha;
            }
        }

        // ---- O += P V ----
        const unsigned int vst = sVa + (stage * BN + kg * KPW) * LD * 2 + v_lane;
#pragma unroll
        for (int ks = 0; ks < KN; ++ks) {
            unsigned int a[4];
            a[0] = pack_bf16x2(s[2 * ks][0], s[2 * ks][1]);
            a[1] = pack_bf16x2(s[2 * ks][2], s[2 * ks][3]);
            a[2] = pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
            a[3] = pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
            for (int d2 = 0; d2 < ND / 2; ++d2) {
                unsigned int bv[4];
                ldmatrix_x4_trans(bv, vst + (ks * 16 * LD + d2 * 16) * 2);
                mma_bf16(acc[2 * d2], a, bv[0], bv[1]);
                mma_bf16(acc[2 * d2 + 1], a, bv[2], bv[3]);
            }
        }
    }
    cp_async_wait<0>();  // nt == 0: the Q copy may still be in flight
    __syncthreads();     // every warp is done with the stages: they hold the exchange now

    // ---- the key groups' (max, sum, acc) of every row into shared memory ----
    if (computes) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float l = row_sum[i];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            if (t == 0) {
                sStat[(warp * 2) * 16 + g + 8 * i] = row_max[i];
                sStat[(warp * 2 + 1) * 16 + g + 8 * i] = l;
            }
        }
        float* wacc = sAcc + warp * 16 * ALD;
#pragma unroll
        for (int d = 0; d < ND; ++d) {
            *reinterpret_cast<float2*>(wacc + g * ALD + d * 8 + 2 * t) = make_float2(acc[d][0], acc[d][1]);
            *reinterpret_cast<float2*>(wacc + (g + 8) * ALD + d * 8 + 2 * t) = make_float2(acc[d][2], acc[d][3]);
        }
    }
    __syncthreads();

    // ---- combine the key groups of each (row, 8-dim chunk), in group order; O or the split's partial ----
    const long long rows_total = static_cast<long long>(m.total_tokens) * num_q_heads;  // partial rows per split
    for (int it = tid; it < c.rows * CPR; it += kThreads) {
        const int r = it / CPR;
        const int ch = it % CPR;
        const int mt = r >> 4;
        const int rr = r & 15;
        float mx = -ATTN_INF;
#pragma unroll
        for (int k = 0; k < KW; ++k) mx = fmaxf(mx, sStat[((mt + k * MT) * 2) * 16 + rr]);
        float l = 0.f;
        float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (mx != -ATTN_INF) {
#pragma unroll
            for (int k = 0; k < KW; ++k) {
                const int w = mt + k * MT;
                const float a = exp2_ftz(sStat[(w * 2) * 16 + rr] - mx);
                l += a * sStat[(w * 2 + 1) * 16 + rr];
                axpy8(x, a, sAcc + (w * 16 + rr) * ALD + ch * 8);
            }
        }
        float inv = l > 0.f ? 1.f / l : 0.f;
        if constexpr (kFp8) inv *= v_scale;  // the raw e4m3 values' sum: V's scale on the row's 1 / L
        const long long grow = q_row(r);
        if (num_splits == 1) {
            store_bf16x8(o + grow * D + ch * 8, x, inv);
        } else {
            const long long prow = static_cast<long long>(c.split) * rows_total + grow;
            float4* dst = reinterpret_cast<float4*>(partial + prow * D + ch * 8);
            dst[0] = make_float4(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv);
            dst[1] = make_float4(x[4] * inv, x[5] * inv, x[6] * inv, x[7] * inv);
            if (ch == 0) partial[num_splits * rows_total * D + prow] = l > 0.f ? mx + log2f(l) : -ATTN_INF;
        }
    }
}

// KV: bf16, or e4m3 (one byte) with the kv heads' fp32 scales k_scale, v_scale [Hkv] (NULL and unread for bf16).
template <typename KV, int D>
__device__ __forceinline__ void attn_decode(const Q12Meta& m, const bf16* q, const KV* k_pool, const KV* v_pool,
                                            const float* k_scale, const float* v_scale, bf16* o, float* partial,
                                            int num_q_heads, int num_kv_heads, int block_size, float scale,
                                            int window_left, int num_splits) {
    static_assert(decode_head_dim(D), "head dims 64, 128 and 256");
    constexpr int BN = decode_config(D).block_n;
    DecodeCta c;
    c.b = blockIdx.z;
    c.kvh = blockIdx.y;
    c.split = blockIdx.x;
    if (c.b >= static_cast<int>(m.batch_size) || c.kvh >= num_kv_heads || c.split >= num_splits) return;
    c.G = num_q_heads / num_kv_heads;
    const int* cu = q12_cu_seqlens(m);
    c.row0 = cu[c.b];
    c.q_len = cu[c.b + 1] - c.row0;
    c.rows = c.q_len * c.G;
    // The host refuses longer streams; a CTA never computes rows it has no room for.
    if (c.q_len <= 0 || c.q_len > kMaxQLen || c.rows > kMaxRows) return;
    c.kv_len = q12_kv_lens(m)[c.b];
    const KeyTiles kt = key_tiles<BN>(c.q_len, c.kv_len, window_left);
    const int tps = tiles_per_split(kt, num_splits);
    c.t0 = min(kt.n_tiles, kt.t_lo + c.split * tps);
    c.t1 = min(kt.n_tiles, c.t0 + tps);
    // An empty split writes nothing (the merge reads only the non-empty ones); without splits the CTA writes O
    // whatever its range (zeros for a row that sees no key).
    if (num_splits > 1 && c.t0 >= c.t1) return;
    float ks = 1.f, vs = 1.f;
    if constexpr (sizeof(KV) == 1) {
        ks = __ldg(k_scale + c.kvh);
        vs = __ldg(v_scale + c.kvh);
    }
    if (c.rows <= 16) {
        decode_body<KV, D, 1>(m, q, k_pool, v_pool, o, partial, num_q_heads, num_kv_heads, block_size, scale,
                              window_left, num_splits, c, ks, vs);
    } else if (c.rows <= 32) {
        decode_body<KV, D, 2>(m, q, k_pool, v_pool, o, partial, num_q_heads, num_kv_heads, block_size, scale,
                              window_left, num_splits, c, ks, vs);
    } else {
        decode_body<KV, D, 4>(m, q, k_pool, v_pool, o, partial, num_q_heads, num_kv_heads, block_size, scale,
                              window_left, num_splits, c, ks, vs);
    }
}

template <int D>
__device__ __forceinline__ void attn_decode_merge(const Q12Meta& m, const float* partial, bf16* o, int num_q_heads,
                                                  int num_kv_heads, int window_left, int num_splits) {
    static_assert(decode_head_dim(D), "head dims 64, 128 and 256");
    constexpr int BN = decode_config(D).block_n;
    constexpr int TPR = D / 8;                  // threads per (token, head) row
    constexpr int RPC = kMergeThreads / TPR;    // rows per CTA
    static_assert(kMergeThreads % TPR == 0, "whole rows per CTA");
    const int b = blockIdx.z;
    if (b >= static_cast<int>(m.batch_size)) return;
    const int* cu = q12_cu_seqlens(m);
    const int row0 = cu[b];
    const int q_len = cu[b + 1] - row0;
    const int p = blockIdx.x * RPC + threadIdx.x / TPR;  // (token, head) pair of the stream
    // the streams the split kernel skips (the host refuses them), and the pairs past the stream's
    if (q_len > kMaxQLen || q_len * (num_q_heads / num_kv_heads) > kMaxRows || p >= q_len * num_q_heads) return;
    const int ch = threadIdx.x % TPR;
    const int kv_len = q12_kv_lens(m)[b];
    const KeyTiles kt = key_tiles<BN>(q_len, kv_len, window_left);
    const int tps = tiles_per_split(kt, num_splits);
    const int ns = (kt.n_tiles - kt.t_lo + tps - 1) / tps;  // the stream's non-empty splits
    const long long rows_total = static_cast<long long>(m.total_tokens) * num_q_heads;
    const long long grow = static_cast<long long>(row0) * num_q_heads + p;  // (token, head) row of Q and O
    const float* lse = partial + num_splits * rows_total * D;
    pdl_wait();
    float mx = -ATTN_INF;
    for (int s = 0; s < ns; ++s) mx = fmaxf(mx, lse[s * rows_total + grow]);
    float wsum = 0.f;
    float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (mx != -ATTN_INF) {
        for (int s = 0; s < ns; ++s) {
            const long long prow = s * rows_total + grow;
            const float w = exp2_ftz(lse[prow] - mx);
            wsum += w;
            axpy8(x, w, partial + prow * D + ch * 8);
        }
    }
    store_bf16x8(o + grow * D + ch * 8, x, wsum > 0.f ? 1.f / wsum : 0.f);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads) q12_attn_decode_d64(DECODE_PARAMS) { attn_decode<bf16, 64>(DECODE_ARGS); }
extern "C" __global__ void __launch_bounds__(kThreads) q12_attn_decode_d128(DECODE_PARAMS) { attn_decode<bf16, 128>(DECODE_ARGS); }
extern "C" __global__ void __launch_bounds__(kThreads) q12_attn_decode_d256(DECODE_PARAMS) { attn_decode<bf16, 256>(DECODE_ARGS); }
// The FP8 entries ask for one CTA an SM at least (D 64's shared memory fits two, its registers too): without a
// minimum ptxas trades registers for occupancy on them and spills (docs/kernels/attention_decode.md).
extern "C" __global__ void __launch_bounds__(kThreads, 1) q12_attn_decode_fp8_d64(DECODE_FP8_PARAMS) {
    attn_decode<unsigned char, 64>(DECODE_FP8_ARGS);
}
extern "C" __global__ void __launch_bounds__(kThreads, 1) q12_attn_decode_fp8_d128(DECODE_FP8_PARAMS) {
    attn_decode<unsigned char, 128>(DECODE_FP8_ARGS);
}
extern "C" __global__ void __launch_bounds__(kThreads, 1) q12_attn_decode_fp8_d256(DECODE_FP8_PARAMS) {
    attn_decode<unsigned char, 256>(DECODE_FP8_ARGS);
}
extern "C" __global__ void __launch_bounds__(kMergeThreads) q12_attn_decode_merge_d64(DECODE_MERGE_PARAMS) {
    attn_decode_merge<64>(DECODE_MERGE_ARGS);
}
extern "C" __global__ void __launch_bounds__(kMergeThreads) q12_attn_decode_merge_d128(DECODE_MERGE_PARAMS) {
    attn_decode_merge<128>(DECODE_MERGE_ARGS);
}
extern "C" __global__ void __launch_bounds__(kMergeThreads) q12_attn_decode_merge_d256(DECODE_MERGE_PARAMS) {
    attn_decode_merge<256>(DECODE_MERGE_ARGS);
}
