// kv_write.cu: paged KV-cache write (slot mapping), one attention layer.
//
// Packed new keys/values k, v [T, Hkv, D] bf16 (row of row_elems = Hkv*D elements per token).
// Token t goes to slot s = q12_slots(m)[t] of both pools, NHD [num_blocks, block_size, Hkv, D]:
// the token's row lands at element offset s * row_elems (s = block * block_size + offset).
//   s < 0            -> skip (padding, vLLM convention)
//   s >= num_slots   -> skip (num_slots = num_blocks * block_size; the host validates slots
//                       before staging, this is the last line of defence against a stray write)
//
// Memory-bound copy. A "group" of gs threads (gs = power of two <= 32, the smallest one covering
// the row's 16-byte chunks, so a group never straddles a warp) owns KVW_TOK consecutive tokens
// per iteration; groups walk the tokens with a grid stride, so any grid covers all
// T = m.total_tokens tokens. Per iteration a lane first issues every load it needs: the
// KVW_TOK slots and, for each token, R chunks (16 B) of K and R of V at chunks lane, lane + gs
// (8 independent 16-byte loads = 128 B in flight per thread). The data loads do not wait for the
// slots (a token's k/v rows are always readable; only the stores depend on the slot), so the
// slot's latency overlaps the data's. Then the stores, predicated on the slot being valid. Rows
// longer than R * gs chunks take more trips of the same shape. R = 2, KVW_TOK = 2 when the row
// has more than 32 chunks (Qwen3-Next: 1 KiB rows = 64 chunks, one warp per token, exactly one
// trip); R = 1, KVW_TOK = 4 otherwise (one chunk per lane).
//
// Cache hints: the inputs are read once (ld.global.nc.L1::no_allocate: read-only path, no L1
// allocation); the pool rows are written with st.global.cs (streaming, evict-first in L2) unless
// compiled with -DKVW_STORE_WB=1 (plain write-back stores).
// If a pointer is not 16-byte aligned or row_elems % 8 != 0 the same walk runs with 2-byte
// elements (correct, slow; the host never launches that way).
// -DKVW_LEGACY=1 compiles the previous kernel (2 chunks of K and 2 of V per lane and token, the
// slot loaded first and the data only for valid slots, plain loads/stores) for A/B measurements.
//
// Every token is handled alone (pure copy, no cross-token arithmetic): a stream's rows are
// written identically whether it runs batched or alone. Offsets are 64-bit.
// __launch_bounds__(1024, 1): <= 64 registers, so 1024-thread blocks launch and 4 CTAs of 256
// threads are resident per SM (the persistent grid of kv_write.geometry() assumes 4). The legacy
// kernel keeps its old budget (<= 32 registers, 8 CTAs of 256 per SM: geometry(legacy=True)).
// Measured on the H200 (tests/GPU.md session 2, 4 runs; 64k tokens, Hkv 2, D 256, cold L2): 80.1-85.2 us
// = 74-79% of the 4.23 TB/s D2D copy; the legacy build 79.4-82.9 us (the rewrite did not pay: both sit at
// what DRAM gives this gather/scatter of 1 KiB rows); torch index_copy_ (K, V) 213-218 us.
#include "common/q12_meta.cuh"

#ifndef KVW_LEGACY
#define KVW_LEGACY 0
#endif
#ifndef KVW_STORE_WB
#define KVW_STORE_WB 0
#endif

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
#if KVW_STORE_WB
    *p = d;
#else
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d.x), "r"(d.y), "r"(d.z), "r"(d.w)
                 : "memory");
#endif
}
__device__ __forceinline__ void st_stream(unsigned short* p, unsigned short d) {
#if KVW_STORE_WB
    *p = d;
#else
    asm volatile("st.global.cs.u16 [%0], %1;" ::"l"(p), "h"(d) : "memory");
#endif
}

__device__ __forceinline__ int group_size(int row_units) {
    // Smallest power of two >= row_units, capped at 32.
    int gs = 1;
    while (gs < row_units && gs < 32) gs <<= 1;
    return gs;
}

#if KVW_LEGACY
template <typename V>
__device__ __forceinline__ void copy_rows(const V* __restrict__ k, const V* __restrict__ v,
                                          V* __restrict__ k_pool, V* __restrict__ v_pool,
                                          const i64* __restrict__ slots, long long num_slots,
                                          int row_units, int total_tokens) {
    const int gs = group_size(row_units);
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    const int lane = (int)(tid & (gs - 1));
    const long long ngroups = nthreads / gs;  // trailing partial group (if any) stays idle
    long long group = tid / gs;
    if (group >= ngroups) return;
    for (long long t = group; t < total_tokens; t += ngroups) {
        const i64 s = __ldg(slots + t);
        if (s < 0 || s >= num_slots) continue;
        const long long src = t * (long long)row_units;
        const long long dst = s * (long long)row_units;
        int c = lane;
        for (; c + gs < row_units; c += 2 * gs) {
            const V k0 = __ldg(k + src + c);
            const V k1 = __ldg(k + src + c + gs);
            const V v0 = __ldg(v + src + c);
            const V v1 = __ldg(v + src + c + gs);
            k_pool[dst + c] = k0;
            k_pool[dst + c + gs] = k1;
            v_pool[dst + c] = v0;
            v_pool[dst + c + gs] = v1;
        }
        if (c < row_units) {
            const V k0 = __ldg(k + src + c);
            const V v0 = __ldg(v + src + c);
            k_pool[dst + c] = k0;
            v_pool[dst + c] = v0;
        }
    }
}
#else
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
#endif

template <typename V>
__device__ __forceinline__ void copy_dispatch(const V* k, const V* v, V* k_pool, V* v_pool, const i64* slots,
                                              long long num_slots, int row_units, int total_tokens) {
#if KVW_LEGACY
    copy_rows<V>(k, v, k_pool, v_pool, slots, num_slots, row_units, total_tokens);
#else
    if (row_units > 32) {
        copy_rows<V, 2, 2>(k, v, k_pool, v_pool, slots, num_slots, row_units, total_tokens);
    } else {
        copy_rows<V, 4, 1>(k, v, k_pool, v_pool, slots, num_slots, row_units, total_tokens);
    }
#endif
}

}  // namespace

#if KVW_LEGACY
#define KVW_MIN_BLOCKS 2
#else
#define KVW_MIN_BLOCKS 1
#endif

extern "C" __global__ __launch_bounds__(1024, KVW_MIN_BLOCKS) void q12_kv_write(Q12Meta m, const bf16* __restrict__ k, const bf16* __restrict__ v, bf16* __restrict__ k_pool, bf16* __restrict__ v_pool, int row_elems, long long num_slots) {
    if (row_elems <= 0) return;
    const int total_tokens = (int)m.total_tokens;
    const i64* slots = q12_slots(m);
    const unsigned long long addr_bits =
        (unsigned long long)k | (unsigned long long)v | (unsigned long long)k_pool | (unsigned long long)v_pool;
    if ((row_elems & 7) == 0 && (addr_bits & 15ull) == 0) {
        copy_dispatch<uint4>(reinterpret_cast<const uint4*>(k), reinterpret_cast<const uint4*>(v),
                             reinterpret_cast<uint4*>(k_pool), reinterpret_cast<uint4*>(v_pool), slots, num_slots,
                             row_elems >> 3, total_tokens);
    } else {
        copy_dispatch<unsigned short>(reinterpret_cast<const unsigned short*>(k),
                                      reinterpret_cast<const unsigned short*>(v),
                                      reinterpret_cast<unsigned short*>(k_pool),
                                      reinterpret_cast<unsigned short*>(v_pool), slots, num_slots, row_elems,
                                      total_tokens);
    }
}
