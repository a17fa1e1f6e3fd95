// Ops along packed sequences: the causal depthwise convolution with SiLU and partial NeoX RoPE, and their decode
// forms (the conv over a cached history, RoPE at given positions). Each thread finds its row's sequence by binary
// search in cu_seqlens on the device, so launches need no host work.
#include <iterator>
#include <string>

#include "common.cuh"
#include "deltatrain/core/error.h"

namespace deltatrain::model::cuda {
namespace {

struct Conv {
  Matrix x, w;  // [T, C], [C, W]
  Sequences seq;

  // pre[t, c] over the taps at or after the sequence's first row `start`.
  __device__ float pre(Index t, Index c, Index start) const {
    const Index W = w.cols;
    const bf16* wc = row_of<const bf16>(w, c);
    float sum = 0.f;
    for (Index j = max(Index{0}, start - (t - (W - 1))); j < W; ++j)
      sum += to_float(wc[j]) * to_float(row_of<const bf16>(x, t - (W - 1) + j)[c]);
    return sum;
  }
};

__global__ void conv1d_silu_forward_kernel(Matrix out, Conv conv) {
  const Index C = conv.x.cols, index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index >= conv.x.rows * C) return;
  const Index t = index / C, c = index % C;
  const Index start = conv.seq.cu[sequence_of(conv.seq, t)];
  row_of<bf16>(out, t)[c] = to_bf16(silu(conv.pre(t, c, start)));
}

// The backward of conv1d + SiLU in one pass: thread c of block (x, y) walks channel c down the strip of rows
// [t0, t1) = [y, y + 1) x strip_rows and the W - 1 rows after it, keeping the last W inputs and the last W
// values of dpre = dout silu'(pre) in registers. So each pre-activation is computed once (not once per tap of
// each gradient, 2W times), and the strip's weight-gradient sums go to partials[y][c * W + j] for
// column_finish_kernel to add in strip order (deterministic). dx[t] = sum_j w[c, j] dpre[t + (W - 1) - j] over
// the rows of t's sequence; dweight[c, j] = sum_t dpre[t] x[t - (W - 1) + j] over the taps inside t's sequence.
template <int W>
__global__ void __launch_bounds__(128) conv1d_silu_backward_kernel(Matrix dx, Matrix dout, Conv conv, Index strip_rows,
                                                                   float* partials) {
  const Index C = conv.x.cols, T = conv.x.rows;
  const Index c = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const Index t0 = blockIdx.y * strip_rows, t1 = min(T, t0 + strip_rows);
  float w[W], window[W], dpre[W], dweight[W];
  int sequence_at[W];  // the sequence of the rows dpre holds (-1: past the last row)
#pragma unroll
  for (int j = 0; j < W; ++j) {
    w[j] = to_float(row_of<const bf16>(conv.w, c)[j]);
    // window[j] is x[u - (W - 1) + j] at row u; before the first shift (u = t0), the rows up to t0 - 1.
    const Index r = t0 - W + j;
    window[j] = r >= 0 ? to_float(row_of<const bf16>(conv.x, r)[c]) : 0.f;
    dpre[j] = 0.f;
    dweight[j] = 0.f;
    sequence_at[j] = -1;
  }
  int n = sequence_of(conv.seq, t0);
  Index start = conv.seq.cu[n], end = conv.seq.cu[n + 1];
  for (Index u = t0; u < t1 + (W - 1); ++u) {
    const bool inside = u < T;
#pragma unroll
    for (int j = 0; j + 1 < W; ++j) {
      window[j] = window[j + 1];
      dpre[j] = dpre[j + 1];
      sequence_at[j] = sequence_at[j + 1];
    }
    float d = 0.f;
    if (inside) {
      while (u >= end) {  // the next sequence holding u (empty ones are skipped)
        ++n;
        start = conv.seq.cu[n];
        end = conv.seq.cu[n + 1];
      }
      window[W - 1] = to_float(row_of<const bf16>(conv.x, u)[c]);
      // The taps in the order Conv::pre sums them (the forward's), only those inside u's sequence.
      float pre = 0.f;
#pragma unroll
      for (int j = 0; j < W; ++j)
        if (u - (W - 1) + j >= start) pre += w[j] * window[j];
      d = to_float(row_of<const bf16>(dout, u)[c]) * silu_grad(pre);
      if (u < t1) {
#pragma unroll
        for (int j = 0; j < W; ++j)
          if (u - (W - 1) + j >= start) dweight[j] += d * window[j];
      }
    }
    dpre[W - 1] = d;
    sequence_at[W - 1] = inside ? n : -1;
    // Row t = u - (W - 1) now has every later row whose taps read it.
    const Index t = u - (W - 1);
    if (t >= t0 && t < t1) {
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const int k = W - 1 - j;  // dpre[k] is row t + k, whose tap j reads row t
        if (sequence_at[k] == sequence_at[0]) sum += w[j] * dpre[k];
      }
      row_of<bf16>(dx, t)[c] = to_bf16(sum);
    }
  }
#pragma unroll
  for (int j = 0; j < W; ++j) partials[blockIdx.y * C * W + c * W + j] = dweight[j];
}

template <int W>
void launch_conv1d_silu_backward(dim3 grid, cudaStream_t stream, Matrix dx, Matrix dout, Conv conv, Index strip_rows,
                                 float* partials) {
  conv1d_silu_backward_kernel<W><<<grid, 128, 0, stream>>>(dx, dout, conv, strip_rows, partials);
}

// One token per sequence (row n of x, slot slots[n]): thread (n, c) reads and shifts only column c of its
// slot's W - 1 history rows, so no two threads touch one element. The taps are summed oldest first, as
// Conv::pre sums them over a whole sequence.
__global__ void conv1d_silu_step_kernel(Matrix out, Matrix x, Matrix w, Matrix state, const std::int32_t* slots) {
  const Index C = x.cols, W = w.cols, index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index >= x.rows * C) return;
  const Index n = index / C, c = index % C, first = slots[n] * (W - 1);
  const bf16* wc = row_of<const bf16>(w, c);
  const bf16 newest = row_of<const bf16>(x, n)[c];
  float sum = 0.f;
  for (Index j = 0; j < W - 1; ++j) sum += to_float(wc[j]) * to_float(row_of<const bf16>(state, first + j)[c]);
  sum += to_float(wc[W - 1]) * to_float(newest);
  row_of<bf16>(out, n)[c] = to_bf16(silu(sum));
  for (Index j = 0; j + 1 < W - 1; ++j) row_of<bf16>(state, first + j)[c] = row_of<const bf16>(state, first + j + 1)[c];
  row_of<bf16>(state, first + W - 2)[c] = newest;
}

// Where each row sits: inside its packed sequence (training, prefill), or given (decode).
struct InSequence {
  Sequences seq;
  __device__ Index operator()(Index t) const { return t - seq.cu[sequence_of(seq, t)]; }
};
struct Given {
  const std::int32_t* positions;
  __device__ Index operator()(Index t) const { return positions[t]; }
};

template <class Position>
__global__ void rope_kernel(Matrix x, int heads, int head_dim, int rotary_dim, float theta, Position position,
                            bool inverse) {
  const int half = rotary_dim / 2;
  const Index index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index >= x.rows * half) return;
  const Index t = index / half;
  const int i = static_cast<int>(index % half);
  // HF's float32 angles: inv_freq = 1 / theta^(2i / rotary_dim), angle = position * inv_freq.
  const float inv_freq = 1.f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(rotary_dim));
  const float angle = static_cast<float>(position(t)) * inv_freq;
  const float c = cosf(angle), s = inverse ? -sinf(angle) : sinf(angle);
  bf16* row = row_of<bf16>(x, t);
  for (int h = 0; h < heads; ++h) {
    bf16* p = row + static_cast<Index>(h) * head_dim;
    const float x1 = to_float(p[i]), x2 = to_float(p[i + half]);
    p[i] = to_bf16(x1 * c - x2 * s);  // x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)
    p[i + half] = to_bf16(x2 * c + x1 * s);
  }
}

template <class Position>
void launch_rope(Matrix x, int heads, int head_dim, int rotary_dim, float theta, Position position, bool inverse,
                 cudaStream_t stream) {
  const Index n = x.rows * (rotary_dim / 2);
  if (n == 0) return;
  rope_kernel<<<grid_for(n, 256), 256, 0, stream>>>(x, heads, head_dim, rotary_dim, theta, position, inverse);
  check_launch("rope");
}

}  // namespace

void conv1d_silu_forward(Matrix out, Matrix x, Matrix weight, Sequences sequences, cudaStream_t stream) {
  const Index n = x.rows * x.cols;
  if (n == 0) return;
  conv1d_silu_forward_kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, Conv{x, weight, sequences});
  check_launch("conv1d_silu_forward");
}

void conv1d_silu_backward(Matrix dx, Matrix dweight, Matrix dout, Matrix x, Matrix weight, Sequences sequences,
                          Workspace& workspace, cudaStream_t stream) {
  const Index T = x.rows, C = x.cols, W = weight.cols;
  if (T == 0 || C == 0) return;
  constexpr Index kMaxStrips = 65535;  // gridDim.y
  const Index strip_rows = std::max<Index>(128, (T + kMaxStrips - 1) / kMaxStrips);
  const Index strips = (T + strip_rows - 1) / strip_rows;
  auto* partials = reinterpret_cast<float*>(workspace.reserve(strips * C * W * sizeof(float)));
  const dim3 grid(grid_for(C, 128), static_cast<unsigned>(strips));
  const Conv conv{x, weight, sequences};
  using Launch = void (*)(dim3, cudaStream_t, Matrix, Matrix, Conv, Index, float*);
  constexpr Launch kByWidth[] = {launch_conv1d_silu_backward<1>, launch_conv1d_silu_backward<2>,
                                 launch_conv1d_silu_backward<3>, launch_conv1d_silu_backward<4>,
                                 launch_conv1d_silu_backward<5>, launch_conv1d_silu_backward<6>,
                                 launch_conv1d_silu_backward<7>, launch_conv1d_silu_backward<8>};
  if (W < 1 || W > static_cast<Index>(std::size(kByWidth))) {
    throw Unavailable("conv1d_silu_backward", "the CUDA kernel takes conv widths 1 to 8, got " + std::to_string(W));
  }
  kByWidth[W - 1](grid, stream, dx, dout, conv, strip_rows, partials);
  check_launch("conv1d_silu_backward");
  // dweight is contiguous [C, W] (checked by the caller): the strips' partial sums, added in strip order.
  column_finish_kernel<<<grid_for(C * W, kColumnThreads), kColumnThreads, 0, stream>>>(partials, strips, C * W,
                                                                                        static_cast<float*>(dweight.data));
  check_launch("conv1d_silu_backward (dweight)");
}

void rope(Matrix x, int heads, int head_dim, int rotary_dim, float theta, Sequences sequences, bool inverse,
          cudaStream_t stream) {
  launch_rope(x, heads, head_dim, rotary_dim, theta, InSequence{sequences}, inverse, stream);
}

void rope_at_positions(Matrix x, int heads, int head_dim, int rotary_dim, float theta, const std::int32_t* positions,
                       cudaStream_t stream) {
  launch_rope(x, heads, head_dim, rotary_dim, theta, Given{positions}, false, stream);
}

void conv1d_silu_step(Matrix out, Matrix x, Matrix weight, Matrix state, const std::int32_t* slots,
                      cudaStream_t stream) {
  const Index n = x.rows * x.cols;
  if (n == 0) return;
  conv1d_silu_step_kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, x, weight, state, slots);
  check_launch("conv1d_silu_step");
}

}  // namespace deltatrain::model::cuda
