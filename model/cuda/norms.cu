// RMSNorm (plain and zero-centred) and the GDN block's gated RMSNorm, with their backwards: a warp or half a
// warp per row (rows are at most a few thousand columns), 8 consecutive columns per lane access, float32 sums.
// Weight gradients go through column_sums (common.cuh), so they are bitwise reproducible.
#include <type_traits>

#include "common.cuh"

namespace deltatrain::model::cuda {
namespace {

constexpr int kNormThreads = 256;

// The lanes that share a row: 16 for rows of at most 128 columns (the GDN heads' gated norm: a whole warp per
// row would leave half its lanes idle), else 32. Each lane takes 8 consecutive columns per step. A group past
// the last row works on the last row without storing, so that every lane of a warp reaches the shuffles.
template <int Lanes>
struct RowGroup {
  static constexpr int kStep = Lanes * kVector;  // columns a group covers per step
  Index row;
  bool active;
  Index column;  // this lane's first column
  __device__ explicit RowGroup(Index rows) {
    const Index r = blockIdx.x * static_cast<Index>(kNormThreads / Lanes) + threadIdx.x / Lanes;
    active = r < rows;
    row = active ? r : rows - 1;
    column = static_cast<Index>(threadIdx.x % Lanes) * kVector;
  }
  __device__ static float sum(float v) {
#pragma unroll
    for (int offset = Lanes / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
  }
};

// Row r of the rows a norm walks: the matrix's row r / heads from column (r % heads) * width (heads = 1: the
// matrix's own rows; the gated norm: one row per head of each token's row).
template <class T>
__device__ T* norm_row(const Matrix& m, Index r, Index heads, Index width) {
  return row_of<T>(m, r / heads) + (r % heads) * width;
}

// 1 / sqrt(mean(x^2) + eps) of the group's row, to each of its lanes.
template <int Lanes, bool V>
__device__ float inverse_rms(const RowGroup<Lanes>& g, const bf16* x, Index cols, float eps) {
  float ss = 0.f;
  for (Index c0 = g.column; c0 < cols; c0 += g.kStep) {
    float v[kVector];
    load8<V>(x, c0, cols, v);
#pragma unroll
    for (int k = 0; k < kVector; ++k) ss += v[k] * v[k];
  }
  return 1.f / sqrtf(RowGroup<Lanes>::sum(ss) / static_cast<float>(cols) + eps);
}

template <int Lanes, bool V>
__global__ void rmsnorm_forward_kernel(Matrix out, float* rstd, Matrix x, const bf16* w, float eps, bool zero_centred) {
  const RowGroup<Lanes> g(x.rows);
  const bf16* xr = row_of<const bf16>(x, g.row);
  const float s = inverse_rms<Lanes, V>(g, xr, x.cols, eps);
  if (!g.active) return;
  if (threadIdx.x % Lanes == 0) rstd[g.row] = s;
  for (Index c0 = g.column; c0 < x.cols; c0 += g.kStep) {
    float v[kVector], gain[kVector];
    load8<V>(xr, c0, x.cols, v);
    load8<V>(w, c0, x.cols, gain);
#pragma unroll
    for (int k = 0; k < kVector; ++k) v[k] = v[k] * s * (zero_centred ? 1.f + gain[k] : gain[k]);
    store8<V>(row_of<bf16>(out, g.row), c0, x.cols, v);
  }
}

// dx (=, or += when accumulate) = rstd * (dy g - x rstd^2 mean(dy g x)) for y = (x rstd) g, where g is
// (1 + w) or w, or w silu(z) for the gated norm (z non-null), which also writes dz = dy w (x rstd) silu'(z).
// Each pass evaluates sigmoid(z) once per element for both silu(z) and silu'(z).
template <int Lanes, bool V>
__global__ void rms_input_grad_kernel(Matrix dx, Matrix dz, Matrix dout, Matrix x, Matrix z, Index heads,
                                      const float* rstd, const bf16* w, bool zero_centred, bool accumulate) {
  const Index cols = x.cols / heads;
  const RowGroup<Lanes> group(x.rows * heads);
  const Index r = group.row;
  const bf16 *dy = norm_row<const bf16>(dout, r, heads, cols), *xr = norm_row<const bf16>(x, r, heads, cols);
  const bf16* zr = z.data != nullptr ? norm_row<const bf16>(z, r, heads, cols) : nullptr;
  const float s = rstd[r];
  // The per-element factor g of columns [c0, c0 + 8), with w and silu'(z) for the gated norm's dz.
  auto factor = [&](Index c0, float (&g)[kVector], float (&wv)[kVector], float (&gate_grad)[kVector]) {
    load8<V>(w, c0, cols, wv);
    if (zr != nullptr) {
      float zv[kVector];
      load8<V>(zr, c0, cols, zv);
#pragma unroll
      for (int k = 0; k < kVector; ++k) {
        const float sz = sigmoid(zv[k]);
        g[k] = wv[k] * (zv[k] * sz);  // w silu(z), silu as common.cuh forms it
        gate_grad[k] = sz * (1.f + zv[k] * (1.f - sz));
      }
    } else {
#pragma unroll
      for (int k = 0; k < kVector; ++k) g[k] = zero_centred ? wv[k] + 1.f : wv[k];
    }
  };
  float dot = 0.f;
  for (Index c0 = group.column; c0 < cols; c0 += group.kStep) {
    float d[kVector], v[kVector], g[kVector], wv[kVector], gate_grad[kVector];
    load8<V>(dy, c0, cols, d);
    load8<V>(xr, c0, cols, v);
    factor(c0, g, wv, gate_grad);
#pragma unroll
    for (int k = 0; k < kVector; ++k) dot += d[k] * g[k] * v[k];
  }
  const float coef = RowGroup<Lanes>::sum(dot) * s * s / static_cast<float>(cols);
  if (!group.active) return;
  for (Index c0 = group.column; c0 < cols; c0 += group.kStep) {
    float d[kVector], v[kVector], g[kVector], wv[kVector], gate_grad[kVector], out[kVector];
    load8<V>(dy, c0, cols, d);
    load8<V>(xr, c0, cols, v);
    factor(c0, g, wv, gate_grad);
    bf16* dxr = norm_row<bf16>(dx, r, heads, cols);
    if (accumulate) load8<V>(dxr, c0, cols, out);
#pragma unroll
    for (int k = 0; k < kVector; ++k) {
      const float value = s * (d[k] * g[k] - v[k] * coef);
      out[k] = accumulate ? out[k] + value : value;
    }
    store8<V>(dxr, c0, cols, out);
    if (zr != nullptr) {
#pragma unroll
      for (int k = 0; k < kVector; ++k) out[k] = d[k] * wv[k] * (v[k] * s) * gate_grad[k];
      store8<V>(norm_row<bf16>(dz, r, heads, cols), c0, cols, out);
    }
  }
}

template <int Lanes, bool V>
__global__ void gated_rmsnorm_forward_kernel(Matrix out, float* rstd, Matrix x, Matrix z, Index heads, const bf16* w,
                                             float eps) {
  const Index cols = x.cols / heads;
  const RowGroup<Lanes> g(x.rows * heads);
  const bf16 *xr = norm_row<const bf16>(x, g.row, heads, cols), *zr = norm_row<const bf16>(z, g.row, heads, cols);
  const float s = inverse_rms<Lanes, V>(g, xr, cols, eps);
  if (!g.active) return;
  if (threadIdx.x % Lanes == 0) rstd[g.row] = s;
  bf16* o = norm_row<bf16>(out, g.row, heads, cols);
  for (Index c0 = g.column; c0 < cols; c0 += g.kStep) {
    float v[kVector], zv[kVector], gain[kVector];
    load8<V>(xr, c0, cols, v);
    load8<V>(zr, c0, cols, zv);
    load8<V>(w, c0, cols, gain);
#pragma unroll
    for (int k = 0; k < kVector; ++k) v[k] = gain[k] * (v[k] * s) * silu(zv[k]);  // HF's order
    store8<V>(o, c0, cols, v);
  }
}

// dweight's terms: dy x rstd (the same for w and 1 + w), times silu(z) for the gated norm.
struct NormWeightGrad {
  Matrix dout, x, z;
  Index heads;
  const float* rstd;
  __device__ float operator()(Index r, Index c) const {
    const Index width = x.cols / heads;
    const float v = to_float(norm_row<const bf16>(dout, r, heads, width)[c]) *
                    (to_float(norm_row<const bf16>(x, r, heads, width)[c]) * rstd[r]);
    return z.data != nullptr ? v * silu(to_float(norm_row<const bf16>(z, r, heads, width)[c])) : v;
  }
};

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Launches a row kernel as launch(vectorized, lanes, blocks), the first two std::integral_constant arguments.
template <class Launch>
void launch_rows(const char* name, Index rows, Index cols, bool vectorized, Launch launch) {
  if (rows == 0) return;
  auto with_lanes = [&](auto vec) {
    if (cols <= 16 * kVector) {
      launch(vec, std::integral_constant<int, 16>{}, grid_for(rows, kNormThreads / 16));
    } else {
      launch(vec, std::integral_constant<int, 32>{}, grid_for(rows, kNormThreads / 32));
    }
  };
  if (vectorized) {
    with_lanes(std::true_type{});
  } else {
    with_lanes(std::false_type{});
  }
  check_launch(name);
}

}  // namespace

void rmsnorm_forward(Matrix out, float* rstd, Matrix x, const void* weight, float eps, bool zero_centred,
                     cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const bool v = vectorizable(out) && vectorizable(x) && aligned16(w);
  launch_rows("rmsnorm_forward", x.rows, x.cols, v, [&](auto vec, auto lanes, unsigned blocks) {
    rmsnorm_forward_kernel<lanes, vec><<<blocks, kNormThreads, 0, stream>>>(out, rstd, x, w, eps, zero_centred);
  });
}

void rmsnorm_backward(Matrix dx, float* dweight, Matrix dout, Matrix x, const float* rstd, const void* weight,
                      bool zero_centred, bool accumulate_dx, Workspace& workspace, cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const bool v = vectorizable(dx) && vectorizable(dout) && vectorizable(x) && aligned16(w);
  launch_rows("rmsnorm_backward", x.rows, x.cols, v, [&](auto vec, auto lanes, unsigned blocks) {
    rms_input_grad_kernel<lanes, vec><<<blocks, kNormThreads, 0, stream>>>(dx, Matrix{}, dout, x, Matrix{}, 1, rstd,
                                                                           w, zero_centred, accumulate_dx);
  });
  column_sums("rmsnorm_backward (dweight)", NormWeightGrad{dout, x, Matrix{}, 1, rstd}, x.rows, x.cols, dweight,
              workspace, stream);
}

void gated_rmsnorm_forward(Matrix out, float* rstd, Matrix x, Matrix z, Index heads, const void* weight, float eps,
                           cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const Index width = x.cols / heads;
  const bool v = vectorizable(out) && vectorizable(x) && vectorizable(z) && width % kVector == 0 && aligned16(w);
  launch_rows("gated_rmsnorm_forward", x.rows * heads, width, v, [&](auto vec, auto lanes, unsigned blocks) {
    gated_rmsnorm_forward_kernel<lanes, vec><<<blocks, kNormThreads, 0, stream>>>(out, rstd, x, z, heads, w, eps);
  });
}

void gated_rmsnorm_backward(Matrix dx, Matrix dz, float* dweight, Matrix dout, Matrix x, Matrix z, Index heads,
                            const float* rstd, const void* weight, Workspace& workspace, cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const Index width = x.cols / heads;
  const bool v = vectorizable(dx) && vectorizable(dz) && vectorizable(dout) && vectorizable(x) && vectorizable(z) &&
                 width % kVector == 0 && aligned16(w);
  launch_rows("gated_rmsnorm_backward", x.rows * heads, width, v, [&](auto vec, auto lanes, unsigned blocks) {
    rms_input_grad_kernel<lanes, vec><<<blocks, kNormThreads, 0, stream>>>(dx, dz, dout, x, z, heads, rstd, w, false,
                                                                           false);
  });
  column_sums("gated_rmsnorm_backward (dweight)", NormWeightGrad{dout, x, z, heads, rstd}, x.rows * heads, width,
              dweight, workspace, stream);
}

}  // namespace deltatrain::model::cuda
