// What every implementation of Ops shares: the device-independent checks of its arguments (a matrix view, offsets,
// RoPE's extents, and the inference operations' caches and indices), so that the CPU and the GPU refuse the same
// input with the same message.
#include "ops.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "deltatrain/core/error.h"
#include "tensors.h"

namespace deltatrain::model {
namespace {

std::string extent(std::int64_t n) { return n == kAnyExtent ? "?" : std::to_string(n); }

// One value per row.
void check_count(std::size_t size, std::int64_t rows, const char* name) {
  if (static_cast<std::int64_t>(size) != rows)
    throw InvalidArgument(name, "must hold one value per row (" + std::to_string(rows) + "), got " +
                                    std::to_string(size));
}

// Row indices, each in [0, rows).
void check_row_indices(std::span<const std::int32_t> indices, std::int64_t rows, const char* name) {
  for (const std::int32_t i : indices)
    if (i < 0 || i >= rows)
      throw InvalidArgument(name, "must lie in [0, " + std::to_string(rows) + "), got " + std::to_string(i));
}

// No index twice (rows a kernel writes to).
void check_distinct(std::span<const std::int32_t> indices, const char* name) {
  std::vector<std::int32_t> sorted(indices.begin(), indices.end());
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    throw InvalidArgument(name, "must not repeat an index (each is written)");
}

CacheLayout cache_layout(const TensorView& v, const char* name, std::int64_t cols) {
  if (v.ndim != 3 || v.shape[2] != cols || !v.is_contiguous())
    throw InvalidArgument(name, "must be a contiguous [slots, rows, " + std::to_string(cols) + "] cache, got " +
                                    v.shape_string());
  if (v.data == nullptr && v.numel() > 0) throw InvalidArgument(name, "has no data");
  return {v.shape[0], v.shape[1], cols};
}

}  // namespace

void check_positive(std::int64_t value, const char* name) {
  if (value <= 0) throw InvalidArgument(name, "must be positive, got " + std::to_string(value));
}

MatrixLayout matrix_layout(const TensorView& v, const char* name, std::int64_t rows, std::int64_t cols) {
  if (v.ndim != 2 || (rows != kAnyExtent && v.shape[0] != rows) || (cols != kAnyExtent && v.shape[1] != cols))
    throw InvalidArgument(name, "must have shape [" + extent(rows) + ", " + extent(cols) + "], got " + v.shape_string());
  const std::int64_t r = v.shape[0], c = v.shape[1];
  // Strides matter only where there is more than one row or column to step over.
  if ((c > 1 && v.strides[1] != 1) || (r > 1 && v.strides[0] < c))
    throw InvalidArgument(name, "must have unit column stride and a row stride >= its columns, got strides [" +
                                    std::to_string(v.strides[0]) + ", " + std::to_string(v.strides[1]) + "]");
  if (v.data == nullptr && r * c > 0) throw InvalidArgument(name, "has no data");
  return {r, c, r > 1 ? v.strides[0] : std::max<std::int64_t>(c, 1)};
}

ColumnParts::ColumnParts(std::initializer_list<TensorView> parts) : count(static_cast<int>(parts.size())) {
  if (parts.size() == 0 || parts.size() > kMaxParts)
    throw InvalidArgument("parts", "must be 1 to " + std::to_string(kMaxParts) + " matrices, got " +
                                       std::to_string(parts.size()));
  std::copy(parts.begin(), parts.end(), part.begin());
}

void check_column_parts(const ColumnParts& parts, const char* name, std::int64_t rows, std::int64_t cols) {
  std::int64_t total = 0;
  for (int p = 0; p < parts.count; ++p) total += matrix_layout(parts.part[p], name, rows).cols;
  if (total != cols)
    throw InvalidArgument(name, "must have " + std::to_string(cols) + " columns in its parts, got " +
                                    std::to_string(total));
}

void check_cu_seqlens(std::span<const std::int32_t> cu, std::int64_t rows) {
  if (cu.empty() || cu.front() != 0 || cu.back() != rows)
    throw InvalidArgument("cu_seqlens", "must start at 0 and end at the token count " + std::to_string(rows));
  for (std::size_t n = 1; n < cu.size(); ++n)
    if (cu[n] < cu[n - 1]) throw InvalidArgument("cu_seqlens", "must be non-decreasing");
}

void check_rope(int heads, int head_dim, int rotary_dim, double theta) {
  check_positive(heads, "heads");
  check_positive(head_dim, "head_dim");
  if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
    throw InvalidArgument("rotary_dim", "must be even and in [2, head_dim], got " + std::to_string(rotary_dim));
  if (!(theta > 0)) throw InvalidArgument("theta", "must be positive");
}

GatedNormLayout check_gated_rmsnorm(const TensorView& x, const TensorView& weight) {
  const MatrixLayout m = matrix_layout(x, "x");
  check_positive(m.cols, "x's columns");
  if (weight.ndim != 1 || weight.shape[0] < 1)
    throw InvalidArgument("weight", "must be a non-empty vector [head width], got " + weight.shape_string());
  const std::int64_t width = weight.shape[0];
  if (m.cols % width != 0)
    throw InvalidArgument("x", "must have a whole number of heads of the weight's " + std::to_string(width) +
                                   " columns per row, got " + std::to_string(m.cols) + " columns");
  return {m.rows, m.cols / width, width};
}

void check_copy_rows(const TensorView& dst, const IndexArray& dst_rows, const TensorView& src,
                     const IndexArray& src_rows) {
  const MatrixLayout d = matrix_layout(dst, "dst");
  const MatrixLayout s = matrix_layout(src, "src", kAnyExtent, d.cols);
  if (dst_rows.size() != src_rows.size())
    throw InvalidArgument("src_rows", "must hold as many rows as dst_rows (" + std::to_string(dst_rows.size()) +
                                          "), got " + std::to_string(src_rows.size()));
  check_row_indices(dst_rows.host, d.rows, "dst_rows");
  check_distinct(dst_rows.host, "dst_rows");
  check_row_indices(src_rows.host, s.rows, "src_rows");
}

CacheLayout check_conv1d_silu_step(const ColumnParts& out, const TensorView& x, const TensorView& weight,
                                   const TensorView& state, const IndexArray& slots) {
  const MatrixLayout xm = matrix_layout(x, "x");
  check_column_parts(out, "out", xm.rows, xm.cols);
  const MatrixLayout w = matrix_layout(weight, "weight", xm.cols);
  if (w.cols < 2)
    throw InvalidArgument("weight", "must be at least 2 taps wide to have a history, got " + std::to_string(w.cols));
  const CacheLayout st = cache_layout(state, "state", xm.cols);
  if (st.slot_rows != w.cols - 1)
    throw InvalidArgument("state", "must hold W - 1 = " + std::to_string(w.cols - 1) + " rows per slot, got " +
                                       std::to_string(st.slot_rows));
  check_count(slots.size(), xm.rows, "slots");
  check_row_indices(slots.host, st.slots, "slots");
  check_distinct(slots.host, "slots");
  return st;
}

void check_rope_at_positions(const TensorView& x, int heads, int head_dim, int rotary_dim, double theta,
                             const IndexArray& positions) {
  check_rope(heads, head_dim, rotary_dim, theta);
  const MatrixLayout xm = matrix_layout(x, "x", kAnyExtent, std::int64_t{heads} * head_dim);
  check_count(positions.size(), xm.rows, "positions");
  for (const std::int32_t p : positions.host)
    if (p < 0) throw InvalidArgument("positions", "must be >= 0, got " + std::to_string(p));
}

CacheLayout check_attention_inputs_step(const AttentionInputs& x, const IndexArray& positions,
                                        const TensorView& k_cache, const TensorView& v_cache,
                                        const IndexArray& cache_rows, const IndexArray& batch_rows) {
  check_attention_heads(x.q_heads, x.kv_heads, x.head_dim);
  const std::int64_t D = x.head_dim, q_cols = x.q_heads * D, kv_cols = x.kv_heads * D;
  const std::int64_t T = matrix_layout(x.qg, "qg", kAnyExtent, 2 * q_cols).rows;
  matrix_layout(x.k_raw, "k_raw", T, kv_cols);
  matrix_layout(x.v, "v", T, kv_cols);
  // q and k are normed as rows of one head each, and gate is read so by sigmoid_gate_forward: contiguous rows.
  for (const auto& [m, cols, name] : {std::tuple{&x.q, q_cols, "q"}, std::tuple{&x.k, kv_cols, "k"},
                                      std::tuple{&x.gate, q_cols, "gate"}}) {
    if (matrix_layout(*m, name, T, cols).row_stride != cols && T > 1)
      throw InvalidArgument(name, "must have contiguous rows (row stride " + std::to_string(cols) + "), got " +
                                      std::to_string(m->strides[0]));
  }
  check_rope_at_positions(x.q, x.q_heads, x.head_dim, x.rotary_dim, x.theta, positions);
  for (const auto& [v, n, name] : {std::tuple{&x.q_rstd, T * x.q_heads, "q_rstd"},
                                   std::tuple{&x.k_rstd, T * x.kv_heads, "k_rstd"},
                                   std::tuple{&x.q_norm, D, "q_norm"}, std::tuple{&x.k_norm, D, "k_norm"}}) {
    if (v->ndim != 1 || v->shape[0] != n || !v->is_contiguous())
      throw InvalidArgument(name, "must be a contiguous vector of " + std::to_string(n) + ", got " + v->shape_string());
  }
  const CacheLayout cache = cache_layout(k_cache, "k_cache", kv_cols);
  const CacheLayout v_layout = cache_layout(v_cache, "v_cache", kv_cols);
  if (v_layout.slots != cache.slots || v_layout.slot_rows != cache.slot_rows)
    throw InvalidArgument("v_cache", "must have k_cache's shape " + k_cache.shape_string() + ", got " +
                                         v_cache.shape_string());
  check_count(cache_rows.size(), T, "cache_rows");
  check_row_indices(cache_rows.host, cache.rows(), "cache_rows");
  check_distinct(cache_rows.host, "cache_rows");
  check_count(batch_rows.size(), T, "batch_rows");
  check_row_indices(batch_rows.host, T, "batch_rows");
  check_distinct(batch_rows.host, "batch_rows");
  return cache;
}

void Ops::attention_inputs_step(const AttentionInputs& x, const IndexArray& positions, const TensorView& k_cache,
                                const TensorView& v_cache, const IndexArray& cache_rows, const IndexArray& batch_rows) {
  const CacheLayout cache = check_attention_inputs_step(x, positions, k_cache, v_cache, cache_rows, batch_rows);
  const std::int64_t T = x.qg.shape[0], D = x.head_dim;
  // qg and k_raw may be column blocks of a wider matrix, whose heads are not rows of one view: each head's query
  // and gate are copied into q and gate, k_raw into k, and the norms run there in place.
  for (std::int64_t h = 0; h < x.q_heads; ++h) {
    copy(col_slice(x.q, h * D, (h + 1) * D), col_slice(x.qg, 2 * h * D, (2 * h + 1) * D));
    copy(col_slice(x.gate, h * D, (h + 1) * D), col_slice(x.qg, (2 * h + 1) * D, (2 * h + 2) * D));
  }
  copy(x.k, x.k_raw);
  const TensorView q_rows = as_matrix(x.q, T * x.q_heads, D), k_rows = as_matrix(x.k, T * x.kv_heads, D);
  rmsnorm_forward(q_rows, x.q_rstd, q_rows, x.q_norm, x.eps, true);
  rmsnorm_forward(k_rows, x.k_rstd, k_rows, x.k_norm, x.eps, true);
  rope_at_positions(x.q, x.q_heads, x.head_dim, x.rotary_dim, x.theta, positions);
  rope_at_positions(x.k, x.kv_heads, x.head_dim, x.rotary_dim, x.theta, positions);
  copy_rows(as_matrix(k_cache, cache.rows(), cache.cols), cache_rows, x.k, batch_rows);
  copy_rows(as_matrix(v_cache, cache.rows(), cache.cols), cache_rows, x.v, batch_rows);
}

void Ops::gdn_inputs_step(const ColumnParts& out, const TensorView& x, const TensorView& weight,
                          const TensorView& state, const IndexArray& slots, const GdnGates& gates) {
  conv1d_silu_step(out, x, weight, state, slots);
  gdn_gates_forward(gates.g, gates.beta, gates.a, gates.b, gates.a_log, gates.dt_bias);
}

void check_attention_heads(int q_heads, int kv_heads, int head_dim) {
  check_positive(q_heads, "q_heads");
  check_positive(kv_heads, "kv_heads");
  check_positive(head_dim, "head_dim");
  if (q_heads % kv_heads != 0)
    throw InvalidArgument("q_heads", "must be a multiple of kv_heads (" + std::to_string(kv_heads) + "), got " +
                                         std::to_string(q_heads));
}

CacheLayout check_cached_attention(const TensorView& o, const TensorView& q, const TensorView& k_cache,
                                   const TensorView& v_cache, int q_heads, int kv_heads, int head_dim,
                                   const IndexArray& cu_seqlens, const IndexArray& slots,
                                   const IndexArray& lengths) {
  check_attention_heads(q_heads, kv_heads, head_dim);
  const MatrixLayout qm = matrix_layout(q, "q", kAnyExtent, std::int64_t{q_heads} * head_dim);
  matrix_layout(o, "o", qm.rows, qm.cols);
  const std::int64_t kv_cols = std::int64_t{kv_heads} * head_dim;
  const CacheLayout kc = cache_layout(k_cache, "k_cache", kv_cols);
  const CacheLayout vc = cache_layout(v_cache, "v_cache", kv_cols);
  if (vc.slots != kc.slots || vc.slot_rows != kc.slot_rows)
    throw InvalidArgument("v_cache", "must have k_cache's shape " + k_cache.shape_string() + ", got " +
                                         v_cache.shape_string());
  const std::span<const std::int32_t> cu = cu_seqlens.host;
  check_cu_seqlens(cu, qm.rows);
  const std::int64_t N = std::ssize(cu) - 1;
  check_count(slots.size(), N, "slots");
  check_count(lengths.size(), N, "lengths");
  check_row_indices(slots.host, kc.slots, "slots");
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t rows = cu[n + 1] - cu[n], length = lengths.host[n];
    if (length < rows || length > kc.slot_rows)
      throw InvalidArgument("lengths", "entry " + std::to_string(n) + " is " + std::to_string(length) +
                                           ": must cover the sequence's new rows (" + std::to_string(rows) +
                                           ") and fit a slot (" + std::to_string(kc.slot_rows) + ")");
  }
  return kc;
}

}  // namespace deltatrain::model
