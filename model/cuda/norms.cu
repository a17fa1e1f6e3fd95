// RMSNorm (plain and zero-centred) and the GDN block's gated RMSNorm, with their backwards: one warp per
// row (rows are at most a few thousand columns), 8 consecutive columns per lane access, float32 sums.
// Weight gradients go through column_sums (common.cuh), so they are bitwise reproducible.
#include <type_traits>

#include "common.cuh"

namespace deltatrain::model::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // warps per block, one row each
constexpr int kStep = 32 * kVector;  // columns a warp covers per iteration

__device__ __forceinline__ Index warp_row() { return blockIdx.x * static_cast<Index>(kRowsPerBlock) + threadIdx.x / 32; }
__device__ __forceinline__ Index lane_column() { return static_cast<Index>(threadIdx.x % 32) * kVector; }

// 1 / sqrt(mean(x^2) + eps) of a row, to every lane.
template <bool V>
__device__ float inverse_rms(const bf16* x, Index cols, float eps) {
  float ss = 0.f;
  for (Index c0 = lane_column(); c0 < cols; c0 += kStep) {
    float v[kVector];
    load8<V>(x, c0, cols, v);
#pragma unroll
    for (int k = 0; k < kVector; ++k) ss += v[k] * v[k];
  }
  return 1.f / sqrtf(warp_sum(ss) / static_cast<float>(cols) + eps);
}

template <bool V>
__global__ void rmsnorm_forward_kernel(Matrix out, float* rstd, Matrix x, const bf16* w, float eps, bool zero_centred) {
  const Index r = warp_row();
  if (r >= x.rows) return;
  const bf16* xr = row_of<const bf16>(x, r);
  const float s = inverse_rms<V>(xr, x.cols, eps);
  if (threadIdx.x % 32 == 0) rstd[r] = s;
  for (Index c0 = lane_column(); c0 < x.cols; c0 += kStep) {
    float v[kVector], g[kVector];
    load8<V>(xr, c0, x.cols, v);
    load8<V>(w, c0, x.cols, g);
#pragma unroll
    for (int k = 0; k < kVector; ++k) v[k] = v[k] * s * (zero_centred ? 1.f + g[k] : g[k]);
    store8<V>(row_of<bf16>(out, r), c0, x.cols, v);
  }
}

// dx (=, or += when accumulate) = rstd * (dy g - x rstd^2 mean(dy g x)) for y = (x rstd) g, where g is
// (1 + w) or w, or w silu(z) for the gated norm (z non-null), which also writes dz = dy w (x rstd) silu'(z).
template <bool V>
__global__ void rms_input_grad_kernel(Matrix dx, Matrix dz, Matrix dout, Matrix x, Matrix z, const float* rstd,
                                      const bf16* w, bool zero_centred, bool accumulate) {
  const Index r = warp_row();
  if (r >= x.rows) return;
  const Index cols = x.cols;
  const bf16 *dy = row_of<const bf16>(dout, r), *xr = row_of<const bf16>(x, r);
  const bf16* zr = z.data != nullptr ? row_of<const bf16>(z, r) : nullptr;
  const float s = rstd[r];
  // The per-element factor g of columns [c0, c0 + 8).
  auto factor = [&](Index c0, float (&g)[kVector]) {
    load8<V>(w, c0, cols, g);
    if (zr != nullptr) {
      float zv[kVector];
      load8<V>(zr, c0, cols, zv);
#pragma unroll
      for (int k = 0; k < kVector; ++k) g[k] *= silu(zv[k]);
    } else if (zero_centred) {
#pragma unroll
      for (int k = 0; k < kVector; ++k) g[k] += 1.f;
    }
  };
  float dot = 0.f;
  for (Index c0 = lane_column(); c0 < cols; c0 += kStep) {
    float d[kVector], v[kVector], g[kVector];
    load8<V>(dy, c0, cols, d);
    load8<V>(xr, c0, cols, v);
    factor(c0, g);
#pragma unroll
    for (int k = 0; k < kVector; ++k) dot += d[k] * g[k] * v[k];
  }
  const float coef = warp_sum(dot) * s * s / static_cast<float>(cols);
  for (Index c0 = lane_column(); c0 < cols; c0 += kStep) {
    float d[kVector], v[kVector], g[kVector], out[kVector];
    load8<V>(dy, c0, cols, d);
    load8<V>(xr, c0, cols, v);
    factor(c0, g);
    if (accumulate) load8<V>(row_of<const bf16>(dx, r), c0, cols, out);
#pragma unroll
    for (int k = 0; k < kVector; ++k) {
      const float value = s * (d[k] * g[k] - v[k] * coef);
      out[k] = accumulate ? out[k] + value : value;
    }
    store8<V>(row_of<bf16>(dx, r), c0, cols, out);
    if (zr != nullptr) {
      float wv[kVector], zv[kVector];
      load8<V>(w, c0, cols, wv);
      load8<V>(zr, c0, cols, zv);
#pragma unroll
      for (int k = 0; k < kVector; ++k) out[k] = d[k] * wv[k] * (v[k] * s) * silu_grad(zv[k]);
      store8<V>(row_of<bf16>(dz, r), c0, cols, out);
    }
  }
}

template <bool V>
__global__ void gated_rmsnorm_forward_kernel(Matrix out, float* rstd, Matrix x, Matrix z, const bf16* w, float eps) {
  const Index r = warp_row();
  if (r >= x.rows) return;
  const bf16 *xr = row_of<const bf16>(x, r), *zr = row_of<const bf16>(z, r);
  const float s = inverse_rms<V>(xr, x.cols, eps);
  if (threadIdx.x % 32 == 0) rstd[r] = s;
  for (Index c0 = lane_column(); c0 < x.cols; c0 += kStep) {
    float v[kVector], zv[kVector], g[kVector];
    load8<V>(xr, c0, x.cols, v);
    load8<V>(zr, c0, x.cols, zv);
    load8<V>(w, c0, x.cols, g);
#pragma unroll
    for (int k = 0; k < kVector; ++k) v[k] = g[k] * (v[k] * s) * silu(zv[k]);  // HF's order
    store8<V>(row_of<bf16>(out, r), c0, x.cols, v);
  }
}

// dweight's terms: dy x rstd (the same for w and 1 + w), times silu(z) for the gated norm.
struct NormWeightGrad {
  Matrix dout, x, z;
  const float* rstd;
  __device__ float operator()(Index r, Index c) const {
    const float v = to_float(row_of<const bf16>(dout, r)[c]) * (to_float(row_of<const bf16>(x, r)[c]) * rstd[r]);
    return z.data != nullptr ? v * silu(to_float(row_of<const bf16>(z, r)[c])) : v;
  }
};

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

template <class Launch>
void launch_rows(const char* name, Index rows, bool vectorized, Launch launch) {
  if (rows == 0) return;
  const unsigned blocks = grid_for(rows, kRowsPerBlock);
  if (vectorized) {
    launch(std::true_type{}, blocks);
  } else {
    launch(std::false_type{}, blocks);
  }
  check_launch(name);
}

}  // namespace

void rmsnorm_forward(Matrix out, float* rstd, Matrix x, const void* weight, float eps, bool zero_centred,
                     cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const bool v = vectorizable(out) && vectorizable(x) && aligned16(w);
  launch_rows("rmsnorm_forward", x.rows, v, [&](auto vec, unsigned blocks) {
    rmsnorm_forward_kernel<decltype(vec)::value><<<blocks, 32 * kRowsPerBlock, 0, stream>>>(out, rstd, x, w, eps,
                                                                                           zero_centred);
  });
}

void rmsnorm_backward(Matrix dx, float* dweight, Matrix dout, Matrix x, const float* rstd, const void* weight,
                      bool zero_centred, bool accumulate_dx, Workspace& workspace, cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const bool v = vectorizable(dx) && vectorizable(dout) && vectorizable(x) && aligned16(w);
  launch_rows("rmsnorm_backward", x.rows, v, [&](auto vec, unsigned blocks) {
    rms_input_grad_kernel<decltype(vec)::value><<<blocks, 32 * kRowsPerBlock, 0, stream>>>(
        dx, Matrix{}, dout, x, Matrix{}, rstd, w, zero_centred, accumulate_dx);
  });
  column_sums("rmsnorm_backward (dweight)", NormWeightGrad{dout, x, Matrix{}, rstd}, x.rows, x.cols, dweight,
              workspace, stream);
}

void gated_rmsnorm_forward(Matrix out, float* rstd, Matrix x, Matrix z, const void* weight, float eps,
                           cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const bool v = vectorizable(out) && vectorizable(x) && vectorizable(z) && aligned16(w);
  launch_rows("gated_rmsnorm_forward", x.rows, v, [&](auto vec, unsigned blocks) {
    gated_rmsnorm_forward_kernel<decltype(vec)::value><<<blocks, 32 * kRowsPerBlock, 0, stream>>>(out, rstd, x, z,
                                                                                                 w, eps);
  });
}

void gated_rmsnorm_backward(Matrix dx, Matrix dz, float* dweight, Matrix dout, Matrix x, Matrix z,
                            const float* rstd, const void* weight, Workspace& workspace, cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const bool v = vectorizable(dx) && vectorizable(dz) && vectorizable(dout) && vectorizable(x) && vectorizable(z) &&
                 aligned16(w);
  launch_rows("gated_rmsnorm_backward", x.rows, v, [&](auto vec, unsigned blocks) {
    rms_input_grad_kernel<decltype(vec)::value><<<blocks, 32 * kRowsPerBlock, 0, stream>>>(dx, dz, dout, x, z, rstd,
                                                                                          w, false, false);
  });
  column_sums("gated_rmsnorm_backward (dweight)", NormWeightGrad{dout, x, z, rstd}, x.rows, x.cols, dweight,
              workspace, stream);
}

}  // namespace deltatrain::model::cuda
