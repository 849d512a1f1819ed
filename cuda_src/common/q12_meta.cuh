// q12_meta.cuh: the batched-prefill metadata as the kernels receive it (by value).
//
// Mirrored on the host by q12drv.kernels.meta.Q12MetaC (ctypes). The host passes the
// byte offset of every field as -DQ12_META_OFF_<FIELD>=<n> and -DQ12_META_SIZE=<n>;
// the static_asserts below make a drifted mirror a compile error, never a wrong read.
//
// Host/device contracts, the one pattern every kernel source follows: a number both sides rely on
// (a struct's layout here and Q12Tail's capacity in expand_meta.cu; threads per CTA, CTAs per SM,
// tile sizes the host's geometry uses in a kernel's source) reaches the compiler as
// -D Q12_<NAME>=<value> from q12drv (kernels/meta.py:meta_defines for the structs, the kernel
// module's CONTRACTS for the rest, both through kernels/registry.py:compile_defines). The source
// has no default for it (#error when it is missing: build through q12drv) and static_asserts it
// against its own constexpr configuration, so a host and a kernel that disagree do not compile.
#pragma once
#include <cuda_bf16.h>


typedef __nv_bfloat16 bf16;
typedef unsigned long long u64;
typedef long long i64;

// One list of the fields: declaration order, C type, name, and the host's macro suffix.
#define Q12_META_FIELDS(X)                              \
    X(u64, positions, POSITIONS)                        \
    X(u64, positions_h, POSITIONS_H)                    \
    X(u64, positions_w, POSITIONS_W)                    \
    X(u64, slots, SLOTS)                                \
    X(u64, block_table_ptrs, BLOCK_TABLE_PTRS)          \
    X(u64, seq_len_ptrs, SEQ_LEN_PTRS)                  \
    X(u64, cu_seqlens, CU_SEQLENS)                      \
    X(u64, kv_lens, KV_LENS)                            \
    X(unsigned int, batch_size, BATCH_SIZE)             \
    X(unsigned int, chunk_len, CHUNK_LEN)               \
    X(unsigned int, total_tokens, TOTAL_TOKENS)         \
    X(unsigned int, max_blocks_per_seq, MAX_BLOCKS_PER_SEQ)

// positions:        u32[T], the temporal (T) stream under MRoPE
// positions_h/_w:   u32[T], MRoPE H and W streams (== positions without MRoPE)
// slots:            i64[T], KV write slot per packed token, < 0 = skip
// block_table_ptrs: u64[n], each -> stream b's int32 physical block ids
// seq_len_ptrs:     u64[n], each -> stream b's u32 seq_len
// cu_seqlens:       i32[n+1], exclusive prefix sum of per-stream token counts
// kv_lens:          i32[n], kv_lens[b] = proc_start_b + count_b
// batch_size n; chunk_len = max per-stream count; total_tokens T = cu_seqlens[n]
struct Q12Meta {
#define Q12_META_DECLARE(T, name, NAME) T name;
    Q12_META_FIELDS(Q12_META_DECLARE)
#undef Q12_META_DECLARE
};

// Compile-time check against the host mirror. NVRTC 13.0 has no offsetof, so the offsets are
// computed by the layout rule every C++ ABI uses for a standard-layout struct (each member at
// the next multiple of its alignment, in declaration order) and checked together with sizeof.
#ifndef Q12_META_SIZE
#error "compile through q12drv (registry.compile_defines): it passes the host mirror's offsets (-DQ12_META_*)"
#endif
namespace q12_meta_check {
#define Q12_META_SIZEOF(T, name, NAME) sizeof(T),
#define Q12_META_ALIGNOF(T, name, NAME) alignof(T),
constexpr unsigned long long sizes[] = {Q12_META_FIELDS(Q12_META_SIZEOF)};
constexpr unsigned long long aligns[] = {Q12_META_FIELDS(Q12_META_ALIGNOF)};
#undef Q12_META_SIZEOF
#undef Q12_META_ALIGNOF
__host__ __device__ constexpr unsigned long long offset_of(int i) {
    unsigned long long off = 0;
    for (int j = 0;; ++j) {
        off = (off + aligns[j] - 1) / aligns[j] * aligns[j];
        if (j == i) return off;
        off += sizes[j];
    }
}
enum : int {
#define Q12_META_INDEX(T, name, NAME) NAME,
    Q12_META_FIELDS(Q12_META_INDEX)
#undef Q12_META_INDEX
};
#define Q12_META_ASSERT(T, name, NAME) \
    static_assert(offset_of(NAME) == Q12_META_OFF_##NAME, "Q12Meta." #name " offset differs from the host mirror");
Q12_META_FIELDS(Q12_META_ASSERT)
#undef Q12_META_ASSERT
static_assert(sizeof(Q12Meta) == Q12_META_SIZE, "sizeof(Q12Meta) differs from the host mirror");
static_assert(alignof(Q12Meta) == 8, "Q12Meta must be 8-byte aligned");
}  // namespace q12_meta_check

// Typed views of the metadata arrays.
__device__ __forceinline__ const unsigned int* q12_positions(const Q12Meta& m, int axis) {
    return reinterpret_cast<const unsigned int*>(axis == 0 ? m.positions : (axis == 1 ? m.positions_h : m.positions_w));
}
__device__ __forceinline__ const i64* q12_slots(const Q12Meta& m) { return reinterpret_cast<const i64*>(m.slots); }
__device__ __forceinline__ const int* q12_cu_seqlens(const Q12Meta& m) { return reinterpret_cast<const int*>(m.cu_seqlens); }
__device__ __forceinline__ const int* q12_kv_lens(const Q12Meta& m) { return reinterpret_cast<const int*>(m.kv_lens); }
__device__ __forceinline__ const int* q12_block_table(const Q12Meta& m, int b) {
    return reinterpret_cast<const int*>(reinterpret_cast<const u64*>(m.block_table_ptrs)[b]);
}
