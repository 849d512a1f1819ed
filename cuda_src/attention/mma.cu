// attn_prefill.cu: batched varlen paged causal prefill attention (FA2-style, sm_90 mma.sync).
//
// One CTA = BM = NW * MW * 16 query rows (NW warps, each MW sub-tiles of 16 rows) of one stream
// b (= blockIdx.z) and one query head h (= blockIdx.y). The CTA walks key tiles of BN keys from
// key 0 up to the last key its rows may see, gathering K/V rows from the paged pools through the
// stream's block table with cp.async (two-stage ring), computing S = Q K^T and O += P V with
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate) and an fp32 online softmax in registers.
//
// Semantics: q_len = cu[b+1] - cu[b], kv_len = kv_lens[b]; row r (0-based in the stream's chunk)
// sees keys 0 .. kv_len - q_len + r (bottom-right causal); kv_head = h / (Hq / Hkv). block_size is a
// power of two (the stager's rule; the kernel finds a key's page and row by shift and mask).
// A CTA never spans two streams, and what it computes depends only on (b, m-tile, h) and that
// stream's data, so batched and single-stream launches give bit-identical results.
//
// Measured on the H200 (tests/GPU.md session 2, runs C-F; Hq 16, Hkv 2, block 16), q12drv time /
// torch SDPA FLASH (FA2) time on gathered K/V: D128 fresh 8 x 2048 0.96-1.07, 4 x 4096 0.96-0.99, ragged
// 8 x 256..4096 0.89-1.00, chunked 2048 on 8192 0.94-1.07. D256 with 8 warps x 16 rows (runs C-E): fresh
// 1.03-1.11, ragged 0.99-1.05, chunked 0.95-1.03; with the DS default (run F, ecb0a5f): fresh 0.96,
// ragged 0.91, chunked 0.89-0.92 (6-8% faster than the 8 x 16 build in the same run). Against cuDNN:
// 1.4-2.2x its time fresh (it uses wgmma), 1.16-1.53 ragged, 0.66-0.94 chunked. Tried and not promoted:
// 4 warps x 16 rows with MINB 3-4 or Q in registers (+5..50%), BN 32 with 3-4 stages at D256 (+15..20%),
// DS (two warps share 32 rows) at D128 (+15..30%). DS is the D256 default (MW 2, DS 1; 254 regs, 0 spills
// on NVRTC 13.0 with the block-table pointer reloaded in slot_of, 249 on 13.5; tests/gpu/attn_variants.py
// v-d256-ds0 is the previous 8 warps x 16 rows).
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
//
// Shared memory rows are padded by 8 bf16 (16 B): row stride D*2+16 bytes moves each of the 8
// rows of an ldmatrix phase 4 banks on, so the 8 x 16 B of a phase hit 32 distinct banks.
// ---------------------------------------------------------------------------------------------
#include "common/q12_meta.cuh"
#include <cuda_bf16.h>

namespace {

constexpr int kPad = 8;           // bf16 of padding per smem row
#define ATTN_INF __int_as_float(0x7f800000)  // +inf (NVRTC has no INFINITY macro)

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_bytes = 0 fills the 16 bytes with zeros (no read).
__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], unsigned int addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], unsigned int addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// d += A * B for one m16n8k16 tile (layouts in the header comment).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                         unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x with one MUFU.EX2: ex2.approx (the instruction exp2f also uses, ~2 ulp) with .ftz, so a
// result below 2^-126 flushes to 0 (irrelevant for softmax weights, which are <= 1 and summed in
// fp32); exp2f's non-ftz form adds range-fixup instructions on the softmax's critical path.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Named barrier of the 64 threads of one warp pair (id 1..8; __syncthreads uses 0).
__device__ __forceinline__ void pair_sync(int id) {
    asm volatile("bar.sync %0, 64;\n" ::"r"(id) : "memory");
}

// Two floats -> bf16x2 (round to nearest even), x in the low half.
__device__ __forceinline__ unsigned int pack_bf16x2(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<unsigned int*>(&v);
}

// Compile-time configuration of one entry (template arguments of attn_prefill):
//   D      head dim; BN keys per K/V tile; NW warps; MW 16-row sub-tiles per warp (a warp owns
//          16 * MW query rows; the CTA NW * MW * 16).
//   QREG   keep the Q fragments in registers for the whole loop instead of re-reading them from
//          shared memory each tile (costs KD*MW*4 registers).
//   ST     K/V pipeline: 0 = the two-stage ring with two __syncthreads per tile (the shipped
//          loop); >= 2 = an ST-stage ring with one __syncthreads per tile (tile n + ST - 1 is
//          issued right after the barrier that proves tile n - 1's stage is free).
//   PSMEM  page lookups through shared memory: one block-table load per key row per tile, done
//          by one thread two tiles ahead and kept in an int [2][BN] slot array, instead of each
//          thread holding the pages of all its copy rows in registers (RPT registers). Needs ST >= 2.
//   GQA    pack the G = Hq / Hkv query heads of one kv head into the CTA's rows: CTA row r is the
//          pair (token (m0 + r) / G, head kvh * G + (m0 + r) % G); grid (ceil(chunk * G / BM), Hkv, n).
//          Each K/V tile then serves G heads at once (a CTA covers BM / G tokens).
//   WSKIP  a warp skips the math of key tiles that lie entirely above all of its rows (causal);
//          it still takes part in the barriers and copies. Bit-identical (such a tile adds exact zeros).
//   DS     warp pairs split the work of 16 * MW rows (needs MW = 2, even NW, BN % 32 == 0): in
//          S = Q K^T warp half hw takes keys hw * BN/2 .. +BN/2, in O += P V head dims hw * D/2 ..
//          +D/2; the pair exchanges row maxima and P (bf16) through shared memory with a named
//          64-thread barrier (two per tile) and the row sums at the end. Each K and V fragment then
//          feeds two m16 sub-tiles (half the ldmatrix traffic of MW=1) while a warp holds only D/2
//          accumulator columns (MW=2 at D=256 would need 256 accumulator registers). CTA rows
//          NW * MW * 8. Same P and row maxima as without; the row sum adds two partial sums.
// Every configuration computes each row with the same arithmetic in the same order for a given BN,
// so the result of a row depends only on BN (and not on the other knobs) up to the S tile split.
template <int D, int BN, int NW, int MW, int QREG, int ST = 0, int PSMEM = 0, int GQA = 0, int WSKIP = 0,
          int DS = 0>
__device__ __forceinline__ void attn_prefill(const Q12Meta& m, const bf16* q, const bf16* k_pool,
                                             const bf16* v_pool, bf16* o, int num_q_heads,
                                             int num_kv_heads, int block_size, float scale) {
    constexpr int kThreads = NW * 32;     // NW warps
    constexpr int kWR = MW * 16;          // query rows per warp: MW sub-tiles of 16
    constexpr int kBM = NW * kWR / (DS ? 2 : 1);  // query rows per CTA (warp pairs share rows with DS)
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
    constexpr int NST = ST == 0 ? 2 : ST;     // K/V stages in shared memory
    static_assert(kThreads % CPR == 0 && RPT * kThreads == BN * CPR && QPT * kThreads == kBM * CPR, "copy split");
    static_assert(BN % 16 == 0 && D % 16 == 0, "tile shape");
    static_assert(ST == 0 || ST >= 2, "stages");
    static_assert(!PSMEM || (ST >= 2 && BN <= kThreads), "PSMEM needs the one-barrier ring and BN <= threads");
    static_assert(!DS || (MW == 2 && NW % 2 == 0 && BN % 32 == 0), "DS: warp pairs of 32 rows, BN % 32 == 0");

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
    const int n_tiles = max_key >= 0 ? max_key / BN + 1 : 0;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
    const unsigned int sQa = smem_addr(sQ);
    const unsigned int sKa = sQa + kBM * LD * 2;         // [NST][BN][LD]
    const unsigned int sVa = sKa + NST * BN * LD * 2;    // [NST][BN][LD]
    int* sSlot = reinterpret_cast<int*>(smem_raw + (kBM + 2 * NST * BN) * LD * 2);  // [2][BN] (PSMEM)
    // DS: per pair a P tile [32][PLD] bf16, then row maxima / sums float [NW/2][2 halves][32 rows].
    const unsigned int sPa = smem_addr(smem_raw) + (kBM + 2 * NST * BN) * LD * 2 + (PSMEM ? 2 * BN * 4 : 0);
    float* sRed = reinterpret_cast<float*>(smem_raw + (kBM + 2 * NST * BN) * LD * 2 + (PSMEM ? 2 * BN * 4 : 0) +
                                           (DS ? (NW / 2) * 32 * PLD * 2 : 0));

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

    // Physical pages of this thread's rows of the next tile to copy (-1: key past max_key).
    int page[PSMEM ? 1 : RPT];
    auto fetch_pages = [&](int n) {
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int pos = n * BN + cr + i * kRowStep;
            page[PSMEM ? 0 : i] = pos <= max_key ? bt[pos >> bs_shift] : -1;
        }
    };
    auto issue_kv = [&](int n, int stage) {
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int r = cr + i * kRowStep;
            const int pos = n * BN + r;
            const bool ok = page[PSMEM ? 0 : i] >= 0;
            long long off = 0;
            if (ok) {
                off = ((static_cast<long long>(page[PSMEM ? 0 : i]) << bs_shift) + (pos & bs_mask)) * head_stride +
                      static_cast<long long>(kvh) * D + cc * 8;
            }
            const unsigned int dst = ((stage * BN + r) * LD + cc * 8) * 2;
            cp_async16(sKa + dst, k_pool + off, ok ? 16 : 0);
            cp_async16(sVa + dst, v_pool + off, ok ? 16 : 0);
        }
    };
    // PSMEM: slots of tile n from the [2][BN] array (written by the threads tid < BN beforehand).
    auto issue_kv_smem = [&](int n, int stage) {
        const int* sl = sSlot + (n & 1) * BN;
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int r = cr + i * kRowStep;
            copy_row(sl[r], r, stage);
        }
    };
    int pend_slot = -1;  // PSMEM: slot of row tid of the tile two issues ahead (loaded, not yet stored)

    if constexpr (ST == 0) {
        if (n_tiles > 0) {
            fetch_pages(0);
            issue_kv(0, 0);
        }
        cp_async_commit();  // group: Q + KV tile 0
        if (n_tiles > 1) fetch_pages(1);
    } else {
        // Tiles 0 .. ST-2 now, one commit group each (possibly empty; Q rides in the first).
#pragma unroll
        for (int s = 0; s < ST - 1; ++s) {
            if (s < n_tiles) {
                if constexpr (PSMEM) {
#pragma unroll
                    for (int i = 0; i < RPT; ++i) {
                        const int r = cr + i * kRowStep;
                        copy_row(slot_of(s * BN + r), r, s);
                    }
                } else {
                    fetch_pages(s);
                    issue_kv(s, s);
                }
            }
            cp_async_commit();
        }
        if constexpr (PSMEM) {
            // Tile ST-1 (issued in iteration 0) into the slot array; tile ST pending in a register.
            if (tid < BN) {
                sSlot[((ST - 1) & 1) * BN + tid] = slot_of((ST - 1) * BN + tid);
                pend_slot = slot_of(ST * BN + tid);
            }
        } else if (ST - 1 < n_tiles) {
            fetch_pages(ST - 1);
        }
    }

    const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units: exp(s*scale) = 2^(s*sl2)
    const int wrow = m0 + wq * kWR;                // CTA-row index (stream row without GQA) of this warp's first row
    const int diag_from = shift + (GQA ? m0 / G : m0);  // smallest causal bound over the CTA's rows
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
    unsigned int qf[QREG ? MW : 1][QREG ? KD : 1][4];

    const unsigned int q_lane = sQa + ((wq * kWR + (lane & 15)) * LD + (lane >> 4) * 8) * 2;
    const unsigned int k_lane = ((((lane & 7) + ((lane >> 4) << 3)) * LD) + ((lane >> 3) & 1) * 8) * 2;
    const unsigned int v_lane = (((lane & 15) * LD) + (lane >> 4) * 8) * 2;

    for (int n = 0; n < n_tiles; ++n) {
        int stage;
        if constexpr (ST == 0) {
            stage = n & 1;
            if (n + 1 < n_tiles) {
                issue_kv(n + 1, stage ^ 1);  // that stage was last read in iteration n-1 (synced below)
                cp_async_commit();
                if (n + 2 < n_tiles) fetch_pages(n + 2);
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
        } else {
            stage = n % NST;
            cp_async_wait<(ST >= 2 ? ST - 2 : 0)>();  // groups 0..n (tiles 0..n) complete
            __syncthreads();  // ... for every thread; and every warp is done with tile n-1's stage
            const int nn = n + ST - 1;
            if (nn < n_tiles) {
                if constexpr (PSMEM) {
                    issue_kv_smem(nn, nn % NST);
                } else {
                    issue_kv(nn, nn % NST);
                    if (nn + 1 < n_tiles) fetch_pages(nn + 1);
                }
            }
            cp_async_commit();  // one group per iteration, possibly empty
            if constexpr (PSMEM) {
                // slot array half (nn + 1) & 1 was last read in iteration n - 1 (before the barrier)
                if (tid < BN) {
                    sSlot[((nn + 1) & 1) * BN + tid] = pend_slot;
                    pend_slot = slot_of((nn + 2) * BN + tid);
                }
            }
        }

        if (QREG && n == 0) {
#pragma unroll
            for (int mi = 0; mi < MW; ++mi)
#pragma unroll
                for (int kk = 0; kk < KD; ++kk)
                    ldmatrix_x4(qf[QREG ? mi : 0][QREG ? kk : 0], q_lane + (mi * 16 * LD + kk * 16) * 2);
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
            for (int mi = 0; mi < MW; ++mi) {
                if constexpr (QREG) {
#pragma unroll
                    for (int x = 0; x < 4; ++x) a[mi][x] = qf[QREG ? mi : 0][QREG ? kk : 0][x];
                } else {
                    ldmatrix_x4(a[mi], q_lane + (mi * 16 * LD + kk * 16) * 2);
                }
            }
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

        // ---- causal mask, on diagonal tiles only (raw scores; the scale is folded in below) ----
        if (kb + BN - 1 > diag_from) {
#pragma unroll
            for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
                for (int j = 0; j < NSW; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = kb + hw * (BN / 2) + j * 8 + 2 * t + (e & 1);
                        const int rr = wrow + mi * 16 + g + (e >> 1) * 8;
                        if (key > shift + (GQA ? rr / G : rr)) s[mi][j][e] = -ATTN_INF;
                    }
                }
            }
        }

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
                    continue;
                } else {
                a[mi][0] = pack_bf16x2(s[mi][2 * (DS ? 0 : ks)][0], s[mi][2 * (DS ? 0 : ks)][1]);
                a[mi][1] = pack_bf16x2(s[mi][2 * (DS ? 0 : ks)][2], s[mi][2 * (DS ? 0 : ks)][3]);
                a[mi][2] = pack_bf16x2(s[mi][2 * (DS ? 0 : ks) + 1][0], s[mi][2 * (DS ? 0 : ks) + 1][1]);
                a[mi][3] = pack_bf16x2(s[mi][2 * (DS ? 0 : ks) + 1][2], s[mi][2 * (DS ? 0 : ks) + 1][3]);
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
        if constexpr (ST == 0) __syncthreads();  // every warp is done with this stage before it is refilled
    }
    cp_async_wait<0>();  // n_tiles == 0: the Q copy may still be in flight
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

// Defaults (H200, 8 x 2048 fresh prefill, Hq 16 Hkv 2, tests/gpu/attn_variants.py): every head dim
// uses the one-barrier two-stage ring with block-table lookups through shared memory (ST=2,
// PSMEM=1: D128 0.90x FA2, D256 0.89x, vs 0.64x for the two-barrier loop); D=256 also packs the GQA
// group into the CTA and skips causal tiles per warp (GQA=1, WSKIP=1: 0.92x FA2).
// Tiles <D, BN, NW, MW, Q in registers>, chosen on the H200 (fresh 8k prefill, GQA 4/8):
// D=64: 8 warps x 16 rows, 100 regs, 2 CTAs/SM. D=128: 4 warps x 32 rows (each K/V fragment feeds
// two m16 sub-tiles, halving shared-memory traffic), BN=32 to stay under 255 registers without
// spills, 2 CTAs/SM. D=256: 8 warps in 4 pairs sharing 32 rows each (DS=1, MW=2: 128 CTA rows), BN=64, 1 CTA/SM
// (217.5 KiB of shared memory with the pairs' P tiles).
// Keep q12drv/kernels/attention.py (WARPS, WARP_SUBTILES, BLOCK_N, DEFAULT_CONFIG) in step; a CPU
// test checks the defaults below against it.
//
// Variants for measurement: every knob of every entry can be overridden at compile time with
// -D ATTN_D<d>_<KNOB>=value (d = 64, 128, 256; KNOB = BN, NW, MW, QREG, ST, PSMEM, GQA, WSKIP,
// MINB, DS; meanings at attn_prefill). MINB > 0 adds __launch_bounds__(NW * 32, MINB). The host side
// must use the same values: q12drv.kernels.attention.config(d, defines) / geometry(..., defines=).
#ifndef ATTN_D64_BN
#define ATTN_D64_BN 64
#endif
#ifndef ATTN_D64_NW
#define ATTN_D64_NW 8
#endif
#ifndef ATTN_D64_MW
#define ATTN_D64_MW 1
#endif
#ifndef ATTN_D128_BN
#define ATTN_D128_BN 32
#endif
#ifndef ATTN_D128_NW
#define ATTN_D128_NW 8
#endif
#ifndef ATTN_D128_MW
#define ATTN_D128_MW 2
#endif
#ifndef ATTN_D256_BN
#define ATTN_D256_BN 64
#endif
#ifndef ATTN_D256_NW
#define ATTN_D256_NW 8
#endif
#ifndef ATTN_D256_MW
#define ATTN_D256_MW 2
#endif
#ifndef ATTN_D64_QREG
#define ATTN_D64_QREG 0
#endif
#ifndef ATTN_D64_ST
#define ATTN_D64_ST 2
#endif
#ifndef ATTN_D64_PSMEM
#define ATTN_D64_PSMEM 1
#endif
#ifndef ATTN_D64_GQA
#define ATTN_D64_GQA 0
#endif
#ifndef ATTN_D64_WSKIP
#define ATTN_D64_WSKIP 0
#endif
#ifndef ATTN_D64_MINB
#define ATTN_D64_MINB 0
#endif
#ifndef ATTN_D64_DS
#define ATTN_D64_DS 0
#endif
#ifndef ATTN_D128_QREG
#define ATTN_D128_QREG 0
#endif
#ifndef ATTN_D128_ST
#define ATTN_D128_ST 2
#endif
#ifndef ATTN_D128_PSMEM
#define ATTN_D128_PSMEM 1
#endif
#ifndef ATTN_D128_GQA
#define ATTN_D128_GQA 1
#endif
#ifndef ATTN_D128_WSKIP
#define ATTN_D128_WSKIP 1
#endif
#ifndef ATTN_D128_MINB
#define ATTN_D128_MINB 0
#endif
#ifndef ATTN_D128_DS
#define ATTN_D128_DS 0
#endif
#ifndef ATTN_D256_QREG
#define ATTN_D256_QREG 0
#endif
#ifndef ATTN_D256_ST
#define ATTN_D256_ST 2
#endif
#ifndef ATTN_D256_PSMEM
#define ATTN_D256_PSMEM 1
#endif
#ifndef ATTN_D256_GQA
#define ATTN_D256_GQA 1
#endif
#ifndef ATTN_D256_WSKIP
#define ATTN_D256_WSKIP 1
#endif
#ifndef ATTN_D256_MINB
#define ATTN_D256_MINB 0
#endif
#ifndef ATTN_D256_DS
#define ATTN_D256_DS 1
#endif


#if ATTN_D64_MINB > 0
extern "C" __global__ __launch_bounds__(ATTN_D64_NW * 32, ATTN_D64_MINB) void q12_attn_prefill_d64(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
#else
extern "C" __global__ void q12_attn_prefill_d64(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
#endif
    attn_prefill<64, ATTN_D64_BN, ATTN_D64_NW, ATTN_D64_MW, ATTN_D64_QREG, ATTN_D64_ST, ATTN_D64_PSMEM, ATTN_D64_GQA, ATTN_D64_WSKIP, ATTN_D64_DS>(
        m, q, k_pool, v_pool, o, num_q_heads, num_kv_heads, block_size, scale);
}

#if ATTN_D128_MINB > 0
extern "C" __global__ __launch_bounds__(ATTN_D128_NW * 32, ATTN_D128_MINB) void q12_attn_prefill_d128(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
#else
extern "C" __global__ void q12_attn_prefill_d128(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
#endif
    attn_prefill<128, ATTN_D128_BN, ATTN_D128_NW, ATTN_D128_MW, ATTN_D128_QREG, ATTN_D128_ST, ATTN_D128_PSMEM, ATTN_D128_GQA, ATTN_D128_WSKIP, ATTN_D128_DS>(
        m, q, k_pool, v_pool, o, num_q_heads, num_kv_heads, block_size, scale);
}

#if ATTN_D256_MINB > 0
extern "C" __global__ __launch_bounds__(ATTN_D256_NW * 32, ATTN_D256_MINB) void q12_attn_prefill_d256(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
#else
extern "C" __global__ void q12_attn_prefill_d256(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale) {
#endif
    attn_prefill<256, ATTN_D256_BN, ATTN_D256_NW, ATTN_D256_MW, ATTN_D256_QREG, ATTN_D256_ST, ATTN_D256_PSMEM, ATTN_D256_GQA, ATTN_D256_WSKIP, ATTN_D256_DS>(
        m, q, k_pool, v_pool, o, num_q_heads, num_kv_heads, block_size, scale);
}
