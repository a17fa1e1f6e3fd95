// Ops along packed sequences: the causal depthwise convolution with SiLU and partial NeoX RoPE, and their decode
// forms (the conv over a cached history, RoPE at given positions). Each thread finds its row's sequence by binary
// search in cu_seqlens on the device, so launches need no host work.
#include "common.cuh"

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

// dpre[u, c] = dout[u, c] silu'(pre[u, c]) for the rows u of the sequence starting at `start`.
__device__ __forceinline__ float conv_dpre(const Conv& conv, const Matrix& dout, Index u, Index c, Index start) {
  return to_float(row_of<const bf16>(dout, u)[c]) * silu_grad(conv.pre(u, c, start));
}

// dx[t, c] = sum_j w[c, j] dpre[t + (W - 1) - j, c] over the rows inside t's sequence.
__global__ void conv1d_silu_dx_kernel(Matrix dx, Matrix dout, Conv conv) {
  const Index C = conv.x.cols, W = conv.w.cols;
  const Index index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index >= conv.x.rows * C) return;
  const Index t = index / C, c = index % C;
  const int n = sequence_of(conv.seq, t);
  const Index start = conv.seq.cu[n], end = conv.seq.cu[n + 1];
  const bf16* wc = row_of<const bf16>(conv.w, c);
  float sum = 0.f;
  for (Index j = 0; j < W; ++j) {
    const Index later = t + (W - 1) - j;  // the row whose tap j reads row t
    if (later < end) sum += to_float(wc[j]) * conv_dpre(conv, dout, later, c, start);
  }
  row_of<bf16>(dx, t)[c] = to_bf16(sum);
}

// dweight[c, j]'s term of row t: dpre[t, c] x[t - (W - 1) + j, c], column index c * W + j.
struct ConvWeightGrad {
  Conv conv;
  Matrix dout;
  __device__ float operator()(Index t, Index column) const {
    const Index W = conv.w.cols, c = column / W, j = column % W;
    const Index start = conv.seq.cu[sequence_of(conv.seq, t)];
    const Index src = t - (W - 1) + j;
    if (src < start) return 0.f;
    return conv_dpre(conv, dout, t, c, start) * to_float(row_of<const bf16>(conv.x, src)[c]);
  }
};

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
  const Index n = x.rows * x.cols;
  if (n == 0) return;
  const Conv conv{x, weight, sequences};
  conv1d_silu_dx_kernel<<<grid_for(n, 256), 256, 0, stream>>>(dx, dout, conv);
  check_launch("conv1d_silu_backward");
  // dweight is contiguous [C, W] (checked by the caller), so its C * W values are one row of column sums.
  column_sums("conv1d_silu_backward (dweight)", ConvWeightGrad{conv, dout}, x.rows, weight.rows * weight.cols,
              static_cast<float*>(dweight.data), workspace, stream);
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
