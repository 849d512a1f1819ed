// gdn/recurrent.cu: Gated DeltaNet (Qwen3-Next) prefill over varlen streams, token by token in fp32 (the
// recurrent form: the reference the chunked kernels are checked against).
//
// Per stream b (packed rows cu_seqlens[b] .. cu_seqlens[b+1]), per value head h (key head
// h / (Hv/Hk)), with the fp32 state S [dk, dv] of (b, h) at h_state_ptrs[b] + h*dk*dv:
//     k^ = k / sqrt(sum k^2 + 1e-6),  q~ = q / sqrt(sum q^2 + 1e-6) * dk^-1/2   (fp32)
//     S <- exp(g_t) * S;  m = S^T k^;  delta = beta_t * (v_t - m);  S <- S + k^ delta^T;  o_t = S^T q~
// The final state overwrites the initial one in place.
//
// Geometry (recurrent_config): grid (Hv * dv / columns, n, 1), block (threads, 1, 1), static shared memory only.
// A CTA owns `columns` (32) dv columns of one (stream, value head); the dv columns of S evolve independently,
// so CTAs never talk to each other and never mix streams (batched == alone, bit for bit).
// Register layout (LPC = 8 lanes per column group, CPT = 2 columns per thread): lane = LPC*group + sub; the
// thread owns columns cc .. cc+CPT-1 and, of each, the rows {4*LPC*c + 4*sub + e : c < dk/(4*LPC), e < 4}
// (16 rows x 2 columns = 32 fp32 for dk = 128). Every k/q read from shared memory is a float4 broadcast: the 8
// lanes of a quarter warp read 8 distinct consecutive float4 (one wavefront). Column dot products are reduced
// over the LPC lanes with xor shuffles (commutative adds: every lane of the group gets the same bits).
// Tokens go in chunks of `tokens` (16): the next chunk's raw q/k/v/g/beta are loaded into registers before the
// current chunk's serial loop runs, then l2-normalised into shared memory after it.
// Requirements: q, k 16-byte aligned (dk a multiple of 8), v, o 8-byte aligned.
#include "gdn/common.cuh"

// The kernel's configuration: threads a CTA, tokens staged a chunk, lanes that split dk for one dv column,
// dv columns a thread owns; `columns` (dv columns a CTA) follows. The host's grid takes threads and columns
// (q12drv.kernels.gdn.recurrent: the contract defines Q12_GDN_RECURRENT_*).
struct RecurrentConfig {
    int threads, tokens, lanes_per_column, columns_per_thread;
    __host__ __device__ constexpr int columns() const { return threads / lanes_per_column * columns_per_thread; }
};
__host__ __device__ constexpr RecurrentConfig recurrent_config() { return {128, 16, 8, 2}; }

#if !defined(Q12_GDN_RECURRENT_THREADS) || !defined(Q12_GDN_RECURRENT_COLUMNS)
#error "compile through q12drv: it passes the host's geometry (-DQ12_GDN_RECURRENT_THREADS=... -DQ12_GDN_RECURRENT_COLUMNS=...)"
#endif
static_assert(recurrent_config().threads == Q12_GDN_RECURRENT_THREADS, "threads a CTA differ from the host's");
static_assert(recurrent_config().columns() == Q12_GDN_RECURRENT_COLUMNS, "dv columns a CTA differ from the host's");

template <int DK, int DV>
__device__ __forceinline__ void recurrent_body(GDN_BODY_PARAMS) {
    constexpr RecurrentConfig CFG = recurrent_config();
    constexpr int THREADS = CFG.threads, CT = CFG.tokens, LPC = CFG.lanes_per_column;
    constexpr int CPT = CFG.columns_per_thread;
    constexpr int COLS = CFG.columns();   // dv columns per CTA
    static_assert(LPC == 2 || LPC == 4 || LPC == 8, "lanes per column");
    static_assert(DK % (4 * LPC) == 0 && DV % COLS == 0, "dk must be a multiple of 4*LPC, dv of the CTA's columns");
    constexpr int NC = DK / (4 * LPC);          // float4 groups per lane
    constexpr int R = NC * 4;                   // state rows per lane
    constexpr int V_PASSES = CT * COLS / (4 * THREADS);
    constexpr int SEGS = DK / 8;                // 16-byte segments per q/k row
    constexpr int ROWS_PER_PASS = THREADS / SEGS;
    constexpr int QK_PASSES = (2 * CT) / ROWS_PER_PASS;
    static_assert((2 * CT) % ROWS_PER_PASS == 0 && 32 % SEGS == 0, "q/k staging layout");
    static_assert(CT * COLS % (4 * THREADS) == 0, "v staging: whole 4-wide loads per thread");
    constexpr int SLICES = DV / COLS;

    __shared__ __align__(16) float s_q[CT][DK];
    __shared__ __align__(16) float s_k[CT][DK];
    __shared__ __align__(16) float s_v[CT][COLS];
    __shared__ float s_alpha[CT];
    __shared__ float s_beta[CT];
    __shared__ __align__(16) bf16 s_o[CT][COLS];

    const int b = blockIdx.y;
    if (b >= (int)m.batch_size || (int)blockIdx.x >= num_v_heads * SLICES) return;
    const int h = blockIdx.x / SLICES;
    const int col0 = (blockIdx.x % SLICES) * COLS;   // first dv column of this CTA
    const int kh = h / (num_v_heads / num_k_heads);
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int sub = lane % LPC;
    const int cc = (warp * (32 / LPC) + lane / LPC) * CPT;  // first of this thread's CPT columns in the slice
    const int col = col0 + cc;

    const int* cu = q12_cu_seqlens(m);
    const int tok0 = cu[b];
    const int len = cu[b + 1] - tok0;

    float* state = reinterpret_cast<float*>(h_state_ptrs[b]) + (long long)h * DK * DV;

    // Staging-thread roles (fixed for the whole kernel).
    const int qk_seg = tid % SEGS;
    const int qk_row0 = tid / SEGS;            // row = qk_row0 + p * ROWS_PER_PASS; token = row >> 1; q if even
    uint4 st_qk[QK_PASSES];
    uint2 st_v[V_PASSES];
    float st_gb = 0.f;

    auto load_chunk = [&](int c0) {             // raw loads of chunk starting at stream row c0
#pragma unroll
        for (int p = 0; p < QK_PASSES; ++p) {
            const int row = qk_row0 + p * ROWS_PER_PASS;
            const int t = c0 + (row >> 1);
            uint4 val = make_uint4(0u, 0u, 0u, 0u);
            if (t < len) {
                const bf16* src = (row & 1) ? k : q;
                val = *reinterpret_cast<const uint4*>(src + ((long long)(tok0 + t) * num_k_heads + kh) * DK + qk_seg * 8);
            }
            st_qk[p] = val;
        }
#pragma unroll
        for (int p = 0; p < V_PASSES; ++p) {
            const int idx = tid + p * THREADS;
            const int t = c0 + idx / (COLS / 4);
            st_v[p] = make_uint2(0u, 0u);
            if (t < len)
                st_v[p] = *reinterpret_cast<const uint2*>(v + ((long long)(tok0 + t) * num_v_heads + h) * DV + col0 + (idx % (COLS / 4)) * 4);
        }
        st_gb = 0.f;
        if (tid < 2 * CT) {
            const int t = c0 + (tid % CT);
            if (t < len) {
                const long long idx = (long long)(tok0 + t) * num_v_heads + h;
                st_gb = (tid < CT) ? g[idx] : beta[idx];
            }
        }
    };

    auto store_chunk = [&]() {                  // normalise the staged chunk into shared memory
        const float qscale = 1.0f / sqrtf((float)DK);
#pragma unroll
        for (int p = 0; p < QK_PASSES; ++p) {
            const int row = qk_row0 + p * ROWS_PER_PASS;
            float x[8];
            const float inv = gdn_row_inv_norm<SEGS>(st_qk[p], x);
            float* dst;
            if (row & 1) {
                dst = &s_k[row >> 1][qk_seg * 8];
            } else {
                dst = &s_q[row >> 1][qk_seg * 8];
            }
            float y[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) y[i] = (row & 1) ? x[i] * inv : (x[i] * inv) * qscale;
            reinterpret_cast<float4*>(dst)[0] = make_float4(y[0], y[1], y[2], y[3]);
            reinterpret_cast<float4*>(dst)[1] = make_float4(y[4], y[5], y[6], y[7]);
        }
#pragma unroll
        for (int p = 0; p < V_PASSES; ++p) {
            const int idx = tid + p * THREADS;
            const __nv_bfloat162* pv = reinterpret_cast<const __nv_bfloat162*>(&st_v[p]);
            const float2 a = __bfloat1622float2(pv[0]);
            const float2 c = __bfloat1622float2(pv[1]);
            reinterpret_cast<float4*>(&s_v[idx / (COLS / 4)][(idx % (COLS / 4)) * 4])[0] = make_float4(a.x, a.y, c.x, c.y);
        }
        if (tid < CT) s_alpha[tid] = expf(st_gb);
        else if (tid < 2 * CT) s_beta[tid - CT] = st_gb;
    };

    // This lane's slice of column `col` of S: S[r] = state[row(r)][col], row(4c+e) = 16c + 4sub + e.
    float S[CPT][R];
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
            for (int j = 0; j < CPT; ++j) S[j][4 * c + e] = state[(4 * LPC * c + 4 * sub + e) * DV + col + j];

    load_chunk(0);
    store_chunk();
    __syncthreads();

    for (int c0 = 0; c0 < len; c0 += CT) {
        const bool more = c0 + CT < len;
        if (more) load_chunk(c0 + CT);      // in flight during the serial loop below
        const int nt = min(CT, len - c0);

        for (int t = 0; t < nt; ++t) {
            const float a = s_alpha[t];
            const float bt = s_beta[t];
            const float4* kp = reinterpret_cast<const float4*>(&s_k[t][0]) + sub;
            const float4* qp = reinterpret_cast<const float4*>(&s_q[t][0]) + sub;
            float4 kr[NC];
            float p[CPT][4];
#pragma unroll
            for (int j = 0; j < CPT; ++j) p[j][0] = p[j][1] = p[j][2] = p[j][3] = 0.f;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                kr[c] = kp[LPC * c];
#pragma unroll
                for (int j = 0; j < CPT; ++j) {
                    S[j][4 * c + 0] *= a;
                    S[j][4 * c + 1] *= a;
                    S[j][4 * c + 2] *= a;
                    S[j][4 * c + 3] *= a;
                    p[j][0] = fmaf(S[j][4 * c + 0], kr[c].x, p[j][0]);
                    p[j][1] = fmaf(S[j][4 * c + 1], kr[c].y, p[j][1]);
                    p[j][2] = fmaf(S[j][4 * c + 2], kr[c].z, p[j][2]);
                    p[j][3] = fmaf(S[j][4 * c + 3], kr[c].w, p[j][3]);
                }
            }
            float d[CPT];
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                float mm = (p[j][0] + p[j][1]) + (p[j][2] + p[j][3]);
#pragma unroll
                for (int off = 1; off < LPC; off <<= 1) mm += __shfl_xor_sync(0xffffffffu, mm, off);
                d[j] = bt * (s_v[t][cc + j] - mm);
                p[j][0] = p[j][1] = p[j][2] = p[j][3] = 0.f;
            }
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const float4 qr = qp[LPC * c];
#pragma unroll
                for (int j = 0; j < CPT; ++j) {
                    S[j][4 * c + 0] = fmaf(kr[c].x, d[j], S[j][4 * c + 0]);
                    S[j][4 * c + 1] = fmaf(kr[c].y, d[j], S[j][4 * c + 1]);
                    S[j][4 * c + 2] = fmaf(kr[c].z, d[j], S[j][4 * c + 2]);
                    S[j][4 * c + 3] = fmaf(kr[c].w, d[j], S[j][4 * c + 3]);
                    p[j][0] = fmaf(S[j][4 * c + 0], qr.x, p[j][0]);
                    p[j][1] = fmaf(S[j][4 * c + 1], qr.y, p[j][1]);
                    p[j][2] = fmaf(S[j][4 * c + 2], qr.z, p[j][2]);
                    p[j][3] = fmaf(S[j][4 * c + 3], qr.w, p[j][3]);
                }
            }
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                float oo = (p[j][0] + p[j][1]) + (p[j][2] + p[j][3]);
#pragma unroll
                for (int off = 1; off < LPC; off <<= 1) oo += __shfl_xor_sync(0xffffffffu, oo, off);
                if (sub == 0) s_o[t][cc + j] = __float2bfloat16_rn(oo);
            }
        }
        __syncthreads();                        // s_o complete; s_q/s_k/s_v/s_alpha/s_beta free

#pragma unroll
        for (int p = 0; p < V_PASSES; ++p) {    // 8-byte stores (CT x COLS bf16)
            const int idx = tid + p * THREADS;
            const int t = idx / (COLS / 4), part = idx % (COLS / 4);
            if (t < nt)
                *reinterpret_cast<uint2*>(o + ((long long)(tok0 + c0 + t) * num_v_heads + h) * DV + col0 + part * 4) =
                    *reinterpret_cast<const uint2*>(&s_o[t][part * 4]);
        }
        if (more) store_chunk();
        __syncthreads();                        // next chunk staged; s_o free
    }

#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
            for (int j = 0; j < CPT; ++j) state[(4 * LPC * c + 4 * sub + e) * DV + col + j] = S[j][4 * c + e];
}

// ---------------------------------------------------------------------------------------------------------------
// The decode build: the same recurrence for streams of a few tokens (a decode or speculative-decode step), where
// the state's bytes are the whole cost (64 KB read and written per (stream, value head) at d128, against 512 bytes
// of q and k a token). The state is read and written once, in coalesced 16-byte rows, by CTAs light enough that
// several share an SM.
//
// A CTA owns `columns` dv columns of one (stream, value head) and all dk rows: lane = GROUPS * rg + cg (GROUPS =
// columns / 4 lanes across a row, each one float4) holds columns col0 + 4cg .. +3 of rows RPP * i + (32 / GROUPS) * w
// + rg (warp w; RPP = threads / GROUPS rows a CTA-wide pass), so each warp-wide access is 32 / GROUPS rows of
// 16 * GROUPS contiguous bytes. Per token, with S already decayed (S <- exp(g) S):
//     m = S^T k^ and p = S^T q~ (column sums over dk: lanes rg by xor shuffles, then the warps through shared
//     memory, summed in warp order by every thread that needs them, so all copies of a column agree);
//     delta = beta (v - m);  o = p + (k^ . q~) delta  (= (S + k^ delta^T)^T q~);  S <- S + k^ delta^T.
// Tokens are staged `tokens` at a time: warp t < tokens normalises token t's q and k (and their dot product), warp
// tokens + t loads its v slice, exp(g) and beta. A state pointer that is not 16-byte aligned takes scalar accesses
// (the same bits). A stream of no tokens leaves its state untouched.
//   d128: 64 columns (256-byte row pieces), three CTAs an SM (80 registers, no spill); d64: 32 columns, five CTAs an
// SM (47 registers). docs/kernels/gdn.md has the shapes measured against each other.
struct DecodeConfig {
    int threads, tokens, columns, min_blocks;   // min_blocks: CTAs an SM the registers must allow
    __host__ __device__ constexpr int rows_per_pass() const { return threads / (columns / 4); }
};
__host__ __device__ constexpr DecodeConfig decode_config(int d) {
    return d == 128 ? DecodeConfig{256, 4, 64, 3} : DecodeConfig{256, 4, 32, 5};
}

#if !defined(Q12_GDN_DECODE_D128_THREADS) || !defined(Q12_GDN_DECODE_D128_COLUMNS) || \
    !defined(Q12_GDN_DECODE_D64_THREADS) || !defined(Q12_GDN_DECODE_D64_COLUMNS)
#error "compile through q12drv: it passes the host's geometry (-DQ12_GDN_DECODE_D128_THREADS=... and the rest)"
#endif
#define GDN_DECODE_CONTRACT(D)                                                                                  \
    static_assert(decode_config(D).threads == Q12_GDN_DECODE_D##D##_THREADS,                                    \
                  "decode d" #D ": threads a CTA differ from the host's");                                      \
    static_assert(decode_config(D).columns == Q12_GDN_DECODE_D##D##_COLUMNS,                                    \
                  "decode d" #D ": dv columns a CTA differ from the host's");
GDN_DECODE_CONTRACT(128)
GDN_DECODE_CONTRACT(64)

template <int DK, int DV>
__device__ __forceinline__ void decode_body(GDN_BODY_PARAMS) {
    constexpr DecodeConfig CFG = decode_config(DK);
    constexpr int THREADS = CFG.threads, CT = CFG.tokens, COLS = CFG.columns;
    constexpr int WARPS = THREADS / 32;
    constexpr int GROUPS = COLS / 4;                 // lanes across a row (one float4 each)
    constexpr int RPP = CFG.rows_per_pass();         // rows a CTA-wide pass covers
    constexpr int NR = DK / RPP;                     // rows a thread owns
    constexpr int SEGS = DK / 8;                     // 16-byte segments of a q/k row
    constexpr int SLICES = DV / COLS;
    static_assert(GROUPS <= 32 && 32 % GROUPS == 0 && DK % RPP == 0 && DV % COLS == 0, "decode: tile");
    static_assert(WARPS == 2 * CT && 2 * SEGS <= 32, "decode: one warp stages a token's q and k, one its v");

    __shared__ __align__(16) float s_q[CT][DK];
    __shared__ __align__(16) float s_k[CT][DK];
    __shared__ __align__(16) float s_v[CT][COLS];
    __shared__ float s_alpha[CT], s_beta[CT], s_kq[CT];
    __shared__ __align__(16) float s_red[2][WARPS][2][COLS];   // per-warp column sums (m, p), by token parity

    const int b = blockIdx.y;
    if (b >= (int)m.batch_size || (int)blockIdx.x >= num_v_heads * SLICES) return;
    const int* cu = q12_cu_seqlens(m);
    const int tok0 = cu[b];
    const int len = cu[b + 1] - tok0;
    if (len <= 0) return;
    const int h = blockIdx.x / SLICES;
    const int col0 = (blockIdx.x % SLICES) * COLS;
    const int kh = h / (num_v_heads / num_k_heads);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int cg = lane % GROUPS, rg = lane / GROUPS;
    const int row0 = warp * (32 / GROUPS) + rg;      // rows row0 + RPP*i

    float* state = reinterpret_cast<float*>(h_state_ptrs[b]) + (long long)h * DK * DV + col0 + 4 * cg;
    const bool vec = (reinterpret_cast<unsigned long long>(h_state_ptrs[b]) & 15ull) == 0;
    float4 S[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const float* p = state + (long long)(row0 + RPP * i) * DV;
        S[i] = vec ? *reinterpret_cast<const float4*>(p) : make_float4(p[0], p[1], p[2], p[3]);
    }

    for (int c0 = 0; c0 < len; c0 += CT) {
        const int nt = min(CT, len - c0);
        if (warp < CT) {                              // token c0 + warp: q~ and k^ (the whole warp shuffles)
            const int t = warp;
            if (t < nt) {
                const bool mine = lane < 2 * SEGS, is_q = lane < SEGS;
                const int seg = lane % SEGS;
                uint4 raw = make_uint4(0u, 0u, 0u, 0u);
                if (mine)
                    raw = *reinterpret_cast<const uint4*>((is_q ? q : k) +
                                                          ((long long)(tok0 + c0 + t) * num_k_heads + kh) * DK + seg * 8);
                float x[8];
                const float inv = gdn_row_inv_norm<SEGS>(raw, x);
                if (mine) {
                    const float qscale = 1.0f / sqrtf((float)DK);
                    float y[8];
#pragma unroll
                    for (int e = 0; e < 8; ++e) y[e] = is_q ? (x[e] * inv) * qscale : x[e] * inv;
                    float* dst = is_q ? &s_q[t][seg * 8] : &s_k[t][seg * 8];
                    reinterpret_cast<float4*>(dst)[0] = make_float4(y[0], y[1], y[2], y[3]);
                    reinterpret_cast<float4*>(dst)[1] = make_float4(y[4], y[5], y[6], y[7]);
                }
            }
        } else {                                      // token c0 + warp - CT: v slice, exp(g), beta
            const int t = warp - CT;
            if (t < nt) {
                const long long hv_idx = (long long)(tok0 + c0 + t) * num_v_heads + h;
                if (lane < GROUPS) {
                    const uint2 raw = *reinterpret_cast<const uint2*>(v + hv_idx * DV + col0 + 4 * lane);
                    const __nv_bfloat162* pv = reinterpret_cast<const __nv_bfloat162*>(&raw);
                    const float2 a = __bfloat1622float2(pv[0]), c = __bfloat1622float2(pv[1]);
                    reinterpret_cast<float4*>(&s_v[t][4 * lane])[0] = make_float4(a.x, a.y, c.x, c.y);
                }
                if (lane == GROUPS % 32) s_alpha[t] = expf(g[hv_idx]);   // lanes past the v slice where there are
                if (lane == (GROUPS + 1) % 32) s_beta[t] = beta[hv_idx];  // (lanes 0 and 1 where there are not)
            }
        }
        __syncthreads();
        if (warp < CT && warp < nt) {                 // k^ . q~ of token c0 + warp, over the staged rows
            float kq = 0.f;
#pragma unroll
            for (int e = lane; e < DK; e += 32) kq = fmaf(s_k[warp][e], s_q[warp][e], kq);
#pragma unroll
            for (int off = 16; off >= 1; off >>= 1) kq += __shfl_xor_sync(0xffffffffu, kq, off);
            if (lane == 0) s_kq[warp] = kq;
        }
        __syncthreads();

        for (int t = 0; t < nt; ++t) {
            const int par = (c0 + t) & 1;
            const float a = s_alpha[t];
            float mk[4] = {0.f, 0.f, 0.f, 0.f}, pq[4] = {0.f, 0.f, 0.f, 0.f};
            float kr[NR];
#pragma unroll
            for (int i = 0; i < NR; ++i) {
                const int r = row0 + RPP * i;
                kr[i] = s_k[t][r];
                const float qr = s_q[t][r];
                S[i].x *= a; S[i].y *= a; S[i].z *= a; S[i].w *= a;
                mk[0] = fmaf(S[i].x, kr[i], mk[0]); mk[1] = fmaf(S[i].y, kr[i], mk[1]);
                mk[2] = fmaf(S[i].z, kr[i], mk[2]); mk[3] = fmaf(S[i].w, kr[i], mk[3]);
                pq[0] = fmaf(S[i].x, qr, pq[0]); pq[1] = fmaf(S[i].y, qr, pq[1]);
                pq[2] = fmaf(S[i].z, qr, pq[2]); pq[3] = fmaf(S[i].w, qr, pq[3]);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
                for (int off = GROUPS; off < 32; off <<= 1) {
                    mk[j] += __shfl_xor_sync(0xffffffffu, mk[j], off);
                    pq[j] += __shfl_xor_sync(0xffffffffu, pq[j], off);
                }
            }
            if (rg == 0) {
                reinterpret_cast<float4*>(&s_red[par][warp][0][4 * cg])[0] = make_float4(mk[0], mk[1], mk[2], mk[3]);
                reinterpret_cast<float4*>(&s_red[par][warp][1][4 * cg])[0] = make_float4(pq[0], pq[1], pq[2], pq[3]);
            }
            __syncthreads();
            float4 M = make_float4(0.f, 0.f, 0.f, 0.f), P = M;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float4 x = reinterpret_cast<const float4*>(&s_red[par][w][0][4 * cg])[0];
                const float4 y = reinterpret_cast<const float4*>(&s_red[par][w][1][4 * cg])[0];
                M.x += x.x; M.y += x.y; M.z += x.z; M.w += x.w;
                P.x += y.x; P.y += y.y; P.z += y.z; P.w += y.w;
            }
            const float bt = s_beta[t], kq = s_kq[t];
            const float4 vv = reinterpret_cast<const float4*>(&s_v[t][4 * cg])[0];
            const float4 d = make_float4(bt * (vv.x - M.x), bt * (vv.y - M.y), bt * (vv.z - M.z), bt * (vv.w - M.w));
#pragma unroll
            for (int i = 0; i < NR; ++i) {
                S[i].x = fmaf(kr[i], d.x, S[i].x); S[i].y = fmaf(kr[i], d.y, S[i].y);
                S[i].z = fmaf(kr[i], d.z, S[i].z); S[i].w = fmaf(kr[i], d.w, S[i].w);
            }
            if (warp == 0 && rg == 0) {
                __nv_bfloat162 o2[2] = {__floats2bfloat162_rn(fmaf(kq, d.x, P.x), fmaf(kq, d.y, P.y)),
                                        __floats2bfloat162_rn(fmaf(kq, d.z, P.z), fmaf(kq, d.w, P.w))};
                *reinterpret_cast<uint2*>(o + ((long long)(tok0 + c0 + t) * num_v_heads + h) * DV + col0 + 4 * cg) =
                    *reinterpret_cast<const uint2*>(o2);
            }
        }
        __syncthreads();                              // the staged chunk is read; the next may overwrite it
    }

#pragma unroll
    for (int i = 0; i < NR; ++i) {
        float* p = state + (long long)(row0 + RPP * i) * DV;
        if (vec) {
            *reinterpret_cast<float4*>(p) = S[i];
        } else {
            p[0] = S[i].x; p[1] = S[i].y; p[2] = S[i].z; p[3] = S[i].w;
        }
    }
}

// dk = dv = 128 and 64.
extern "C" __global__ void q12_gdn_recurrent_d128(GDN_PARAMS) { recurrent_body<128, 128>(GDN_ARGS); }
extern "C" __global__ void q12_gdn_recurrent_d64(GDN_PARAMS) { recurrent_body<64, 64>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(decode_config(128).threads, decode_config(128).min_blocks)
    q12_gdn_recurrent_decode_d128(GDN_PARAMS) { decode_body<128, 128>(GDN_ARGS); }
extern "C" __global__ void __launch_bounds__(decode_config(64).threads, decode_config(64).min_blocks)
    q12_gdn_recurrent_decode_d64(GDN_PARAMS) { decode_body<64, 64>(GDN_ARGS); }
