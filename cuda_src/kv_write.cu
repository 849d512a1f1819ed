// kv_write.cu: paged KV-cache write (slot mapping), one attention layer.
//
// Packed new keys/values k, v [T, Hkv, D] bf16 (row of row_elems = Hkv*D elements per token).
// Token t goes to slot s = q12_slots(m)[t] of both pools, NHD [num_blocks, block_size, Hkv, D]:
// the token's row lands at element offset s * row_elems (s = block * block_size + offset).
//   s < 0            -> skip (padding, vLLM convention)
//   s >= num_slots   -> skip (num_slots = num_blocks * block_size; the host validates slots
//                       before staging, this is the last line of defence against a stray write)
//
// Memory-bound copy. A "group" of gs threads (gs = power of two <= max_group = 32, the smallest one
// covering the row's 16-byte chunks, so a group never straddles a warp) owns TOK consecutive tokens
// per iteration; groups walk the tokens with a grid stride, so any grid covers all
// T = m.total_tokens tokens. Per iteration a lane first issues every load it needs: the TOK slots
// and, for each token, R chunks (16 B) of K and R of V at chunks lane, lane + gs (8 independent
// 16-byte loads = 128 B in flight per thread). The data loads do not wait for the slots (a token's
// k/v rows are always readable; only the stores depend on the slot), so the slot's latency overlaps
// the data's. Then the stores, predicated on the slot being valid. Rows longer than R * gs chunks
// take more trips of the same shape. R = 2, TOK = 2 when the row has more than 32 chunks
// (Qwen3-Next: 1 KiB rows = 64 chunks, one warp per token, exactly one trip); R = 1, TOK = 4
// otherwise (one chunk per lane).
//
// Cache hints: the inputs are read once (ld.global.nc.L1::no_allocate: read-only path, no L1
// allocation); the pool rows are written with st.global.cs (streaming, evict-first in L2).
// If a pointer is not 16-byte aligned or row_elems % 8 != 0 the same walk runs with 2-byte
// elements (correct, slow; the host never launches that way).
//
// Every token is handled alone (pure copy, no cross-token arithmetic): a stream's rows are
// written identically whether it runs batched or alone. Offsets are 64-bit.
// __launch_bounds__(1024, 1): <= 64 registers a thread, so 1024-thread blocks launch and
// Q12_KVW_CTAS_PER_SM = 4 CTAs of Q12_KVW_THREADS = 256 threads are resident per SM, which the
// host's persistent grid (kv_write.geometry()) assumes.
//
// q12_kv_write_fp8 writes FP8 (e4m3) pools instead: each value becomes e4m3(x * (1 / scale[h])), h its KV head,
// rounded to nearest even and saturated to +-448 (cvt.rn.satfinite), the caller's per-head fp32 scales k_scale and
// v_scale [Hkv] (attention dequantizes q * scale). One thread per 16-byte chunk of a token's row (8 values of one
// head: head_dim % 8 == 0), a grid stride over T x chunks; each writes 8 bytes.
//
// Host/device contract (q12drv/kernels/kv_write.py CONTRACTS, passed as -D by registry.compile_defines and
// checked below against kvw_config()): Q12_KVW_THREADS, Q12_KVW_CTAS_PER_SM, Q12_KVW_MAX_THREADS,
// Q12_KVW_CHUNK_ELEMS, Q12_KVW_MAX_GROUP, Q12_KVW_LONG_ROW_TOKENS, Q12_KVW_SHORT_ROW_TOKENS.
// What was tried instead and what it measured: docs/kernels/kv_write.md.
#include "common/q12_meta.cuh"

// The kernel's configuration: every number its code and the host's launch geometry use.
struct KvwConfig {
    int max_threads;   // __launch_bounds__: the largest block
    int min_blocks;    // __launch_bounds__: resident CTAs of max_threads per SM
    int chunk_elems;   // bf16 elements in a 16-byte chunk
    int max_group;     // threads per token group at most (a warp)
    int long_tokens;   // TOK for rows of more than max_group chunks
    int long_chunks;   // R for those rows
    int short_tokens;  // TOK for rows of at most max_group chunks
    int short_chunks;  // R for those rows
};
__host__ __device__ constexpr KvwConfig kvw_config() { return {1024, 1, 8, 32, 2, 2, 4, 1}; }

#if !defined(Q12_KVW_THREADS) || !defined(Q12_KVW_CTAS_PER_SM) || !defined(Q12_KVW_MAX_THREADS) ||  \
    !defined(Q12_KVW_CHUNK_ELEMS) || !defined(Q12_KVW_MAX_GROUP) || !defined(Q12_KVW_LONG_ROW_TOKENS) || \
    !defined(Q12_KVW_SHORT_ROW_TOKENS)
#error "compile through q12drv (registry.compile_defines): it passes the host's Q12_KVW_* contract defines"
#endif
static_assert(Q12_KVW_MAX_THREADS == kvw_config().max_threads, "kv_write.MAX_THREADS differs from the launch bounds");
static_assert(Q12_KVW_THREADS % 32 == 0 && Q12_KVW_THREADS <= kvw_config().max_threads,
              "kv_write.THREADS must be whole warps within the launch bounds");
static_assert(Q12_KVW_THREADS * Q12_KVW_CTAS_PER_SM <= kvw_config().max_threads * kvw_config().min_blocks,
              "kv_write's persistent grid assumes more resident threads per SM than the launch bounds guarantee");
static_assert(Q12_KVW_CHUNK_ELEMS == kvw_config().chunk_elems && kvw_config().chunk_elems * 2 == sizeof(uint4),
              "kv_write's chunk is 8 bf16 (16 bytes)");
static_assert(Q12_KVW_MAX_GROUP == kvw_config().max_group && kvw_config().max_group == 32,
              "kv_write's token groups are at most a warp");
static_assert(Q12_KVW_LONG_ROW_TOKENS == kvw_config().long_tokens &&
                  Q12_KVW_SHORT_ROW_TOKENS == kvw_config().short_tokens,
              "kv_write's tokens per group differ from the kernel's");

namespace {

__device__ __forceinline__ void ld_stream(uint4& d, const uint4* p) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(d.x), "=r"(d.y), "=r"(d.z), "=r"(d.w)
                 : "l"(p));
}
__device__ __forceinline__ void ld_stream(unsigned short& d, const unsigned short* p) {
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(d) : "l"(p));
}
__device__ __forceinline__ void st_stream(uint4* p, const uint4& d) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d.x), "r"(d.y), "r"(d.z), "r"(d.w)
                 : "memory");
}
__device__ __forceinline__ void st_stream(unsigned short* p, unsigned short d) {
    asm volatile("st.global.cs.u16 [%0], %1;" ::"l"(p), "h"(d) : "memory");
}

__device__ __forceinline__ int group_size(int row_units) {
    // Smallest power of two >= row_units, capped at a warp.
    int gs = 1;
    while (gs < row_units && gs < kvw_config().max_group) gs <<= 1;
    return gs;
}

// TOK tokens per group and iteration, R chunks per lane, token and tensor per trip.
template <typename V, int TOK, int R>
__device__ __forceinline__ void copy_rows(const V* __restrict__ k, const V* __restrict__ v,
                                          V* __restrict__ k_pool, V* __restrict__ v_pool,
                                          const i64* __restrict__ slots, long long num_slots,
                                          int row_units, int total_tokens) {
    const int gs = group_size(row_units);
    const int lane = (int)(threadIdx.x & (gs - 1));
    // Groups never straddle a CTA (gs divides 32 divides blockDim), so no 64-bit division here.
    const int groups_per_cta = (int)blockDim.x / gs;
    if ((int)threadIdx.x / gs >= groups_per_cta) return;  // a partial trailing warp (never launched so)
    const long long group = (long long)blockIdx.x * groups_per_cta + (int)threadIdx.x / gs;
    const long long step = (long long)gridDim.x * groups_per_cta * TOK;
    const long long ru = row_units;
    for (long long t0 = group * TOK; t0 < total_tokens; t0 += step) {
        i64 s[TOK];
#pragma unroll
        for (int i = 0; i < TOK; ++i) s[i] = t0 + i < total_tokens ? __ldg(slots + t0 + i) : -1;
        for (int c0 = lane; c0 < row_units; c0 += R * gs) {
            V kd[TOK][R], vd[TOK][R];
#pragma unroll
            for (int i = 0; i < TOK; ++i) {
                const long long src = (t0 + i) * ru + c0;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (t0 + i < total_tokens && c0 + r * gs < row_units) {
                        ld_stream(kd[i][r], k + src + r * gs);
                        ld_stream(vd[i][r], v + src + r * gs);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < TOK; ++i) {
                if (s[i] < 0 || s[i] >= num_slots) continue;  // also every token past T (s = -1)
                const long long dst = s[i] * ru + c0;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (c0 + r * gs < row_units) {
                        st_stream(k_pool + dst + r * gs, kd[i][r]);
                        st_stream(v_pool + dst + r * gs, vd[i][r]);
                    }
                }
            }
        }
    }
}

template <typename V>
__device__ __forceinline__ void copy_dispatch(const V* k, const V* v, V* k_pool, V* v_pool, const i64* slots,
                                              long long num_slots, int row_units, int total_tokens) {
    constexpr KvwConfig c = kvw_config();
    if (row_units > c.max_group) {
        copy_rows<V, c.long_tokens, c.long_chunks>(k, v, k_pool, v_pool, slots, num_slots, row_units, total_tokens);
    } else {
        copy_rows<V, c.short_tokens, c.short_chunks>(k, v, k_pool, v_pool, slots, num_slots, row_units,
                                                     total_tokens);
    }
}

}  // namespace

extern "C" __global__ __launch_bounds__(kvw_config().max_threads, kvw_config().min_blocks) void q12_kv_write(Q12Meta m, const bf16* __restrict__ k, const bf16* __restrict__ v, bf16* __restrict__ k_pool, bf16* __restrict__ v_pool, int row_elems, long long num_slots) {
    if (row_elems <= 0) return;
    const int total_tokens = (int)m.total_tokens;
    const i64* slots = q12_slots(m);
    const unsigned long long addr_bits =
        (unsigned long long)k | (unsigned long long)v | (unsigned long long)k_pool | (unsigned long long)v_pool;
    if (row_elems % kvw_config().chunk_elems == 0 && (addr_bits & 15ull) == 0) {
        copy_dispatch<uint4>(reinterpret_cast<const uint4*>(k), reinterpret_cast<const uint4*>(v),
                             reinterpret_cast<uint4*>(k_pool), reinterpret_cast<uint4*>(v_pool), slots, num_slots,
                             row_elems / kvw_config().chunk_elems, total_tokens);
    } else {
        copy_dispatch<unsigned short>(reinterpret_cast<const unsigned short*>(k),
                                      reinterpret_cast<const unsigned short*>(v),
                                      reinterpret_cast<unsigned short*>(k_pool),
                                      reinterpret_cast<unsigned short*>(v_pool), slots, num_slots, row_elems,
                                      total_tokens);
    }
}

namespace {

// Eight bf16 (one 16-byte chunk) times inv, as e4m3 bytes in order: cvt packs its first operand in the high byte.
__device__ __forceinline__ uint2 to_e4m3x8(const uint4& d, float inv) {
    const unsigned w[4] = {d.x, d.y, d.z, d.w};
    unsigned short p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float lo = __fmul_rn(__uint_as_float(w[i] << 16), inv);
        const float hi = __fmul_rn(__uint_as_float(w[i] & 0xffff0000u), inv);
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(p[i]) : "f"(hi), "f"(lo));
    }
    return make_uint2((unsigned)p[0] | ((unsigned)p[1] << 16), (unsigned)p[2] | ((unsigned)p[3] << 16));
}

__device__ __forceinline__ void st_stream8(uint2* p, const uint2& d) {
    asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(d.x), "r"(d.y) : "memory");
}

}  // namespace

extern "C" __global__ __launch_bounds__(kvw_config().max_threads, kvw_config().min_blocks) void q12_kv_write_fp8(Q12Meta m, const bf16* __restrict__ k, const bf16* __restrict__ v, unsigned char* __restrict__ k_pool, unsigned char* __restrict__ v_pool, const float* __restrict__ k_scale, const float* __restrict__ v_scale, int head_dim, int row_elems, long long num_slots) {
    constexpr int ce = kvw_config().chunk_elems;
    if (row_elems <= 0 || head_dim <= 0 || head_dim % ce || row_elems % head_dim) return;
    const int chunks = row_elems / ce;  // per token row
    const long long total = (long long)m.total_tokens * chunks;
    const i64* slots = q12_slots(m);
    const uint4* k4 = reinterpret_cast<const uint4*>(k);
    const uint4* v4 = reinterpret_cast<const uint4*>(v);
    uint2* kp = reinterpret_cast<uint2*>(k_pool);
    uint2* vp = reinterpret_cast<uint2*>(v_pool);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / chunks;
        const int c = (int)(i - t * chunks);
        const i64 s = __ldg(slots + t);
        uint4 kd, vd;
        ld_stream(kd, k4 + i);
        ld_stream(vd, v4 + i);
        if (s < 0 || s >= num_slots) continue;
        const int h = c * ce / head_dim;
        const long long dst = s * chunks + c;
        st_stream8(kp + dst, to_e4m3x8(kd, __frcp_rn(__ldg(k_scale + h))));
        st_stream8(vp + dst, to_e4m3x8(vd, __frcp_rn(__ldg(v_scale + h))));
    }
}
