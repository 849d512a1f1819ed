// attn_wgmma.cu: batched varlen paged causal prefill attention on Hopper's warpgroup MMA (wgmma,
// compiled for sm_90a). Same entry parameters, semantics and batched == alone guarantee as
// attn_prefill.cu (see its header): stream b = blockIdx.z, bottom-right causal over kv_lens[b],
// keys and values gathered through the stream's block table, GQA kv_head = h / (Hq / Hkv).
// ops.attention's algo "auto" (the default) takes this kernel on Hopper for head dims 128 and 256.
//
// CTA: WG warpgroups (128 threads each), BM = 64 * WG rows. Rows are (token, head) pairs of one kv
// head (blockIdx.y): CTA row r is token (m0 + r) / G, query head kvh * G + (m0 + r) % G, G = Hq / Hkv,
// so one K/V tile serves the G query heads that read it. Warpgroup w owns rows 64w .. 64w + 63.
// Per key tile of BN keys (two-stage cp.async ring; every thread copies and computes):
//   S[64 x BN] = Q K^T: D/16 wgmma (A = Q, B = K, both K-major from shared memory);
//   causal mask, online softmax in fp32 registers (exp2 with the scale folded in, as attn_prefill);
//   O[64 x D] += P V: BN/16 wgmma, A = P from registers (bf16), B = V (MN-major) from shared memory.
// Stage hand-off (MB 1): per stage a "full" mbarrier (every thread's cp.async of the tile landed) and
// an "empty" one (every thread is done with it), instead of a CTA barrier per tile, so the two
// warpgroups drift up to a tile apart and one's GEMMs overlap the other's softmax.
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
#include "q12_meta.cuh"
#include "wgmma.cuh"

namespace {

#define ATTNW_INF __int_as_float(0x7f800000)

__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// mbarriers in shared memory (ATTN_WG_D<d>_MB): init by one thread; every copying thread's cp.async
// completion arrives on a stage's "full" barrier, every consuming thread arrives on its "empty" one.
__device__ __forceinline__ void mbar_init(unsigned addr, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned addr) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void mbar_arrive_on_copies(unsigned addr) {  // when this thread's cp.async so far land
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned addr, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(addr), "r"(parity) : "memory");
    }
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

template <int D, int BN, int WG, int MB, int SW>
__device__ __forceinline__ void attn_wgmma(const Q12Meta& m, const bf16* q, const bf16* k_pool, const bf16* v_pool,
                                           bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
    constexpr int kThreads = WG * 128;
    constexpr int kBM = WG * 64;               // CTA rows ((token, head) pairs)
    constexpr int CPR = D / 8;                 // 16-byte chunks per row
    constexpr int KD = D / 16;                 // k-steps of S = Q K^T
    constexpr int KN = BN / 16;                // k-steps of O += P V
    constexpr int NS = BN / 8;                 // 8-key tiles of S
    constexpr int ND = D / 8;                  // 8-dim tiles of O
    using KVMap = CopyMap<BN, CPR, WG * 4>;
    using QMap = CopyMap<kBM, CPR, WG * 4>;
    constexpr unsigned kQBytes = kBM * D * 2;
    constexpr unsigned kTileBytes = BN * D * 2;  // one stage of K (or V)
    constexpr int OLD = D + 8;                   // epilogue row stride (elements)
    static_assert(kBM * OLD * 2 <= 4 * kTileBytes, "the output tile must fit the K/V stages");

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
    const unsigned sVa = sKa + 2 * kTileBytes;  // [2][D/8][BN][8]

    const int tid = threadIdx.x;
    const long long head_stride = static_cast<long long>(num_kv_heads) * D;
    auto q_row = [&](int r) -> long long {  // global row (token * Hq + head) of CTA row r
        const int p = m0 + r;
        return static_cast<long long>(row0 + p / G) * num_q_heads + kvh * G + p % G;
    };

    const int cw = tid >> 5;  // warp in the CTA (copy maps)
    const int lane = tid & 31;
    {  // Q tile; rows past the stream are zero-filled and never read
        long long src[QMap::NR];
#pragma unroll
        for (int j = 0; j < QMap::NR; ++j) {
            const int r = QMap::row(cw, lane, j);
            src[j] = r < rows_here ? q_row(r) * D : -1;
        }
#pragma unroll
        for (int i = 0; i < QMap::PT; ++i) {
            const int j = QMap::slot(i), r = QMap::row(cw, lane, j), c = QMap::chunk(cw, lane, i);
            const bool ok = src[j] >= 0;
            cp_async16(sQa + tile_off<kBM, SW>(r, c), q + (ok ? src[j] + c * 8 : 0), ok ? 16 : 0);
        }
    }
    // The physical blocks of this thread's KVMap::NR key rows of tile n (-1 past max_key): loaded one
    // tile before the copies that use them, so the copies never wait for the block-table read.
    auto load_pages = [&](int n, int (&pg)[KVMap::NR]) {
#pragma unroll
        for (int j = 0; j < KVMap::NR; ++j) {
            const int pos = n * BN + KVMap::row(cw, lane, j);
            pg[j] = pos > max_key ? -1 : bt[pos / block_size];
        }
    };
    auto issue_rows = [&](unsigned base, const bf16* pool, int n, const int (&pg)[KVMap::NR], int stage) {
        long long off[KVMap::NR];
#pragma unroll
        for (int j = 0; j < KVMap::NR; ++j) {
            const int pos = n * BN + KVMap::row(cw, lane, j);
            off[j] = pg[j] < 0 ? -1
                               : (static_cast<long long>(pg[j]) * block_size + pos % block_size) * head_stride +
                                     static_cast<long long>(kvh) * D;
        }
#pragma unroll
        for (int i = 0; i < KVMap::PT; ++i) {
            const int j = KVMap::slot(i), r = KVMap::row(cw, lane, j), c = KVMap::chunk(cw, lane, i);
            const bool ok = off[j] >= 0;
            cp_async16(base + stage * kTileBytes + tile_off<BN, SW>(r, c), pool + (ok ? off[j] + c * 8 : 0), ok ? 16 : 0);
        }
    };

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
    if constexpr (MB) {
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
            issue_rows(sKa, k_pool, 0, pg_a, 0);
            issue_rows(sVa, v_pool, 0, pg_a, 0);
            mbar_arrive_on_copies(bars);  // full[0], phase 0: Q and tile 0
        }
        load_pages(1, pg_a);  // pg_a: tile n + 1's pages
        for (int n = 0; n < n_tiles; ++n) {
            const int stage = n & 1;
            if (n + 1 < n_tiles) {
                if (n >= 1) mbar_wait(bars + 16 + 8 * (stage ^ 1), ((n - 1) >> 1) & 1);  // tile n - 1 consumed
                issue_rows(sKa, k_pool, n + 1, pg_a, stage ^ 1);
                issue_rows(sVa, v_pool, n + 1, pg_a, stage ^ 1);
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
            issue_rows(sKa, k_pool, 0, pg_a, 0);
            issue_rows(sVa, v_pool, 0, pg_a, 0);
        }
        cp_async_commit();  // Q + tile 0
        load_pages(1, pg_a);  // pg_a: tile n + 1's pages
        for (int n = 0; n < n_tiles; ++n) {
            const int stage = n & 1;
            cp_async_wait_all();     // tile n (and Q) landed for this thread
            wg::fence_proxy_async(); // ... visible to wgmma
            __syncthreads();         // ... for every thread; every warpgroup is done with tile n - 1's stage
            if (n + 1 < n_tiles) {
                issue_rows(sKa, k_pool, n + 1, pg_a, stage ^ 1);
                issue_rows(sVa, v_pool, n + 1, pg_a, stage ^ 1);
            }
            cp_async_commit();
            load_pages(n + 2, pg_a);
            compute_tile(n, stage);
        }
    }
    cp_async_wait_all();  // n_tiles == 0: the Q copy may still be in flight
    __syncthreads();      // every wgmma is done with the K/V stages: the output tile goes there

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
    __syncthreads();
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
// ATTN_WG_D<d>_SW 1: Q, K and V tiles in the 128-byte swizzled layout (0: the interleaved one).
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

extern "C" __global__ __launch_bounds__(ATTN_WG_D128_WG * 128) void q12_attn_wgmma_d128(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
    attn_wgmma<128, ATTN_WG_D128_BN, ATTN_WG_D128_WG, ATTN_WG_D128_MB, ATTN_WG_D128_SW>(m, q, k_pool, v_pool, o, num_q_heads, num_kv_heads, block_size, scale);
}

extern "C" __global__ __launch_bounds__(ATTN_WG_D256_WG * 128) void q12_attn_wgmma_d256(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
    attn_wgmma<256, ATTN_WG_D256_BN, ATTN_WG_D256_WG, ATTN_WG_D256_MB, ATTN_WG_D256_SW>(m, q, k_pool, v_pool, o, num_q_heads, num_kv_heads, block_size, scale);
}
