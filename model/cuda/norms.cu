// RMSNorm (plain and zero-centred) and the GDN block's gated RMSNorm, with their backwards: a warp or half a
// warp per row (rows are at most a few thousand columns), 8 consecutive columns per lane access, float32 sums.
// The backward sums weight gradients per block of rows, added in block order (common.cuh's column_finish_kernel),
// so they are bitwise reproducible.
#include <string>
#include <type_traits>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"

#include "common.cuh"
#include "norm_plan.h"

namespace deltatrain::model::cuda {
namespace {

constexpr int kNormThreads = 256;
static_assert(kNormVector == kVector, "norm_plan.h's step is a 16-byte access");

// The lanes that share a row (norm_plan.h chooses 16 or 32), each taking 8 consecutive columns per step. A group
// past the last row works on the last row without storing, so that every lane of a warp reaches the shuffles.
// The forward kernels' block takes one row per group: row_in_block() of them.
template <int Lanes>
struct RowGroup {
  static constexpr int kStep = Lanes * kVector;  // columns a group covers per step
  Index row;
  bool active;
  Index column;  // this lane's first column
  __device__ RowGroup(Index rows, Index r) {
    active = r < rows;
    row = active ? r : rows - 1;
    column = static_cast<Index>(threadIdx.x % Lanes) * kVector;
  }
  __device__ static Index row_in_block() {
    return blockIdx.x * static_cast<Index>(kNormThreads / Lanes) + threadIdx.x / Lanes;
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
    ss = add_squares(ss, v);
  }
  return rms_scale(RowGroup<Lanes>::sum(ss), cols, eps);
}

// Rows of up to kNormMaxHeldSteps steps (norm_plan.h) are read once, every load issued before the first is used,
// and kept in registers as Steps steps: the forward is then one round trip to memory. The column loops (wider rows)
// wait on their loads step after step and pass after pass: 4.5 us for 64 rows of 1024 on the H200, where an
// element-wise kernel of that size takes ~2. Both forms sum and round in the same order: the same bits.
template <int Steps, int Lanes, bool V>
__device__ void load_held(const RowGroup<Lanes>& g, const bf16* row, Index cols, float (&v)[Steps][kVector]) {
#pragma unroll
  for (int s = 0; s < Steps; ++s) {
    const Index c0 = g.column + s * g.kStep;
    if (c0 < cols) {
      load8<V>(row, c0, cols, v[s]);
    } else {
#pragma unroll
      for (int k = 0; k < kVector; ++k) v[s][k] = 0.f;
    }
  }
}

template <int Steps, int Lanes, bool V>
__device__ void store_held(const RowGroup<Lanes>& g, bf16* row, Index cols, const float (&v)[Steps][kVector]) {
#pragma unroll
  for (int s = 0; s < Steps; ++s) {
    const Index c0 = g.column + s * g.kStep;
    if (c0 < cols) store8<V>(row, c0, cols, v[s]);
  }
}

// inverse_rms of a held row (zeros past cols add nothing).
template <int Steps, int Lanes>
__device__ float inverse_rms_held(const float (&v)[Steps][kVector], Index cols, float eps) {
  float ss = 0.f;
#pragma unroll
  for (int s = 0; s < Steps; ++s) ss = add_squares(ss, v[s]);
  return rms_scale(RowGroup<Lanes>::sum(ss), cols, eps);
}

// Steps: the held steps of the launch's NormRowPlan (0: the column loops).
template <int Lanes, int Steps, bool V, bool Residual>
__global__ void rmsnorm_forward_kernel(Matrix out, float* rstd, Matrix x, Matrix residual, const bf16* w, float eps,
                                       bool zero_centred) {
  start_after_previous_grid();
  const RowGroup<Lanes> g(x.rows, RowGroup<Lanes>::row_in_block());
  if constexpr (Steps > 0) {
    float v[Steps][kVector], gain[Steps][kVector];
    load_held<Steps, Lanes, V>(g, row_of<const bf16>(x, g.row), x.cols, v);
    load_held<Steps, Lanes, V>(g, w, x.cols, gain);
    if constexpr (Residual) {
      float r[Steps][kVector];
      load_held<Steps, Lanes, V>(g, row_of<const bf16>(residual, g.row), x.cols, r);
#pragma unroll
      for (int s = 0; s < Steps; ++s)
#pragma unroll
        for (int k = 0; k < kVector; ++k) v[s][k] = to_float(to_bf16(v[s][k] + r[s][k]));  // as stored
      if (g.active) store_held<Steps, Lanes, V>(g, row_of<bf16>(x, g.row), x.cols, v);
    }
    const float s = inverse_rms_held<Steps, Lanes>(v, x.cols, eps);
    if (!g.active) return;
    if (threadIdx.x % Lanes == 0) rstd[g.row] = s;
#pragma unroll
    for (int i = 0; i < Steps; ++i)
#pragma unroll
      for (int k = 0; k < kVector; ++k) v[i][k] = normed(v[i][k], s, gain[i][k], zero_centred);
    store_held<Steps, Lanes, V>(g, row_of<bf16>(out, g.row), x.cols, v);
    return;
  }
  if constexpr (Residual) {
    // x += residual, stored in bfloat16 as the add alone stores it; each lane reads back below only the columns it
    // wrote. (A group past the last row must not add twice: it only reads, and stores nothing.)
    if (g.active) {
      bf16* xw = row_of<bf16>(x, g.row);
      for (Index c0 = g.column; c0 < x.cols; c0 += g.kStep) {
        float v[kVector], r[kVector];
        load8<V>(xw, c0, x.cols, v);
        load8<V>(row_of<const bf16>(residual, g.row), c0, x.cols, r);
#pragma unroll
        for (int k = 0; k < kVector; ++k) v[k] += r[k];
        store8<V>(xw, c0, x.cols, v);
      }
    }
  }
  const bf16* xr = row_of<const bf16>(x, g.row);
  const float s = inverse_rms<Lanes, V>(g, xr, x.cols, eps);
  if (!g.active) return;
  if (threadIdx.x % Lanes == 0) rstd[g.row] = s;
  for (Index c0 = g.column; c0 < x.cols; c0 += g.kStep) {
    float v[kVector], gain[kVector];
    load8<V>(xr, c0, x.cols, v);
    load8<V>(w, c0, x.cols, gain);
#pragma unroll
    for (int k = 0; k < kVector; ++k) v[k] = normed(v[k], s, gain[k], zero_centred);
    store8<V>(row_of<bf16>(out, g.row), c0, x.cols, v);
  }
}

// The backward's blocks: each takes kRowsPerGroup rows per row group (interleaved, so a block's loads stay
// adjacent), and sums its rows' weight-gradient terms into one partial row that column_finish_kernel adds in
// block order (deterministic, and the terms need no second pass over dy and x).
constexpr int kRowsPerGroup = 8;

// sums[c0 + k] += dy x rstd gate for the lane's 8 columns: two 16-byte shared-memory accesses when vectorized (a
// lane's 8 floats per access, element by element, would put 8 lanes on each bank).
template <bool V>
__device__ void add_weight_terms(float* sums, Index c0, Index cols, const float (&d)[kVector],
                                 const float (&v)[kVector], float s, const float (&gate)[kVector]) {
  if constexpr (V) {
    auto* quads = reinterpret_cast<float4*>(sums + c0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float4 q = quads[half];
      const int k = 4 * half;
      q.x += d[k] * (v[k] * s) * gate[k];
      q.y += d[k + 1] * (v[k + 1] * s) * gate[k + 1];
      q.z += d[k + 2] * (v[k + 2] * s) * gate[k + 2];
      q.w += d[k + 3] * (v[k + 3] * s) * gate[k + 3];
      quads[half] = q;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVector; ++k)
      if (c0 + k < cols) sums[c0 + k] += d[k] * (v[k] * s) * gate[k];
  }
}

template <int Lanes>
__host__ __device__ constexpr Index backward_block_rows() {
  return Index{kNormThreads / Lanes} * kRowsPerGroup;
}

// dx (=, or += when accumulate) = rstd * (dy g - x rstd^2 mean(dy g x)) for y = (x rstd) g, where g is
// (1 + w) or w, or w silu(z) for the gated norm (z non-null), which also writes dz = dy w (x rstd) silu'(z).
// dweight's terms dy (x rstd), times silu(z) for the gated norm, go to partials[block][c] (the group's sums in
// shared memory, [groups][cols], each lane on its own columns). Sigmoid(z) is evaluated once per element a pass.
// Steps: the held steps of the rows' NormRowPlan (0: the column loops). A held row's dy and x are loaded once, every
// load issued before the first is used, and kept in registers for both passes; the column loops read them twice and
// wait on each step's loads in turn. Three blocks an SM (80 registers; 96 unbounded left two, too few loads in
// flight for a memory-bound kernel), two where 2 or 4 held steps (32 or 64 floats of dy and x) need more registers.
template <int Lanes, int Steps, bool V>
__global__ void __launch_bounds__(kNormThreads, Steps >= 2 ? 2 : 3)
    rms_input_grad_kernel(Matrix dx, Matrix dz, Matrix dout, Matrix x, Matrix z, Index heads, const float* rstd,
                          const bf16* w, bool zero_centred, bool accumulate, float* partials) {
  extern __shared__ float group_sums[];
  constexpr int kGroups = kNormThreads / Lanes;
  const Index cols = x.cols / heads, rows = x.rows * heads;
  float* sums = group_sums + (threadIdx.x / Lanes) * cols;
  const Index first_column = static_cast<Index>(threadIdx.x % Lanes) * kVector;
  for (Index c0 = first_column; c0 < cols; c0 += RowGroup<Lanes>::kStep)
#pragma unroll
    for (int k = 0; k < kVector; ++k)
      if (c0 + k < cols) sums[c0 + k] = 0.f;

  for (int i = 0; i < kRowsPerGroup; ++i) {
    const RowGroup<Lanes> group(rows, blockIdx.x * backward_block_rows<Lanes>() + i * kGroups + threadIdx.x / Lanes);
    const Index r = group.row;
    const bf16 *dy = norm_row<const bf16>(dout, r, heads, cols), *xr = norm_row<const bf16>(x, r, heads, cols);
    const bf16* zr = z.data != nullptr ? norm_row<const bf16>(z, r, heads, cols) : nullptr;
    const float s = rstd[r];
    // Columns [c0, c0 + 8): the per-element factor g, w, silu(z) and silu'(z) (the gate terms 1 without z).
    auto factor = [&](Index c0, float (&g)[kVector], float (&wv)[kVector], float (&gate)[kVector],
                      float (&gate_grad)[kVector]) {
      load8<V>(w, c0, cols, wv);
      if (zr != nullptr) {
        float zv[kVector];
        load8<V>(zr, c0, cols, zv);
#pragma unroll
        for (int k = 0; k < kVector; ++k) {
          const float sz = sigmoid(zv[k]);
          gate[k] = zv[k] * sz;  // silu(z) as common.cuh forms it
          g[k] = wv[k] * gate[k];
          gate_grad[k] = sz * (1.f + zv[k] * (1.f - sz));
        }
      } else {
#pragma unroll
        for (int k = 0; k < kVector; ++k) {
          g[k] = zero_centred ? wv[k] + 1.f : wv[k];
          gate[k] = gate_grad[k] = 1.f;
        }
      }
    };
    // dx's and dz's columns [c0, c0 + 8) from that step's dy (d) and x (v), and their weight-gradient terms.
    const auto write_step = [&](Index c0, const float (&d)[kVector], const float (&v)[kVector], float coef) {
      float g[kVector], wv[kVector], gate[kVector], gate_grad[kVector], out[kVector];
      factor(c0, g, wv, gate, gate_grad);
      bf16* dxr = norm_row<bf16>(dx, r, heads, cols);
      if (accumulate) load8<V>(dxr, c0, cols, out);
#pragma unroll
      for (int k = 0; k < kVector; ++k) {
        const float value = s * (d[k] * g[k] - v[k] * coef);
        out[k] = accumulate ? out[k] + value : value;
      }
      add_weight_terms<V>(sums, c0, cols, d, v, s, gate);
      store8<V>(dxr, c0, cols, out);
      if (zr != nullptr) {
#pragma unroll
        for (int k = 0; k < kVector; ++k) out[k] = d[k] * wv[k] * (v[k] * s) * gate_grad[k];
        store8<V>(norm_row<bf16>(dz, r, heads, cols), c0, cols, out);
      }
    };
    const auto add_dot = [&](float dot, Index c0, const float (&d)[kVector], const float (&v)[kVector]) {
      float g[kVector], wv[kVector], gate[kVector], gate_grad[kVector];
      factor(c0, g, wv, gate, gate_grad);
#pragma unroll
      for (int k = 0; k < kVector; ++k) dot += d[k] * g[k] * v[k];
      return dot;
    };
    // x's coefficient in dx: the row's sum of dy g x over its lanes, times rstd^2 / cols.
    const auto coefficient = [&](float dot) { return RowGroup<Lanes>::sum(dot) * s * s / static_cast<float>(cols); };
    float dot = 0.f;
    if constexpr (Steps > 0) {
      float d[Steps][kVector], v[Steps][kVector];
      load_held<Steps, Lanes, V>(group, dy, cols, d);
      load_held<Steps, Lanes, V>(group, xr, cols, v);
#pragma unroll
      for (int step = 0; step < Steps; ++step) {
        const Index c0 = group.column + step * group.kStep;
        if (c0 < cols) dot = add_dot(dot, c0, d[step], v[step]);
      }
      const float coef = coefficient(dot);
      if (!group.active) continue;  // the group's lanes all skip: no shuffles follow
#pragma unroll
      for (int step = 0; step < Steps; ++step) {
        const Index c0 = group.column + step * group.kStep;
        if (c0 < cols) write_step(c0, d[step], v[step], coef);
      }
    } else {
      for (Index c0 = group.column; c0 < cols; c0 += group.kStep) {
        float d[kVector], v[kVector];
        load8<V>(dy, c0, cols, d);
        load8<V>(xr, c0, cols, v);
        dot = add_dot(dot, c0, d, v);
      }
      const float coef = coefficient(dot);
      if (!group.active) continue;
      for (Index c0 = group.column; c0 < cols; c0 += group.kStep) {
        float d[kVector], v[kVector];
        load8<V>(dy, c0, cols, d);
        load8<V>(xr, c0, cols, v);
        write_step(c0, d, v, coef);
      }
    }
  }
  __syncthreads();
  for (Index c = threadIdx.x; c < cols; c += kNormThreads) {
    float sum = 0.f;
    for (int group = 0; group < kGroups; ++group) sum += group_sums[group * cols + c];
    partials[blockIdx.x * cols + c] = sum;
  }
}

template <int Lanes, int Steps, bool V>
__global__ void gated_rmsnorm_forward_kernel(Matrix out, float* rstd, Matrix x, Matrix z, Index heads, const bf16* w,
                                             float eps) {
  start_after_previous_grid();
  const Index cols = x.cols / heads;
  const RowGroup<Lanes> g(x.rows * heads, RowGroup<Lanes>::row_in_block());
  const bf16 *xr = norm_row<const bf16>(x, g.row, heads, cols), *zr = norm_row<const bf16>(z, g.row, heads, cols);
  if constexpr (Steps > 0) {
    float v[Steps][kVector], zv[Steps][kVector], gain[Steps][kVector];
    load_held<Steps, Lanes, V>(g, xr, cols, v);
    load_held<Steps, Lanes, V>(g, zr, cols, zv);
    load_held<Steps, Lanes, V>(g, w, cols, gain);
    const float s = inverse_rms_held<Steps, Lanes>(v, cols, eps);
    if (!g.active) return;
    if (threadIdx.x % Lanes == 0) rstd[g.row] = s;
#pragma unroll
    for (int i = 0; i < Steps; ++i)
#pragma unroll
      for (int k = 0; k < kVector; ++k) v[i][k] = gain[i][k] * (v[i][k] * s) * silu(zv[i][k]);  // HF's order
    store_held<Steps, Lanes, V>(g, norm_row<bf16>(out, g.row, heads, cols), cols, v);
    return;
  }
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

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Launches a row kernel as launch(vectorized, lanes, held_steps), each a std::integral_constant argument, from the
// row's NormRowPlan.
template <class Launch>
void launch_rows(const char* name, Index rows, Index cols, bool vectorized, Launch launch) {
  if (rows == 0) return;
  const NormRowPlan plan = plan_norm_row(cols);
  auto with_shape = [&](auto vec) {
    using std::integral_constant;
    if (plan.lanes == 16) {
      launch(vec, integral_constant<int, 16>{}, integral_constant<int, 1>{});  // 128 columns at most: one step
      return;
    }
    switch (plan.held_steps) {
      case 1:
        launch(vec, integral_constant<int, 32>{}, integral_constant<int, 1>{});
        return;
      case 2:
        launch(vec, integral_constant<int, 32>{}, integral_constant<int, 2>{});
        return;
      case 4:
        launch(vec, integral_constant<int, 32>{}, integral_constant<int, 4>{});
        return;
      default:
        launch(vec, integral_constant<int, 32>{}, integral_constant<int, 0>{});
    }
  };
  if (vectorized) {
    with_shape(std::true_type{});
  } else {
    with_shape(std::false_type{});
  }
  check_launch(name);
}

template <int Lanes>
unsigned forward_blocks(Index rows) {
  return grid_for(rows, kNormThreads / Lanes);
}

// The plain and the gated norm's backward (z null for the plain one): rms_input_grad_kernel over blocks of
// backward_block_rows rows, then their partial dweight rows added in block order into dweight.
void norm_backward(const char* name, Matrix dx, Matrix dz, float* dweight, Matrix dout, Matrix x, Matrix z,
                   Index heads, const float* rstd, const bf16* w, bool zero_centred, bool accumulate_dx,
                   bool vectorized, Workspace& workspace, cudaStream_t stream) {
  const Index rows = x.rows * heads, cols = x.cols / heads;
  if (rows == 0 || cols == 0) return;
  launch_rows(name, rows, cols, vectorized, [&](auto vec, auto lanes, auto steps) {
    constexpr auto kernel = rms_input_grad_kernel<lanes, steps, vec>;
    const unsigned blocks = grid_for(rows, backward_block_rows<lanes>());
    const std::size_t shared = std::size_t{kNormThreads / lanes} * cols * sizeof(float);
    // Up to 48 KiB (rows of up to 1536 columns) needs no opt-in; wider rows check and raise the kernel's limit.
    if (shared > 48 * 1024) {
      require_shared_memory(name, shared, "the weight-gradient sums of rows of " + std::to_string(cols) + " columns");
      cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)),
                 "cudaFuncSetAttribute");
    }
    auto* partials = reinterpret_cast<float*>(workspace.reserve(blocks * cols * sizeof(float)));
    kernel<<<blocks, kNormThreads, shared, stream>>>(dx, dz, dout, x, z, heads, rstd, w, zero_centred, accumulate_dx,
                                                     partials);
    check_launch(name);
    column_finish(name, partials, blocks, cols, dweight, stream);
  });
}

}  // namespace

void rmsnorm_forward(Matrix out, float* rstd, Matrix x, Matrix residual, const void* weight, float eps,
                     bool zero_centred, cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const bool with_residual = residual.data != nullptr;
  const bool v = vectorizable(out) && vectorizable(x) && aligned16(w) && (!with_residual || vectorizable(residual));
  launch_rows("rmsnorm_forward", x.rows, x.cols, v, [&](auto vec, auto lanes, auto steps) {
    const auto kernel = with_residual ? rmsnorm_forward_kernel<lanes, steps, vec, true>
                                      : rmsnorm_forward_kernel<lanes, steps, vec, false>;
    launch_dependent(kernel, forward_blocks<lanes>(x.rows), kNormThreads, 0, stream, out, rstd, x, residual, w, eps,
                     zero_centred);  // launch_rows checks the launch
  });
}

void rmsnorm_backward(Matrix dx, float* dweight, Matrix dout, Matrix x, const float* rstd, const void* weight,
                      bool zero_centred, bool accumulate_dx, Workspace& workspace, cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const bool v = vectorizable(dx) && vectorizable(dout) && vectorizable(x) && aligned16(w);
  norm_backward("rmsnorm_backward", dx, Matrix{}, dweight, dout, x, Matrix{}, 1, rstd, w, zero_centred, accumulate_dx,
                v, workspace, stream);
}

void gated_rmsnorm_forward(Matrix out, float* rstd, Matrix x, Matrix z, Index heads, const void* weight, float eps,
                           cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const Index width = x.cols / heads;
  const bool v = vectorizable(out) && vectorizable(x) && vectorizable(z) && width % kVector == 0 && aligned16(w);
  launch_rows("gated_rmsnorm_forward", x.rows * heads, width, v, [&](auto vec, auto lanes, auto steps) {
    launch_dependent(gated_rmsnorm_forward_kernel<lanes, steps, vec>, forward_blocks<lanes>(x.rows * heads),
                     kNormThreads, 0, stream, out, rstd, x, z, heads, w, eps);
  });
}

void gated_rmsnorm_backward(Matrix dx, Matrix dz, float* dweight, Matrix dout, Matrix x, Matrix z, Index heads,
                            const float* rstd, const void* weight, Workspace& workspace, cudaStream_t stream) {
  const auto* w = static_cast<const bf16*>(weight);
  const Index width = x.cols / heads;
  const bool v = vectorizable(dx) && vectorizable(dz) && vectorizable(dout) && vectorizable(x) && vectorizable(z) &&
                 width % kVector == 0 && aligned16(w);
  norm_backward("gated_rmsnorm_backward", dx, dz, dweight, dout, x, z, heads, rstd, w, false, false, v, workspace,
                stream);
}

}  // namespace deltatrain::model::cuda
