// expand_meta.cu: write the per-token metadata of a pass on the device from the per-stream fields.
//
// The per-token fields of the stacked block (O(T) bytes) follow from its per-stream tail
// (block_table_ptrs, seq_len_ptrs, cu_seqlens, kv_lens: O(n) bytes) and the device-resident block
// tables; these kernels write them byte for byte as the host packer does:
//   positions[t] (and H, W under MRoPE) = p = kv_lens[b] - count_b + (t - cu_seqlens[b])
//   slots[t] = block * block_size + p % block_size, block = table_b[p / block_size] (< 0 -> dummy)
//   the 4-byte pad after each u32 position row when T is odd = 0
//   tokens past cu_seqlens[n] (padding up to T = m.total_tokens): position 0, slot -1
// Two ways the tail reaches the device:
//   q12_expand_meta:      the host copied it into the arena (one small pinned copy; CUDA graphs replay
//                         that copy with new bytes at the same addresses);
//   q12_expand_meta_tail: it travels in the launch's own parameter block (Q12Tail, by value, for at
//                         most Q12_TAIL_STREAMS streams) and CTA (0, 0) writes it into the arena, pads
//                         zeroed: no copy, no pinned slot, no event on the host.
// Stream b = blockIdx.y; the CTAs of one stream walk its tokens with a grid stride, so any grid.x
// covers them. Text positions only: a batch with MRoPE vision positions is packed on the host.
// What was tried instead and what it measured: docs/kernels/expand.md.
#include "common/q12_meta.cuh"

#if !defined(Q12_TAIL_STREAMS) || !defined(Q12_TAIL_SIZE)
#error "compile through q12drv (registry.compile_defines): it passes the host mirror's capacity (-DQ12_TAIL_*)"
#endif

// The per-stream tail by value, at most Q12_TAIL_STREAMS streams (entries past batch_size unused).
// Mirrored on the host by q12drv.kernels.expand.Q12TailC; its size is checked below.
struct Q12Tail {
    u64 block_table_ptrs[Q12_TAIL_STREAMS];
    u64 seq_len_ptrs[Q12_TAIL_STREAMS];
    int cu_seqlens[Q12_TAIL_STREAMS + 1];
    int kv_lens[Q12_TAIL_STREAMS];
};
static_assert(sizeof(Q12Tail) == Q12_TAIL_SIZE, "sizeof(Q12Tail) differs from the host mirror");

namespace {

// Stream b's tokens (CTA blockIdx.x of gridDim.x walking them), then the padding tokens past the last
// stream and the position rows' pad word, from stream b's tail values.
__device__ __forceinline__ void expand_stream(const Q12Meta& m, int b, long long lo, long long hi, int kv_len,
                                              const int* table, int block_shift, int dummy_kv_block, int use_mrope) {
    const long long start = (long long)kv_len - (hi - lo);
    unsigned int* pos = reinterpret_cast<unsigned int*>(m.positions);
    unsigned int* pos_h = reinterpret_cast<unsigned int*>(m.positions_h);
    unsigned int* pos_w = reinterpret_cast<unsigned int*>(m.positions_w);
    i64* slots = reinterpret_cast<i64*>(m.slots);
    const long long mask = (1ll << block_shift) - 1;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long t = lo + (long long)blockIdx.x * blockDim.x + threadIdx.x; t < hi; t += stride) {
        const long long p = start + (t - lo);
        int block = __ldg(table + (p >> block_shift));
        if (block < 0) block = dummy_kv_block;
        const unsigned int pu = (unsigned int)p;
        pos[t] = pu;
        if (use_mrope) {
            pos_h[t] = pu;
            pos_w[t] = pu;
        }
        slots[t] = ((i64)block << block_shift) + (p & mask);
    }
    // Tokens past the last stream (a pass padded to fixed maxima, e.g. for a CUDA graph): position 0,
    // slot -1 (skipped by the KV write). Walked by the last stream's CTAs; none when cu[n] == T.
    if (b == (int)gridDim.y - 1) {
        for (long long t = hi + (long long)blockIdx.x * blockDim.x + threadIdx.x; t < (long long)m.total_tokens; t += stride) {
            pos[t] = 0u;
            if (use_mrope) {
                pos_h[t] = 0u;
                pos_w[t] = 0u;
            }
            slots[t] = -1;
        }
    }
    if (b == 0 && blockIdx.x == 0 && threadIdx.x == 0 && (m.total_tokens & 1u)) {
        pos[m.total_tokens] = 0u;
        if (use_mrope) {
            pos_h[m.total_tokens] = 0u;
            pos_w[m.total_tokens] = 0u;
        }
    }
}

}  // namespace

extern "C" __global__ void q12_expand_meta(Q12Meta m, int block_shift, int dummy_kv_block, int use_mrope) {
    const int b = blockIdx.y;
    const int* cu = q12_cu_seqlens(m);
    expand_stream(m, b, cu[b], cu[b + 1], q12_kv_lens(m)[b], q12_block_table(m, b), block_shift, dummy_kv_block,
                  use_mrope);
}

extern "C" __global__ void q12_expand_meta_tail(Q12Meta m, int block_shift, int dummy_kv_block, int use_mrope,
                                                const __grid_constant__ Q12Tail tail) {
    const int b = blockIdx.y;
    if (b == 0 && blockIdx.x == 0) {  // the tail into the arena, each field's pad word zeroed
        const int n = (int)m.batch_size;
        u64* tables = reinterpret_cast<u64*>(m.block_table_ptrs);
        u64* seq_lens = reinterpret_cast<u64*>(m.seq_len_ptrs);
        int* cu = reinterpret_cast<int*>(m.cu_seqlens);
        int* kv = reinterpret_cast<int*>(m.kv_lens);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            tables[i] = tail.block_table_ptrs[i];
            seq_lens[i] = tail.seq_len_ptrs[i];
            kv[i] = tail.kv_lens[i];
        }
        for (int i = threadIdx.x; i <= n; i += blockDim.x) cu[i] = tail.cu_seqlens[i];
        if (threadIdx.x == 0) {
            if (!(n & 1)) cu[n + 1] = 0;  // i32[n + 1] padded to 8 bytes: a pad word when n is even
            if (n & 1) kv[n] = 0;         // i32[n]: a pad word when n is odd
        }
    }
    expand_stream(m, b, tail.cu_seqlens[b], tail.cu_seqlens[b + 1], tail.kv_lens[b],
                  reinterpret_cast<const int*>(tail.block_table_ptrs[b]), block_shift, dummy_kv_block, use_mrope);
}
