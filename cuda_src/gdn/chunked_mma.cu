// gdn/chunked_mma.cu: Gated DeltaNet (Qwen3-Next) prefill over varlen streams, chunked (WY) form on bf16 tensor
// cores (mma.sync m16n8k16, fp32 accumulate): the fused kernel, the two kernels of the mma two-pass schedule, and
// the precompute kernel of the wgmma two-pass schedule (gdn/chunked_wgmma.cu has its sequential kernels). Same math,
// arguments and in-place state contract as gdn/recurrent.cu:
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
// The fused kernel (q12_gdn_mma_fused_d*): grid (dv/64, Hv, n), block 128 (4 warps); warp w owns dv columns
// 16w..16w+15 of the CTA's 64-column slice (a launch with any other grid.x or block does nothing). A CTA never
// mixes streams (batched == alone, bit for bit); the dv columns of S evolve independently, so slices never talk.
// Streams of length 0 are skipped (state untouched). The last chunk is partial: rows >= len load as zero (k, q,
// v, beta, g), so they change nothing, and their o is never written.
// Per chunk: cp.async (zero-fill past the stream) brings raw K, Q, the V slice, g and beta (the V slice, g and beta
// into one of two alternating buffers, so that chunk c's o rows leave without a barrier before chunk c + 1's
// loads); five barriers: the loads, the normalisation and gamma, the products, the diagonal inverses, the state
// step.
// Shared memory (dynamic, gdnc::Smem<dk>): bf16 K hi, K lo, Q [64][dk+8]; raw K [64][dk]; two bf16
// V/O slices [64][72]; -A (off-diagonal blocks), P [64][72]; bf16 diagonal inverses [64][24]; fp32
// diagonal blocks [4][16][17]; g, beta [2][64]; gamma, beta, exp(gamma), exp(gamma_C - gamma) [64]:
// 114,944 B (d128), 82,176 B (d64): 2 CTAs/SM at d128. Registers: the S^T slice, 64 fp32 (d128), and two
// 32-float accumulators, no spills (scalars the loop does not need in registers are re-read: ld_volatile).
// Per warp and chunk (d128): 80 mma for K K^T / Q K^T (warp w: K rows of block w, Q rows of
// block 3-w, causal tiles only), 64 K S, 40 solve, 64 Q S, 40 P V_new, 192 state update.
//
// Precision (q12drv.kernels.gdn.reference.chunked_reference, the numpy model of these kernels, against the float64
// reference; random inputs, non-zero initial state, up to 1100 tokens): o relative error ~3.7e-3 (the bf16
// rounding of o itself is ~2.5e-3), final state ~1e-4..3e-4. The state error is dominated by the update
// K^T V_new: with bf16 K and bf16 V_new it is ~1.7e-3, so that product uses hi + lo bf16 pairs of both (three
// mma: hi hi, lo hi, hi lo). V_new and the solve's intermediates always enter as hi + lo pairs; S enters K S and
// Q S as one bf16.
//
// The mma two-pass schedule: the chunk-local work (normalisation, gamma, K K^T, Q K^T, -A, P, the diagonal
// inverses) does not depend on the state, so q12_gdn_mma_precompute_d* does it for every (stream, key head, chunk)
// in parallel, grid (chunks, Hk, n), into a caller-provided workspace: a K record per (stream, key head, chunk)
// (K hi, K lo, Q: 48 KiB at d128), K K^T and Q K^T computed once per key head, and a V record per (stream, value
// head, chunk) (-A, P, inverses, beta, exp(gamma), exp(gamma_C - gamma): 18.75 KiB), each value head's beta and
// gamma applied in the epilogues (gdnc::PrepSmem: 64,000 B, 3 CTAs/SM). q12_gdn_mma_sequential_{2,1}stage_d* is
// the fused kernel's loop with only the state step on each chunk's serial path. Two stages (two record buffers,
// 167,424 B, 1 CTA/SM) load the next chunk's records while this one computes: for grids of few CTAs; one stage
// (83,712 B, 2 CTAs/SM) loads at the top of each chunk while the other CTA computes: for grids of >= 2 CTAs per
// SM. The same phase functions run on the same values: o and the final states are bit-identical to the fused
// kernel's. The workspace: n x ceil(chunk_len / 64) x (Hk x 48 KiB + Hv x 18.75 KiB) at d128.
//
// The wgmma two-pass schedule's precompute (q12_gdn_wgmma_precompute_d*): the same work, and the block solve
// applied to the identity, so its record (gdnc::TRec, one per (stream, value head, chunk), no K record) carries
// T = (I + A)^-1 instead of -A and the inverses, laid out as the wgmma sequential kernel's shared memory. Its
// products take the raw k and q rows (normalise<NORMS> computes only their scales) and its epilogues one
// ex2.approx an element, with beta, the decay and the scales folded into per-row and per-column exponents
// (chunk_gamma<true>). Each CTA first lets the sequential kernel launch (the host launches it with programmatic
// stream serialization): its CTAs may then start once every precompute CTA has started, copy their raw inputs and
// load their states on the SMs the precompute's last wave leaves free, and wait for this grid's completion
// (gdnc::pdl_wait) before the first record.
// The phases every kernel here shares, and the records, are in gdn/chunk.cuh.
// Requirements: q, k 16-byte aligned, v, o 8-byte aligned (as the recurrent kernel); dv a multiple of 64.
#include "gdn/chunk.cuh"

// ================================================================ the fused kernel
// grid (D / 64, Hv, n), 128 threads, dynamic smem Smem<D>.
template <int D>
__device__ __forceinline__ void fused_body(GDN_BODY_PARAMS) {
    using namespace gdnc;
    constexpr int DK = D, DV = D;
    if (gridDim.x != D / GDN_BV) return;
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
        if (c0 > 0) {
            issue_kvgb<DK, DV, true, true, true>(s, s.v[buf], cu + b, len, c0, buf, k, v, g, beta, num_k_heads, num_v_heads, h, col0,
                                     tid);
            issue_q<DK>(s, cu + b, len, c0, q, num_k_heads, num_v_heads, h, tid);
            cp_async_commit();
        }
        cp_async_wait_all();
        __syncthreads();   // B1: chunk c0's raw rows, V, g, beta in shared memory
        normalise<DK>(s, [&](int row, int sg) { return &s.klo[row * SM::LDK + sg * 8]; }, tid, seg, qscale);
        if (warp == 0) chunk_gamma(s, buf, lane);
        __syncthreads();   // B2: K, Q, gamma ready; kraw free
        local_products<DK>(s, warp, lane);
        __syncthreads();   // B3: -A, P (and the diagonal inverses) complete
        invert_diagonal<DK>(s, tid);
        __syncthreads();
        state_step<DK>(ChunkOps{s.k, s.klo, s.q, s.a, s.p, s.dinv, s.beta, s.eg, s.wd}, St, s.v[buf], warp, lane);
        __syncthreads();   // B4: O slice complete in s.v[buf]; s.q, s.k, s.a, s.p free
        // No barrier after the o store: s.v[buf] is next written by the load two chunks on, behind the next B1.
        store_o<DV>(o, s.v[buf], cu + b, len, c0, num_v_heads, h, col0, tid);
    }
    store_state<DK, DV>(St, reinterpret_cast<float*>(ld_volatile(h_state_ptrs + b)) + (long long)h * DK * DV, bv0, tq);
}

// ================================================================ the mma two-pass schedule
namespace gdnc {

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

// grid (ceil(chunk_len / 64), Hk, n), 128 threads, dynamic smem PrepSmem<D>: one CTA per precompute item
// (gdn/chunk.cuh's prep_item). WG: the wgmma two-pass schedule's records (TRec), its sequential kernel launched
// early (programmatic dependent launch).
template <int D, bool WG>
__device__ __forceinline__ void precompute_body(GDN_BODY_PARAMS) {
    using namespace gdnc;
    if constexpr (WG) pdl_launch_dependents();
    extern __shared__ __align__(16) unsigned char gdn_smem_raw[];
    const int b = blockIdx.z, kh = blockIdx.y, ci = blockIdx.x;
    if ((int)blockDim.x != 128 || b >= (int)m.batch_size || kh >= num_k_heads) return;
    const int* cu = q12_cu_seqlens(m);
    const int len = cu[b + 1] - cu[b];
    if (ci * GDN_C >= len) return;
    prep_item<D, D, WG>(m, q, k, g, beta, num_k_heads, num_v_heads, workspace, *reinterpret_cast<PrepSmem<D>*>(gdn_smem_raw),
                        b, kh, ci, len, threadIdx.x);
}

// grid (D / 64, Hv, n), 128 threads, dynamic smem SeqSmem<D, STAGES>: the fused kernel's chunk loop with the
// chunk-local work read from the records. STAGES 2: the next chunk's records load while this one computes
// (1 CTA/SM: for grids of few CTAs, where nothing else would hide the loads); STAGES 1: one buffer, loaded
// at the top of each chunk (2 CTAs/SM: for grids of several waves, where the other CTA computes meanwhile).
template <int D, int STAGES>
__device__ __forceinline__ void mma_sequential_body(GDN_BODY_PARAMS) {
    using namespace gdnc;
    constexpr int DK = D, DV = D;
    if (gridDim.x != D / GDN_BV) return;
    unsigned char* __restrict__ const ws = workspace;
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

// ================================================================ entries
// The host plans their grids (q12drv.kernels.gdn) and passes its sizes as contract defines, checked here.
#if !defined(Q12_GDN_MMA_FUSED_SMEM_D128) || !defined(Q12_GDN_MMA_FUSED_SMEM_D64) ||                            \
    !defined(Q12_GDN_PRECOMPUTE_SMEM_D128) || !defined(Q12_GDN_PRECOMPUTE_SMEM_D64) ||                           \
    !defined(Q12_GDN_MMA_SEQUENTIAL_SMEM_2STAGE_D128) || !defined(Q12_GDN_MMA_SEQUENTIAL_SMEM_2STAGE_D64) ||     \
    !defined(Q12_GDN_MMA_SEQUENTIAL_SMEM_1STAGE_D128) || !defined(Q12_GDN_MMA_SEQUENTIAL_SMEM_1STAGE_D64) ||     \
    !defined(Q12_GDN_MMA_KREC_D128) || !defined(Q12_GDN_MMA_KREC_D64) || !defined(Q12_GDN_MMA_VREC) ||           \
    !defined(Q12_GDN_TREC)
#error "compile through q12drv: it passes the host's shared memory and record sizes (-DQ12_GDN_MMA_*, -DQ12_GDN_PRECOMPUTE_SMEM_*, -DQ12_GDN_TREC)"
#endif
static_assert(sizeof(gdnc::Smem<128>) == Q12_GDN_MMA_FUSED_SMEM_D128 && sizeof(gdnc::Smem<64>) == Q12_GDN_MMA_FUSED_SMEM_D64,
              "the fused kernel's shared memory differs from the host's");
static_assert(sizeof(gdnc::PrepSmem<128>) == Q12_GDN_PRECOMPUTE_SMEM_D128 &&
                  sizeof(gdnc::PrepSmem<64>) == Q12_GDN_PRECOMPUTE_SMEM_D64,
              "the precompute kernels' shared memory differs from the host's");
static_assert(sizeof(gdnc::SeqSmem<128, 2>) == Q12_GDN_MMA_SEQUENTIAL_SMEM_2STAGE_D128 &&
                  sizeof(gdnc::SeqSmem<64, 2>) == Q12_GDN_MMA_SEQUENTIAL_SMEM_2STAGE_D64 &&
                  sizeof(gdnc::SeqSmem<128, 1>) == Q12_GDN_MMA_SEQUENTIAL_SMEM_1STAGE_D128 &&
                  sizeof(gdnc::SeqSmem<64, 1>) == Q12_GDN_MMA_SEQUENTIAL_SMEM_1STAGE_D64,
              "the mma sequential kernel's shared memory differs from the host's");
static_assert(gdnc::KRec<128>::BYTES == Q12_GDN_MMA_KREC_D128 && gdnc::KRec<64>::BYTES == Q12_GDN_MMA_KREC_D64 &&
                  gdnc::VRec::BYTES == Q12_GDN_MMA_VREC && gdnc::TRec::BYTES == Q12_GDN_TREC,
              "the record sizes differ from the host's");

constexpr int GDN_THREADS = chunked_config().threads;
constexpr int GDN_PRECOMPUTE_CTAS = chunked_config().precompute_ctas;
extern "C" __global__ void __launch_bounds__(GDN_THREADS) q12_gdn_mma_fused_d128(GDN_PARAMS) { fused_body<128>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(GDN_THREADS) q12_gdn_mma_fused_d64(GDN_PARAMS) { fused_body<64>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(GDN_THREADS, GDN_PRECOMPUTE_CTAS) q12_gdn_mma_precompute_d128(GDN_PARAMS) { precompute_body<128, false>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(GDN_THREADS, GDN_PRECOMPUTE_CTAS) q12_gdn_mma_precompute_d64(GDN_PARAMS) { precompute_body<64, false>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(GDN_THREADS, GDN_PRECOMPUTE_CTAS) q12_gdn_wgmma_precompute_d128(GDN_PARAMS) { precompute_body<128, true>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(GDN_THREADS, GDN_PRECOMPUTE_CTAS) q12_gdn_wgmma_precompute_d64(GDN_PARAMS) { precompute_body<64, true>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(GDN_THREADS) q12_gdn_mma_sequential_2stage_d128(GDN_PARAMS) { mma_sequential_body<128, 2>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(GDN_THREADS) q12_gdn_mma_sequential_2stage_d64(GDN_PARAMS) { mma_sequential_body<64, 2>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(GDN_THREADS) q12_gdn_mma_sequential_1stage_d128(GDN_PARAMS) { mma_sequential_body<128, 1>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(GDN_THREADS) q12_gdn_mma_sequential_1stage_d64(GDN_PARAMS) { mma_sequential_body<64, 1>(GDN_ARGS); }
