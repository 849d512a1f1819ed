// attention/common.cuh: what both paged-attention kernels (mma.cu, wgmma.cu) share: the entries'
// parameter list and the small device helpers of their copies and softmax.
#pragma once
#include "common/q12_meta.cuh"

// Every attention entry takes these parameters (q12drv.core.launch.parse_signatures reads the macro).
// window_left (>= 0): the sliding window, FlashAttention's window_size = (window_left, 0): the query at
// position p sees the keys p - window_left .. p (and none below 0). No window is any value >= every kv_len:
// the host passes INT_MAX (2^31 - 1). It stays a launch argument (in the constant bank), so the loops read
// it there rather than hold it in a register.
#define ATTN_PARAMS                                                                                      \
    Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, \
        int block_size, float scale, int window_left
#define ATTN_ARGS m, q, k_pool, v_pool, o, num_q_heads, num_kv_heads, block_size, scale, window_left

#define ATTN_INF __int_as_float(0x7f800000)  // +inf (NVRTC has no INFINITY macro)

namespace attn {

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_bytes = 0 fills the 16 bytes with zeros (no read).
__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's commit groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// 2^x with one MUFU.EX2: ex2.approx (the instruction exp2f also uses, ~2 ulp) with .ftz, so a
// result below 2^-126 flushes to 0 (irrelevant for softmax weights, which are <= 1 and summed in
// fp32); exp2f's non-ftz form adds range-fixup instructions on the softmax's critical path.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two floats -> bf16x2 (round to nearest even), x in the low half.
__device__ __forceinline__ unsigned int pack_bf16x2(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<unsigned int*>(&v);
}

}  // namespace attn
