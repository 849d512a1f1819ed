// conv1d.cu: causal depthwise convolution over the packed streams of a pass, with SiLU and a per-stream state
// updated in place (the short convolution of Qwen3-Next's Gated DeltaNet layer, before the delta rule).
//
// Stream b's tokens are rows cu_seqlens[b] .. cu_seqlens[b+1] of x [T, C] (bf16, rows x_stride elements apart).
// For the stream's local token t and channel c:
//     y[t, c] = act(bias[c] + sum_{j < W} w[c, j] * in(t - (W - 1) + j, c)),    act = SiLU, or none
// where in(p, c) = x[p, c] for p >= 0 and state_b[W - 1 + p, c] for p < 0. The stream's state holds its last
// W - 1 inputs before this pass: state_b = conv_state_ptrs[b] -> bf16 [W - 1, C] (rows state_stride elements
// apart, row W - 2 the newest). Afterwards it holds the last W - 1 inputs of (old state, this pass's rows).
// Weights w [C, W] and the optional bias [C] are bf16; the sum is accumulated in fp32 and rounded once. SiLU is
// acc / (1 + e^-acc) with the fast intrinsics (__expf, __fdividef: a few fp32 ulps, far below the bf16 rounding
// of the result; acc below about -87 gives -0): expf and an IEEE division made the kernel issue-bound.
//
// A thread owns 8 channels (one 16-byte vector) of one segment of kSegment consecutive tokens of one stream:
// grid (ceil(C / 8 / kThreads), ceil(chunk_len / kSegment), n). Its input rows (the W - 1 before the segment, from
// x or, in the stream's first segment, from the state; then the segment's own) stream through its own ring of
// kRing 16-byte slots in shared memory: one cp.async copy and one commit group a row, kRing - 1 rows in flight
// while it computes one, so the bytes in flight scale with shared memory, not registers. No barrier: a thread
// reads only the slots it copied into itself (its cp.async.wait_group makes them visible to it). It keeps the
// last W - 1 inputs in registers; every x row is read once, plus W - 1 rows a segment, and every y row written
// once. Only the first segment's thread reads and rewrites a stream's state (it reads the stream's last W - 1
// rows of x for the new state), so no thread reads a state another one writes. x and y must not overlap (the
// host checks). A stream with no tokens (a pass padded for a CUDA graph) leaves its state as it was. A CTA never
// mixes streams: a stream gets the same bits batched and alone.
//
// Requirements (checked by the host): C, x_stride, y_stride and state_stride multiples of 8; x, y, w, the states
// 16-byte aligned (a thread reads its 8 channels' W taps, 16 W contiguous bytes, as W 16-byte vectors); 2 <= W <= 4.
#include "common/q12_meta.cuh"

// The kernel's configuration: every number its code and the host's launch geometry use.
struct Conv1dConfig {
    int threads;  // threads per CTA
    int segment;  // tokens a thread walks: W - 1 rows of overlap per segment
    int vec;      // channels per thread: one 16-byte vector of bf16
    int ring;     // slots of each thread's shared-memory ring of row copies: ring - 1 rows in flight while it
                  // computes one
};
__host__ __device__ constexpr Conv1dConfig conv1d_config() { return {128, 64, 8, 16}; }
static_assert(conv1d_config().ring * conv1d_config().threads * 16 <= 48 * 1024, "the ring is static shared memory");

// The host's launch numbers (q12drv.kernels.conv1d.CONTRACTS) must be the source's.
#if !defined(Q12_CONV1D_THREADS) || !defined(Q12_CONV1D_SEGMENT) || !defined(Q12_CONV1D_VEC)
#error "compile through q12drv (registry.compile_defines): it passes the host's Q12_CONV1D_* contract defines"
#endif
static_assert(Q12_CONV1D_THREADS == conv1d_config().threads, "conv1d.THREADS differs from the kernel's");
static_assert(Q12_CONV1D_SEGMENT == conv1d_config().segment, "conv1d.SEGMENT differs from the kernel's");
static_assert(Q12_CONV1D_VEC == conv1d_config().vec, "conv1d's channels per thread differ from the kernel's");

namespace {

constexpr int kThreads = conv1d_config().threads;
constexpr int kSegment = conv1d_config().segment;
constexpr int kVec = conv1d_config().vec;
constexpr int kRing = conv1d_config().ring;

__device__ __forceinline__ uint4 pack8(const float (&f)[kVec]) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
}

__device__ __forceinline__ uint4 load_nc(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// One row into a ring slot (shared address): a 16-byte cp.async that bypasses L1 (every row is read once).
__device__ __forceinline__ void copy_row(unsigned int slot, const bf16* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(slot), "l"(src) : "memory");
}
// One commit group a row (empty past the segment's last row), so the groups count rows.
__device__ __forceinline__ void commit_row() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until this thread's oldest row in flight has landed: at most kRing - 1 newer ones still pending.
__device__ __forceinline__ void wait_oldest_row() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kRing - 1) : "memory");
}

// bf16 element i of a 16-byte row, as fp32 (exact).
__device__ __forceinline__ float lane(const uint4& v, int i) {
    const unsigned int word = (&v.x)[i / 2];
    return __uint_as_float(i % 2 ? word & 0xffff0000u : word << 16);
}

// out = act(bias + taps . (hist, cur)) for 8 channels, in fp32: the taps oldest first, one fma each.
template <int W>
__device__ __forceinline__ uint4 conv8(const float (&wt)[W][kVec], const uint4& b0, const uint4 (&hist)[W - 1],
                                       const uint4& cur, int silu) {
    float out[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
        float acc = lane(b0, i);
#pragma unroll
        for (int j = 0; j < W - 1; ++j) acc = fmaf(wt[j][i], lane(hist[j], i), acc);
        acc = fmaf(wt[W - 1][i], lane(cur, i), acc);
        out[i] = silu ? __fdividef(acc, 1.f + __expf(-acc)) : acc;  // fast intrinsics: the header says why
    }
    return pack8(out);
}

template <int W>
__device__ __forceinline__ void conv1d_body(const Q12Meta& m, const bf16* __restrict__ x, bf16* __restrict__ y,
                                            const bf16* __restrict__ w, const bf16* __restrict__ bias,
                                            const u64* __restrict__ state_ptrs, int channels, int x_stride,
                                            int y_stride, int state_stride, int silu) {
    static_assert(W >= 2 && W <= 4, "widths 2..4");
    // Each thread's ring: slot s of thread t at ring[s][t], so a warp's 32 slots of one row are contiguous.
    __shared__ uint4 ring[kRing][kThreads];
    const int b = blockIdx.z;
    const int c0 = (blockIdx.x * kThreads + threadIdx.x) * kVec;
    if (c0 >= channels) return;
    const int* cu = q12_cu_seqlens(m);
    const int first = cu[b];
    const int len = cu[b + 1] - first;
    const int s0 = blockIdx.y * kSegment;
    if (s0 >= len) return;
    const int n = min(kSegment, len - s0);  // the segment's tokens
    const int rows = n + W - 1;             // its input rows: the W - 1 before it, then its own

    bf16* state = reinterpret_cast<bf16*>(state_ptrs[b]);
    const bf16* xs = x + (long long)first * x_stride + c0;
    // Input row k is the stream's token s0 - (W - 1) + k: an x row, or a state row before the stream's first token.
    // It goes to slot (k - (W - 1)) mod kRing, so that the segment's token i sits in slot i mod kRing.
    const unsigned int mine = static_cast<unsigned int>(__cvta_generic_to_shared(&ring[0][threadIdx.x]));
    constexpr unsigned int kSlot = kThreads * 16;  // bytes from one slot of a thread to its next
#pragma unroll
    for (int k = 0; k < kRing; ++k) {
        const unsigned int slot = mine + ((k + kRing - (W - 1)) % kRing) * kSlot;
        const int p = s0 - (W - 1) + k;
        if (k < W - 1 && p < 0) {
            copy_row(slot, state + (long long)(W - 1 + p) * state_stride + c0);
        } else if (k < rows) {
            copy_row(slot, xs + (long long)p * x_stride);
        }
        commit_row();
    }
    const bf16* next = xs + (long long)(s0 - (W - 1) + kRing) * x_stride;  // input row kRing: always an x row

    float wt[W][kVec];  // the 8 channels' taps: w[c0 .. c0 + 8, 0 .. W), 16 W contiguous bytes
    {
        uint4 raw[W];
#pragma unroll
        for (int j = 0; j < W; ++j) raw[j] = *reinterpret_cast<const uint4*>(w + (long long)c0 * W + 8 * j);
        const bf16* taps = reinterpret_cast<const bf16*>(raw);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
#pragma unroll
            for (int j = 0; j < W; ++j) wt[j][i] = __bfloat162float(taps[i * W + j]);
        }
    }
    uint4 b0 = make_uint4(0u, 0u, 0u, 0u);  // the 8 channels' bias, bf16 (0 without one)
    if (bias) {
        unsigned short* h = reinterpret_cast<unsigned short*>(&b0);
#pragma unroll
        for (int i = 0; i < kVec; ++i) h[i] = __bfloat16_as_ushort(bias[c0 + i]);
    }

    // hist[j]: the input W - 1 - j tokens before the current one (hist[W - 2] the newest), kept as bf16 (half the
    // registers of fp32) and converted where used. A slot is refilled with the row kRing later once its row is in
    // registers (ptxas keeps a thread's ld.shared of a slot ahead of its later cp.async into it).
    uint4 hist[W - 1];
#pragma unroll
    for (int j = 0; j < W - 1; ++j) {
        const int slot = (j + kRing - (W - 1)) % kRing;
        wait_oldest_row();
        hist[j] = ring[slot][threadIdx.x];
        if (j + kRing < rows) {
            copy_row(mine + slot * kSlot, next);
            next += x_stride;
        }
        commit_row();
    }

    bf16* ys = y + (long long)(first + s0) * y_stride + c0;
    int slot = 0;  // the segment's token i sits in slot i mod kRing
    for (int left = n; left > 0; --left) {  // left: the segment's tokens not yet written, this one included
        wait_oldest_row();
        const uint4 cur = ring[slot][threadIdx.x];
        *reinterpret_cast<uint4*>(ys) = conv8<W>(wt, b0, hist, cur, silu);
        ys += y_stride;
        // refill the slot with the row kRing later, if the segment has it; the row's y store, which needed the
        // slot's value, is issued first
        if (left > kRing) {
            copy_row(mine + slot * kSlot, next);
            next += x_stride;
        }
        commit_row();
#pragma unroll
        for (int j = 0; j < W - 2; ++j) hist[j] = hist[j + 1];
        hist[W - 2] = cur;
        slot = slot + 1 == kRing ? 0 : slot + 1;
    }

    if (s0 == 0) {  // the new state: the last W - 1 inputs of (old state, x rows)
        uint4 rows_[W - 1];
#pragma unroll
        for (int r = 0; r < W - 1; ++r) {
            const int p = len - (W - 1) + r;  // p < 0 only in a stream shorter than W - 1 tokens: the old state's
                                              // rows, read before any is rewritten
            rows_[r] = p >= 0 ? load_nc(xs + (long long)p * x_stride)
                              : *reinterpret_cast<const uint4*>(state + (long long)(W - 1 + p) * state_stride + c0);
        }
#pragma unroll
        for (int r = 0; r < W - 1; ++r)
            *reinterpret_cast<uint4*>(state + (long long)r * state_stride + c0) = rows_[r];
    }
}

}  // namespace

#define CONV1D_PARAMS                                                                                        \
    const Q12Meta m, const bf16* __restrict__ x, bf16* __restrict__ y, const bf16* __restrict__ w,           \
        const bf16* __restrict__ bias, const unsigned long long* __restrict__ state_ptrs, int channels,      \
        int x_stride, int y_stride, int state_stride, int silu
#define CONV1D_ARGS m, x, y, w, bias, state_ptrs, channels, x_stride, y_stride, state_stride, silu

extern "C" __global__ void __launch_bounds__(kThreads) q12_conv1d_w2(CONV1D_PARAMS) { conv1d_body<2>(CONV1D_ARGS); }
extern "C" __global__ void __launch_bounds__(kThreads) q12_conv1d_w3(CONV1D_PARAMS) { conv1d_body<3>(CONV1D_ARGS); }
extern "C" __global__ void __launch_bounds__(kThreads) q12_conv1d_w4(CONV1D_PARAMS) { conv1d_body<4>(CONV1D_ARGS); }
