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
// the row's 16-byte chunks, so a group never straddles a warp) owns one token at a time; groups
// walk the tokens with a grid stride, so any grid size covers all T = m.total_tokens tokens.
// Each lane moves 16-byte chunks (ld.global.nc.v4 / st.global.v4), two chunks of K and two of V
// in flight per iteration. If a pointer is not 16-byte aligned or row_elems % 8 != 0 the same
// walk runs with 2-byte elements (correct, slow; the host never launches that way).
//
// Every token is handled alone (pure copy, no cross-token arithmetic): a stream's rows are
// written identically whether it runs batched or alone. Offsets are 64-bit.
#include "q12_meta.cuh"

namespace {

template <typename V>
__device__ __forceinline__ void copy_rows(const V* __restrict__ k, const V* __restrict__ v,
                                          V* __restrict__ k_pool, V* __restrict__ v_pool,
                                          const i64* __restrict__ slots, long long num_slots,
                                          int row_units, int total_tokens) {
    // Group size: smallest power of two >= row_units, capped at 32.
    int gs = 1;
    while (gs < row_units && gs < 32) gs <<= 1;
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

}  // namespace

extern "C" __global__ void q12_kv_write(Q12Meta m, const bf16* __restrict__ k, const bf16* __restrict__ v, bf16* __restrict__ k_pool, bf16* __restrict__ v_pool, int row_elems, long long num_slots) {
    if (row_elems <= 0) return;
    const int total_tokens = (int)m.total_tokens;
    const i64* slots = q12_slots(m);
    const unsigned long long addr_bits =
        (unsigned long long)k | (unsigned long long)v | (unsigned long long)k_pool | (unsigned long long)v_pool;
    if ((row_elems & 7) == 0 && (addr_bits & 15ull) == 0) {
        copy_rows<uint4>(reinterpret_cast<const uint4*>(k), reinterpret_cast<const uint4*>(v),
                         reinterpret_cast<uint4*>(k_pool), reinterpret_cast<uint4*>(v_pool), slots, num_slots,
                         row_elems >> 3, total_tokens);
    } else {
        copy_rows<unsigned short>(reinterpret_cast<const unsigned short*>(k),
                                  reinterpret_cast<const unsigned short*>(v),
                                  reinterpret_cast<unsigned short*>(k_pool),
                                  reinterpret_cast<unsigned short*>(v_pool), slots, num_slots, row_elems,
                                  total_tokens);
    }
}
