// conv1d.cu: causal depthwise convolution over the packed streams of a pass, with SiLU and a per-stream state
// updated in place (the short convolution of Qwen3-Next's Gated DeltaNet layer, before the delta rule).
//
// Stream b's tokens are rows cu_seqlens[b] .. cu_seqlens[b+1] of x [T, C] (bf16, rows x_stride elements apart).
// For the stream's local token t and channel c:
//     y[t, c] = act(bias[c] + sum_{j < W} w[c, j] * in(t - (W - 1) + j, c)),    act = SiLU, or none
// where in(p, c) = x[p, c] for p >= 0 and state_b[W - 1 + p, c] for p < 0. The stream's state holds its last
// W - 1 inputs before this pass: state_b = conv_state_ptrs[b] -> bf16 [W - 1, C] (rows state_stride elements
// apart, row W - 2 the newest). Afterwards it holds the last W - 1 inputs of (old state, this pass's rows).
// Weights w [C, W] and the optional bias [C] are bf16; the sum is accumulated in fp32 and rounded once.
//
// A thread owns 8 channels (one 16-byte vector) of one segment of kSegment consecutive tokens of one stream:
// grid (ceil(C / 8 / kThreads), ceil(chunk_len / kSegment), n). It reads the W - 1 inputs before its segment
// (from x, or from the state in the stream's first segment), then walks its tokens with the last W - 1 inputs in
// registers (kUnroll rows loaded ahead): every x row is read once, plus W - 1 rows a segment, and every y row
// written once. Only the first
// segment's thread reads and rewrites a stream's state (it reads the stream's last W - 1 rows of x for the new
// state), so no thread reads a state another one writes. x and y must not overlap (the host checks). A stream
// with no tokens (a pass padded for a CUDA graph) leaves its state as it was. A CTA never mixes streams: a stream
// gets the same bits batched and alone.
//
// Requirements (checked by the host): C, x_stride, y_stride and state_stride multiples of 8; x, y, w, the states
// 16-byte aligned; 2 <= W <= 4.
#include "common/q12_meta.cuh"

// The kernel's configuration: every number its code and the host's launch geometry use.
struct Conv1dConfig {
    int threads;  // threads per CTA
    int segment;  // tokens a thread walks: W - 1 rows of overlap per segment
    int vec;      // channels per thread: one 16-byte vector of bf16
    int unroll;   // rows a thread loads before it computes them (loads in flight)
};
__host__ __device__ constexpr Conv1dConfig conv1d_config() { return {128, 32, 8, 8}; }

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
constexpr int kUnroll = conv1d_config().unroll;

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[kVec]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 p = __bfloat1622float2(h[i]);
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}

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

template <int W>
__device__ __forceinline__ void conv1d_body(const Q12Meta& m, const bf16* __restrict__ x, bf16* __restrict__ y,
                                            const bf16* __restrict__ w, const bf16* __restrict__ bias,
                                            const u64* __restrict__ state_ptrs, int channels, int x_stride,
                                            int y_stride, int state_stride, int silu) {
    static_assert(W >= 2 && W <= 4, "widths 2..4");
    const int b = blockIdx.z;
    const int c0 = (blockIdx.x * kThreads + threadIdx.x) * kVec;
    if (c0 >= channels) return;
    const int* cu = q12_cu_seqlens(m);
    const int first = cu[b];
    const int len = cu[b + 1] - first;
    const int s0 = blockIdx.y * kSegment;
    if (s0 >= len) return;
    const int s1 = min(s0 + kSegment, len);

    float wt[W][kVec];  // the 8 channels' taps
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
#pragma unroll
        for (int j = 0; j < W; ++j) wt[j][i] = __bfloat162float(w[(long long)(c0 + i) * W + j]);
    }
    float b0[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) b0[i] = bias ? __bfloat162float(bias[c0 + i]) : 0.f;

    bf16* state = reinterpret_cast<bf16*>(state_ptrs[b]);
    const bf16* xs = x + (long long)first * x_stride + c0;
    // hist[j]: the input W - 1 - j tokens before the current one (hist[W - 2] the newest)
    float hist[W - 1][kVec];
#pragma unroll
    for (int j = 0; j < W - 1; ++j) {
        const int p = s0 - (W - 1) + j;
        uint4 v;
        if (p >= 0) {
            v = load_nc(xs + (long long)p * x_stride);
        } else {
            v = *reinterpret_cast<const uint4*>(state + (long long)(W - 1 + p) * state_stride + c0);
        }
        unpack8(v, hist[j]);
    }

    for (int t0 = s0; t0 < s1; t0 += kUnroll) {
        uint4 raw[kUnroll];  // the next kUnroll rows' loads in flight together
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (t0 + u < s1) raw[u] = load_nc(xs + (long long)(t0 + u) * x_stride);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            if (t0 + u >= s1) break;
            float cur[kVec], out[kVec];
            unpack8(raw[u], cur);
#pragma unroll
            for (int i = 0; i < kVec; ++i) {
                float acc = b0[i];
#pragma unroll
                for (int j = 0; j < W - 1; ++j) acc = fmaf(wt[j][i], hist[j][i], acc);
                acc = fmaf(wt[W - 1][i], cur[i], acc);
                out[i] = silu ? acc / (1.f + expf(-acc)) : acc;
            }
            *reinterpret_cast<uint4*>(y + ((long long)(first + t0 + u)) * y_stride + c0) = pack8(out);
#pragma unroll
            for (int j = 0; j < W - 2; ++j) {
#pragma unroll
                for (int i = 0; i < kVec; ++i) hist[j][i] = hist[j + 1][i];
            }
#pragma unroll
            for (int i = 0; i < kVec; ++i) hist[W - 2][i] = cur[i];
        }
    }

    if (s0 == 0) {  // the new state: the last W - 1 inputs of (old state, x rows)
        uint4 rows[W - 1];
#pragma unroll
        for (int r = 0; r < W - 1; ++r) {
            const int p = len - (W - 1) + r;  // p < 0 only in a stream shorter than W - 1 tokens: the old state's
                                              // rows, read before any is rewritten
            rows[r] = p >= 0 ? load_nc(xs + (long long)p * x_stride)
                             : *reinterpret_cast<const uint4*>(state + (long long)(W - 1 + p) * state_stride + c0);
        }
#pragma unroll
        for (int r = 0; r < W - 1; ++r)
            *reinterpret_cast<uint4*>(state + (long long)r * state_stride + c0) = rows[r];
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
