// expand_meta.cu: write the per-token metadata of a pass on the device from the per-stream fields.
//
// The host uploads only the O(n) tail of the stacked block (block_table_ptrs, seq_len_ptrs,
// cu_seqlens, kv_lens: one small copy); this kernel writes the O(T) fields from them and from the
// device-resident block tables, byte for byte what the host packer writes:
//   positions[t] (and H, W under MRoPE) = p = kv_lens[b] - count_b + (t - cu_seqlens[b])
//   slots[t] = block * block_size + p % block_size, block = table_b[p / block_size] (< 0 -> dummy)
//   the 4-byte pad after each u32 position row when T is odd = 0
//   tokens past cu_seqlens[n] (padding up to T = m.total_tokens): position 0, slot -1
// Stream b = blockIdx.y; the CTAs of one stream walk its tokens with a grid stride, so any grid.x
// covers them. Text positions only: a batch with MRoPE vision positions is packed on the host.
#include "q12_meta.cuh"

extern "C" __global__ void q12_expand_meta(Q12Meta m, int block_shift, int dummy_kv_block, int use_mrope) {
    const int b = blockIdx.y;
    const int* cu = q12_cu_seqlens(m);
    const long long lo = cu[b];
    const long long hi = cu[b + 1];
    const long long start = (long long)q12_kv_lens(m)[b] - (hi - lo);
    const int* table = q12_block_table(m, b);
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
