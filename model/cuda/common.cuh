// Device helpers the kernel files share: bfloat16 loads and stores, the scalar functions with torch's
// conventions, warp and block reductions, the elementwise driver and the two-pass column sums that make
// weight gradients deterministic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/dependent_launch.h"
#include "kernels.h"

namespace deltatrain::model::cuda {

using bf16 = __nv_bfloat16;

constexpr int kVector = 8;  // bfloat16 elements in one 16-byte access

__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ bf16 to_bf16(float x) { return __float2bfloat16_rn(x); }

template <class T>
__device__ __forceinline__ T* row_of(const Matrix& m, Index r) {
  return static_cast<T*>(m.data) + r * m.ld;
}

// 1 / d, correctly rounded, for d in [1, 2]: the hardware reciprocal and one Newton step, which is __frcp_rn's own
// path for such d, without its branch to a subroutine for denormal and huge d. That branch, taken never, still cut
// every sigmoid out of the straight-line code around it (two per row and channel in the conv backward's unrolled
// rows), so the compiler could not interleave the rows.
__device__ __forceinline__ float reciprocal_of_1_to_2(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return fmaf(r, fmaf(-d, r, 1.f), r);
}

// Stable for large |x|: exp(-|x|) cannot overflow, and one correctly rounded reciprocal of 1 + exp(-|x|) (in
// [1, 2]) serves both signs. The hardware exponential (__expf, a few ulp) keeps the element-wise kernels that apply
// it to every activation (SiLU in the conv, the MLP and the gated norm) from being bound by arithmetic; its error is
// far below the bfloat16 rounding of their outputs.
__device__ __forceinline__ float sigmoid(float x) {
  const float e = __expf(-fabsf(x));
  const float r = reciprocal_of_1_to_2(1.f + e);
  return x >= 0.f ? r : e * r;
}
__device__ __forceinline__ float silu(float x) { return x * sigmoid(x); }
__device__ __forceinline__ float silu_grad(float x) {
  const float s = sigmoid(x);
  return s * (1.f + x * (1.f - s));
}
// torch's softplus with threshold 20 (the identity above it, derivative 1 there).
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float softplus_grad(float x) { return x > 20.f ? 1.f : sigmoid(x); }

// The GDN gates' pieces, forward and backward (gates.cu): softplus's input a + dt_bias at row t and head j (a
// [T, HV], dt_bias [HV], bfloat16), and head j's decay rate exp(A_log).
__device__ __forceinline__ float gate_input(const Matrix& a, const void* dt_bias, Index t, Index j) {
  return to_float(row_of<const bf16>(a, t)[j]) + to_float(static_cast<const bf16*>(dt_bias)[j]);
}
__device__ __forceinline__ float gate_decay(const void* a_log, Index j) {
  return expf(to_float(static_cast<const bf16*>(a_log)[j]));
}

// Element `index` of the GDN gates' [rows, H] (kernels.h's GatesForward): g = -exp(A_log) softplus(a + dt_bias),
// beta = sigmoid(b); the gates' kernel and the decode conv step's both compute them here.
__device__ __forceinline__ void gates_forward_at(const GatesForward& p, Index index) {
  const Index H = p.a.cols, t = index / H, j = index % H;
  row_of<float>(p.g, t)[j] = -gate_decay(p.a_log, j) * softplus(gate_input(p.a, p.dt_bias, t, j));
  row_of<float>(p.beta, t)[j] = sigmoid(to_float(row_of<const bf16>(p.b, t)[j]));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread. The order
// is fixed by the block shape, so results are reproducible.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < warps ? partial[lane] : 0.f;
  return warp_sum(v);
}

// A norm's arithmetic, shared by every kernel that normalises rows (norms.cu; decode.cu's attention_inputs_step) so
// that they round alike: a lane's sum of squares (one fused multiply-add an element, in column order), the scale
// from a row's sum, and an element's output.
__device__ __forceinline__ float add_squares(float ss, const float (&v)[kVector]) {
#pragma unroll
  for (int k = 0; k < kVector; ++k) ss = __fmaf_rn(v[k], v[k], ss);
  return ss;
}
__device__ __forceinline__ float rms_scale(float sum_of_squares, Index cols, float eps) {
  return 1.f / sqrtf(sum_of_squares / static_cast<float>(cols) + eps);
}
__device__ __forceinline__ float normed(float x, float s, float gain, bool zero_centred) {
  return x * s * (zero_centred ? 1.f + gain : gain);
}

// RoPE's arithmetic (sequence.cu's rope; decode.cu's attention_inputs_step), the same bits in each: HF's float32
// angle of pair i (elements i and i + rotary_dim / 2) at a position, inv_freq = 1 / theta^(2i / rotary_dim), and the
// pair rotated, x cos + rotate_half(x) sin with rotate_half(x) = (-x2, x1), its roundings explicit.
struct Rotation {
  float c, s;
};
__device__ __forceinline__ Rotation rope_rotation(int i, int rotary_dim, float theta, Index position, bool inverse) {
  const float inv_freq = 1.f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(rotary_dim));
  const float angle = static_cast<float>(position) * inv_freq;
  return {cosf(angle), inverse ? -sinf(angle) : sinf(angle)};
}
__device__ __forceinline__ float2 rotate(float x1, float x2, Rotation r) {
  return {__fmaf_rn(x1, r.c, -__fmul_rn(x2, r.s)), __fmaf_rn(x2, r.c, __fmul_rn(x1, r.s))};
}

// exp(x) = exp2(x * kLog2e): the base-2 form is one FMA and one MUFU.EX2.
inline constexpr float kLog2e = 1.4426950408889634f;

// A running maximum and the sum of exp(x - max) over the values seen: merged without overflow.
struct MaxSum {
  float max = -INFINITY, sum = 0.f;
  // N values at once: one comparison with the maximum for all of them, and base-2 exponentials (an FMA and one
  // MUFU.EX2 each) where add() branches and calls the accurate expf per value; -INFINITY adds nothing. For long
  // rows: the cross-entropy over a 248k vocabulary was issue-bound with add().
  template <int N>
  __device__ void add_n(const float (&x)[N]) {
    float top = x[0];
#pragma unroll
    for (int k = 1; k < N; ++k) top = fmaxf(top, x[k]);
    if (top == -INFINITY) return;
    if (top > max) {
      sum *= exp2f((max - top) * kLog2e);
      max = top;
    }
    const float shift = max * kLog2e;
#pragma unroll
    for (int k = 0; k < N; ++k) sum += exp2f(fmaf(x[k], kLog2e, -shift));
  }
  __device__ void add(float x) {
    if (x > max) {
      sum = sum * expf(max - x) + 1.f;
      max = x;
    } else {
      sum += expf(x - max);
    }
  }
  __device__ void merge(MaxSum o) {
    if (o.max == -INFINITY) return;
    if (o.max > max) {
      sum = sum * expf(max - o.max) + o.sum;
      max = o.max;
    } else {
      sum += o.sum * expf(o.max - max);
    }
  }
};

__device__ __forceinline__ MaxSum warp_max_sum(MaxSum v) {
  for (int offset = 16; offset > 0; offset /= 2) {
    MaxSum o;
    o.max = __shfl_xor_sync(0xffffffffu, v.max, offset);
    o.sum = __shfl_xor_sync(0xffffffffu, v.sum, offset);
    v.merge(o);
  }
  return v;
}

__device__ __forceinline__ MaxSum block_max_sum(MaxSum v) {
  __shared__ float maxes[32], sums[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_max_sum(v);
  __syncthreads();
  if (lane == 0) {
    maxes[warp] = v.max;
    sums[warp] = v.sum;
  }
  __syncthreads();
  MaxSum w;
  if (lane < warps) {
    w.max = maxes[lane];
    w.sum = sums[lane];
  }
  return warp_max_sum(w);
}

// Decode's kernels launch as programmatic dependents (deltatrain/core/dependent_launch.h): each may be scheduled
// while the kernel before it drains, and begins with start_after_previous_grid(), before any access to memory.
__device__ __forceinline__ void start_after_previous_grid() {
  wait_for_previous_grid();
  allow_next_grid();
}
template <class... Params, class... Args>
void launch_after_previous(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes,
                           cudaStream_t stream, Args... args) {
  launch_dependent(kernel, grid, block, shared_bytes, stream, args...);
  check_launch(name);
}

inline unsigned grid_for(Index work, int per_block) { return static_cast<unsigned>((work + per_block - 1) / per_block); }

// 16-byte accesses need a 16-byte aligned start and rows that keep it.
inline bool vectorizable(const Matrix& m) {
  return reinterpret_cast<std::uintptr_t>(m.data) % 16 == 0 && m.ld % kVector == 0 && m.cols % kVector == 0;
}

// The 2-, 4- and 8-element (4-, 8- and 16-byte) accesses load_n and store_n move as one.
template <int N>
struct PackedBf16;
template <>
struct PackedBf16<2> {
  using type = unsigned int;
};
template <>
struct PackedBf16<4> {
  using type = uint2;
};
template <>
struct PackedBf16<8> {
  using type = uint4;
};

// N bfloat16 elements as loaded, not yet converted: a kernel can fetch rows ahead of their use and keep the loads
// travelling in the registers (conversion would wait for them).
template <int N>
struct alignas(2 * N) RawBf16 {
  bf16 e[N];
};

// Elements [c0, c0 + N) of a bfloat16 row: one access of 2N bytes, or element by element up to cols (zeros
// past it).
template <int N, bool Vectorized>
__device__ __forceinline__ RawBf16<N> fetch_n(const bf16* row, Index c0, Index cols) {
  RawBf16<N> raw;
  if constexpr (Vectorized) {
    *reinterpret_cast<typename PackedBf16<N>::type*>(&raw) =
        *reinterpret_cast<const typename PackedBf16<N>::type*>(row + c0);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) raw.e[k] = c0 + k < cols ? row[c0 + k] : to_bf16(0.f);
  }
  return raw;
}

template <int N>
__device__ __forceinline__ void unpack(const RawBf16<N>& raw, float (&v)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = to_float(raw.e[k]);
}

// Elements [c0, c0 + N) of a bfloat16 row as floats (zeros past cols).
template <int N, bool Vectorized>
__device__ __forceinline__ void load_n(const bf16* row, Index c0, Index cols, float (&v)[N]) {
  unpack(fetch_n<N, Vectorized>(row, c0, cols), v);
}

template <int N, bool Vectorized>
__device__ __forceinline__ void store_n(bf16* row, Index c0, Index cols, const float (&v)[N]) {
  if constexpr (Vectorized) {
    typename PackedBf16<N>::type packed;
    bf16* e = reinterpret_cast<bf16*>(&packed);
#pragma unroll
    for (int k = 0; k < N; ++k) e[k] = to_bf16(v[k]);
    *reinterpret_cast<typename PackedBf16<N>::type*>(row + c0) = packed;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (c0 + k < cols) row[c0 + k] = to_bf16(v[k]);
  }
}

template <bool Vectorized>
__device__ __forceinline__ void load8(const bf16* row, Index c0, Index cols, float (&v)[kVector]) {
  load_n<kVector, Vectorized>(row, c0, cols, v);
}

template <bool Vectorized>
__device__ __forceinline__ void store8(bf16* row, Index c0, Index cols, const float (&v)[kVector]) {
  store_n<kVector, Vectorized>(row, c0, cols, v);
}

// ---------------------------------------------------------------------------------------------------------
// Elementwise: f(in[In], out[Out]) on floats for each element of equally shaped bfloat16 matrices, each
// thread taking 8 consecutive elements of a row (one 16-byte access per matrix when all allow it).

template <int In, int Out>
struct Operands {
  Matrix in[In];
  Matrix out[Out];
};

template <bool Vectorized, int In, int Out, class F>
__global__ void elementwise_kernel(Operands<In, Out> m, Index rows, Index cols, F f) {
  start_after_previous_grid();
  const Index chunks = (cols + kVector - 1) / kVector;
  const Index index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index >= rows * chunks) return;
  const Index r = index / chunks, c0 = index % chunks * kVector;
  float x[In][kVector], y[Out][kVector];
#pragma unroll
  for (int i = 0; i < In; ++i) load8<Vectorized>(row_of<const bf16>(m.in[i], r), c0, cols, x[i]);
#pragma unroll
  for (int k = 0; k < kVector; ++k) {
    float a[In], b[Out];
#pragma unroll
    for (int i = 0; i < In; ++i) a[i] = x[i][k];
    f(a, b);
#pragma unroll
    for (int o = 0; o < Out; ++o) y[o][k] = b[o];
  }
#pragma unroll
  for (int o = 0; o < Out; ++o) store8<Vectorized>(row_of<bf16>(m.out[o], r), c0, cols, y[o]);
}

template <int In, int Out, class F>
void elementwise(const char* name, const std::array<Matrix, In>& in, const std::array<Matrix, Out>& out, F f,
                 cudaStream_t stream) {
  const Index rows = out[0].rows, cols = out[0].cols;
  if (rows == 0 || cols == 0) return;
  Operands<In, Out> m;
  bool vectorized = true;
  for (int i = 0; i < In; ++i) {
    m.in[i] = in[i];
    vectorized = vectorized && vectorizable(in[i]);
  }
  for (int o = 0; o < Out; ++o) {
    m.out[o] = out[o];
    vectorized = vectorized && vectorizable(out[o]);
  }
  constexpr int threads = 256;
  const unsigned blocks = grid_for(rows * ((cols + kVector - 1) / kVector), threads);
  launch_after_previous(name, vectorized ? elementwise_kernel<true, In, Out, F> : elementwise_kernel<false, In, Out, F>,
                        blocks, threads, 0, stream, m, rows, cols, f);
}

// ---------------------------------------------------------------------------------------------------------
// Deterministic sums over rows: dst[c] += sum_r f(r, c) for c < cols, as fixed blocks of rows whose partial
// sums a second kernel adds in block order. Nothing depends on timing, so the result is bitwise stable.

constexpr int kColumnThreads = 128;

template <class F>
__global__ void column_partials_kernel(F f, Index rows, Index cols, Index rows_per_block, float* partials) {
  const Index c = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  const Index first = blockIdx.y * rows_per_block, last = min(rows, first + rows_per_block);
  float sum = 0.f;
  for (Index r = first; r < last; ++r) sum += f(r, c);
  partials[blockIdx.y * cols + c] = sum;
}

// dst[c] += the sum over b of partials[b * cols + c]: a block takes 32 columns with 32 warps, warp y adding
// blocks y, y + 32, ... of them (its 32 lanes on adjacent columns: coalesced), then the warps' sums added in
// warp order. A fixed order, so bitwise stable; and 1024 loads in flight a block, not 32 threads each
// walking thousands of partial rows one at a time.
constexpr int kFinishColumns = 32, kFinishWarps = 32;

template <class Unused = void>
__global__ void __launch_bounds__(kFinishColumns * kFinishWarps)
    column_finish_kernel(const float* partials, Index blocks, Index cols, float* dst) {
  __shared__ float warp_sums[kFinishWarps][kFinishColumns + 1];
  const Index c = blockIdx.x * static_cast<Index>(kFinishColumns) + threadIdx.x;
  float sum = 0.f;
  if (c < cols)
    for (Index b = threadIdx.y; b < blocks; b += kFinishWarps) sum += partials[b * cols + c];
  warp_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  float total = 0.f;
  for (int w = 0; w < kFinishWarps; ++w) total += warp_sums[w][threadIdx.x];
  dst[c] += total;
}

inline void column_finish(const char* name, const float* partials, Index blocks, Index cols, float* dst,
                          cudaStream_t stream) {
  if (cols == 0) return;
  column_finish_kernel<<<grid_for(cols, kFinishColumns), dim3(kFinishColumns, kFinishWarps), 0, stream>>>(
      partials, blocks, cols, dst);
  check_launch(name);
}

template <class F>
void column_sums(const char* name, F f, Index rows, Index cols, float* dst, Workspace& workspace,
                 cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  constexpr Index kMaxBlocks = 65535;  // gridDim.y
  const Index rows_per_block = std::max<Index>(256, (rows + kMaxBlocks - 1) / kMaxBlocks);
  const Index blocks = (rows + rows_per_block - 1) / rows_per_block;
  auto* partials = reinterpret_cast<float*>(workspace.reserve(blocks * cols * sizeof(float)));
  const dim3 grid(grid_for(cols, kColumnThreads), static_cast<unsigned>(blocks));
  column_partials_kernel<<<grid, kColumnThreads, 0, stream>>>(f, rows, cols, rows_per_block, partials);
  check_launch(name);
  column_finish(name, partials, blocks, cols, dst, stream);
}

// The sequence n holding row t: cu[n] <= t < cu[n + 1] (binary search; empty sequences are skipped over).
__device__ __forceinline__ int sequence_of(const Sequences& s, Index t) {
  int lo = 0, hi = s.count;  // s.cu[lo] <= t < s.cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (s.cu[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace deltatrain::model::cuda
