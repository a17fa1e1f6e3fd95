// The CPU implementation of the model's kernels (model/ops.h): OpenBLAS for gemm, plain loops with OpenMP
// for everything else, float32 and float64 (one template on the compute type T).
//
// Determinism: every output value is computed by one thread in an order that does not depend on the thread
// count. Reductions over rows are parallelised over their outputs instead of over the rows: weight gradients
// by column blocks (rmsnorm, conv) or heads (gates), embedding_backward by table rows, attention's GQA sums
// by (sequence, kv head) pairs; each then loops over the rows in order. Sums accumulate in double.
//
// Exceptions: arguments are validated and scratch memory allocated before any parallel region, so nothing
// inside one can throw.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "deltatrain/core/error.h"
#include "deltatrain/model/log_softmax.h"
#include "ops.h"

namespace deltatrain::model {
namespace {

using Index = std::int64_t;

constexpr Index kAny = kAnyExtent;
// Width of the column blocks that weight-gradient loops hand to one thread (and sum in a stack array).
constexpr Index kColumnBlock = 32;

// ---------------------------------------------------------------------------------------------------------
// Validation: views become typed matrices and vectors, or InvalidArgument names the argument.

template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, float> ? DType::f32 : DType::f64;
}

// A validated 2-D view: `rows` rows of `cols` elements, `ld` elements apart.
template <class T>
struct Mat {
  T* data;
  Index rows, cols, ld;
  T* row(Index r) const { return data + r * ld; }
};

void check_host(const TensorView& v, const char* name) {
  if (v.device.type != DeviceType::cpu)
    throw InvalidArgument(name, "must be in host memory, got " + device_name(v.device));
}

template <class T>
void check_dtype(const TensorView& v, const char* name) {
  if (v.dtype != dtype_of<T>())
    throw InvalidArgument(name, std::string("must be ") + dtype_name(dtype_of<T>()) +
                                    " like the call's other tensors, got " + dtype_name(v.dtype));
}

template <class T>
Mat<T> matrix(const TensorView& v, const char* name, Index rows = kAny, Index cols = kAny) {
  check_host(v, name);
  check_dtype<T>(v, name);
  const MatrixLayout m = matrix_layout(v, name, rows, cols);
  return {v.ptr<T>(), m.rows, m.cols, m.row_stride};
}

// ColumnParts on the host: element (r, c) of the whole through a table of each column's part and place in it.
template <class T>
struct Parts {
  std::vector<Mat<T>> part;
  std::vector<std::pair<int, Index>> column;  // column[c]: c's part and its column there
  T& at(Index r, Index c) const { return part[column[c].first].row(r)[column[c].second]; }
};

template <class T>
Parts<T> parts(const ColumnParts& v, const char* name, Index rows, Index cols) {
  check_column_parts(v, name, rows, cols);
  Parts<T> out;
  for (int p = 0; p < v.count; ++p) {
    out.part.push_back(matrix<T>(v.part[p], name, rows));
    for (Index c = 0; c < out.part.back().cols; ++c) out.column.emplace_back(p, c);
  }
  return out;
}

template <class T>
T* vector(const TensorView& v, const char* name, Index n) {
  check_host(v, name);
  check_dtype<T>(v, name);
  if (v.ndim != 1 || v.shape[0] != n)
    throw InvalidArgument(name, "must have shape [" + std::to_string(n) + "], got " + v.shape_string());
  if (n > 1 && v.strides[0] != 1)
    throw InvalidArgument(name, "must be contiguous, got stride " + std::to_string(v.strides[0]));
  if (v.data == nullptr && n > 0) throw InvalidArgument(name, "has no data");
  return v.ptr<T>();
}

// A cache checked by ops.cpp (check_conv1d_silu_step, check_cached_attention) as the matrix of its S * L rows.
template <class T>
Mat<T> cache_rows(const TensorView& v, const char* name, const CacheLayout& layout) {
  check_host(v, name);
  check_dtype<T>(v, name);
  return {v.ptr<T>(), layout.rows(), layout.cols, std::max<Index>(layout.cols, 1)};
}

// Runs body.template operator()<T>() with T the C++ type of `primary`'s dtype; the others are checked against it.
template <class Body>
void dispatch(const TensorView& primary, const char* name, Body&& body) {
  if (primary.dtype == DType::f32) {
    body.template operator()<float>();
  } else if (primary.dtype == DType::f64) {
    body.template operator()<double>();
  } else {
    throw InvalidArgument(name, std::string("must be float32 or float64, got ") + dtype_name(primary.dtype));
  }
}

void check_same_rows(Index rows, std::size_t size, const char* name) {
  if (static_cast<Index>(size) != rows)
    throw InvalidArgument(name,
                          "must hold one value per row (" + std::to_string(rows) + "), got " + std::to_string(size));
}

// Token ids index a table of `rows` rows.
void check_tokens(std::span<const std::int32_t> tokens, Index rows) {
  for (const std::int32_t token : tokens)
    if (token < 0 || token >= rows)
      throw InvalidArgument("tokens", "must lie in [0, " + std::to_string(rows) + "), got " + std::to_string(token));
}

// Validated packed-sequence offsets over `tokens` rows.
class Sequences {
 public:
  Sequences(std::span<const std::int32_t> cu, Index tokens) : cu_(cu) {
    check_cu_seqlens(cu, tokens);
    for (std::size_t n = 1; n < cu.size(); ++n) max_length_ = std::max<Index>(max_length_, cu[n] - cu[n - 1]);
  }
  Index count() const { return static_cast<Index>(cu_.size()) - 1; }
  Index begin(Index n) const { return cu_[n]; }
  Index end(Index n) const { return cu_[n + 1]; }
  Index max_length() const { return max_length_; }
  // The first row of the sequence that holds row t: the last offset <= t.
  Index start_of(Index t) const { return *(std::upper_bound(cu_.begin(), cu_.end(), t) - 1); }

 private:
  std::span<const std::int32_t> cu_;
  Index max_length_ = 0;
};

// ---------------------------------------------------------------------------------------------------------
// Scalar functions, stable for large |x|, with torch's conventions (HF parity).

template <class T>
T sigmoid(T x) {
  if (x >= 0) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);  // exp(-x) would overflow
  return e / (T(1) + e);
}

template <class T>
T silu(T x) {
  return x * sigmoid(x);
}

template <class T>
T silu_grad(T x) {
  const T s = sigmoid(x);
  return s * (T(1) + x * (T(1) - s));
}

// torch.nn.functional.softplus with its threshold 20: the identity above it, and derivative 1 there.
template <class T>
T softplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}

template <class T>
T softplus_grad(T x) {
  return x > T(20) ? T(1) : sigmoid(x);
}

// ---------------------------------------------------------------------------------------------------------
// Parallel loops. Bodies only compute: they never allocate or throw.

template <class Body>
void parallel_for(int threads, Index n, const Body& body) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (Index i = 0; i < n; ++i) body(i);
}

// body(first, last) for the column blocks [first, last) of `cols` columns, one thread per block.
template <class Body>
void for_column_blocks(int threads, Index cols, const Body& body) {
  parallel_for(threads, (cols + kColumnBlock - 1) / kColumnBlock, [&](Index block) {
    const Index first = block * kColumnBlock;
    body(first, std::min(cols, first + kColumnBlock));
  });
}

// ---------------------------------------------------------------------------------------------------------
// gemm

void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, float alpha, const float* a, int lda,
               const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, double alpha, const double* a, int lda,
               const double* b, int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

int blas_int(Index value, const char* name) {
  if (value > INT_MAX) throw InvalidArgument(name, "is too large for BLAS's 32-bit sizes");
  return static_cast<int>(value);
}

// Batch-invariant products: each element of a row summed over k in order, in float64, one row at a time, so a
// row's values do not depend on how many rows the product has, nor which (OpenBLAS picks kernels, blockings and,
// for one row, gemv by the shape). Eight columns at a time for independent chains; several times slower than BLAS.
template <class T>
void gemm_rows_invariant(int threads, bool trans_a, bool trans_b, double alpha, Mat<T> a, Mat<T> b, double beta,
                         Mat<T> c, Index K) {
  constexpr Index kColumns = 8;
  const auto a_at = [&](Index i, Index k) { return static_cast<double>(trans_a ? a.row(k)[i] : a.row(i)[k]); };
  const auto b_at = [&](Index k, Index j) { return static_cast<double>(trans_b ? b.row(j)[k] : b.row(k)[j]); };
  parallel_for(threads, c.rows, [&](Index i) {
    for (Index j0 = 0; j0 < c.cols; j0 += kColumns) {
      const Index width = std::min(kColumns, c.cols - j0);
      double sum[kColumns] = {};
      for (Index k = 0; k < K; ++k) {
        const double x = a_at(i, k);
        for (Index jj = 0; jj < width; ++jj) sum[jj] += x * b_at(k, j0 + jj);
      }
      for (Index jj = 0; jj < width; ++jj) {
        T& out = c.row(i)[j0 + jj];
        out = static_cast<T>(alpha * sum[jj] + (beta == 0 ? 0.0 : beta * static_cast<double>(out)));
      }
    }
  });
}

template <class T>
void gemm(int threads, bool invariant, bool trans_a, bool trans_b, double alpha, const TensorView& a,
          const TensorView& b, double beta, const TensorView& c) {
  const Mat<T> cm = matrix<T>(c, "c");
  const Index M = cm.rows, N = cm.cols;
  const Mat<T> am = trans_a ? matrix<T>(a, "a", kAny, M) : matrix<T>(a, "a", M, kAny);
  const Index K = trans_a ? am.rows : am.cols;
  const Mat<T> bm = trans_b ? matrix<T>(b, "b", N, K) : matrix<T>(b, "b", K, N);
  if (M == 0 || N == 0) return;
  if (invariant) {
    gemm_rows_invariant<T>(threads, trans_a, trans_b, alpha, am, bm, beta, cm, K);
    return;
  }
  blas_gemm(trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, blas_int(M, "c"),
            blas_int(N, "c"), blas_int(K, "a"), static_cast<T>(alpha), am.data, blas_int(am.ld, "a"), bm.data,
            blas_int(bm.ld, "b"), static_cast<T>(beta), cm.data, blas_int(cm.ld, "c"));
}

// ---------------------------------------------------------------------------------------------------------
// Embedding

template <class T>
void embedding_backward(int threads, Mat<T> dtable, std::span<const std::int32_t> tokens, Mat<T> dout) {
  // Rows grouped by token, in order, so that each table row is summed by one thread in row order.
  std::vector<Index> order(tokens.size());
  std::iota(order.begin(), order.end(), Index{0});
  std::stable_sort(order.begin(), order.end(), [&](Index x, Index y) { return tokens[x] < tokens[y]; });
  std::vector<Index> group_starts;
  for (std::size_t i = 0; i < order.size(); ++i)
    if (i == 0 || tokens[order[i]] != tokens[order[i - 1]]) group_starts.push_back(static_cast<Index>(i));
  group_starts.push_back(static_cast<Index>(order.size()));

  const Index groups = static_cast<Index>(group_starts.size()) - 1;
  parallel_for(threads, groups, [&](Index group) {
    T* dst = dtable.row(tokens[order[group_starts[group]]]);
    for (Index first = 0; first < dtable.cols; first += kColumnBlock) {
      const Index width = std::min(kColumnBlock, dtable.cols - first);
      std::array<double, kColumnBlock> sum{};
      for (Index i = group_starts[group]; i < group_starts[group + 1]; ++i) {
        const T* src = dout.row(order[i]) + first;
        for (Index c = 0; c < width; ++c) sum[c] += src[c];
      }
      for (Index c = 0; c < width; ++c) dst[first + c] = static_cast<T>(dst[first + c] + sum[c]);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------
// RMSNorm and the gated RMSNorm

// 1 / sqrt(mean(x^2) + eps), as HF computes it (mean first), with the sum in double.
template <class T>
T inverse_rms(const T* x, Index n, double eps) {
  double sum = 0;
  for (Index c = 0; c < n; ++c) sum += static_cast<double>(x[c]) * x[c];
  return static_cast<T>(1.0 / std::sqrt(sum / static_cast<double>(n) + eps));
}

// The input gradient of y = (x * rstd) .* g for one row, g any per-element factor given by scale(c):
// dx = rstd * (dy .* g - x * rstd^2 * mean(dy .* g .* x)).
template <class T, class Scale>
void rms_input_grad(T* dx, const T* dy, const T* x, T rstd, Index n, bool accumulate, const Scale& scale) {
  double dot = 0;
  for (Index c = 0; c < n; ++c) dot += static_cast<double>(dy[c]) * scale(c) * x[c];
  const double r = rstd, k = dot * r * r / static_cast<double>(n);
  for (Index c = 0; c < n; ++c) {
    const double value = r * (static_cast<double>(dy[c]) * scale(c) - x[c] * k);
    dx[c] = static_cast<T>(accumulate ? dx[c] + value : value);
  }
}

template <class T>
void rmsnorm_forward(int threads, Mat<T> out, T* rstd, Mat<T> x, const T* w, double eps, bool zero_centred) {
  parallel_for(threads, x.rows, [&](Index r) {
    const T* xr = x.row(r);
    T* o = out.row(r);
    const T s = inverse_rms(xr, x.cols, eps);
    rstd[r] = s;
    for (Index c = 0; c < x.cols; ++c) o[c] = xr[c] * s * (zero_centred ? T(1) + w[c] : w[c]);
  });
}

template <class T>
void rmsnorm_backward(int threads, Mat<T> dx, T* dw, Mat<T> dout, Mat<T> x, const T* rstd, const T* w,
                      bool zero_centred, bool accumulate_dx) {
  parallel_for(threads, x.rows, [&](Index r) {
    rms_input_grad(dx.row(r), dout.row(r), x.row(r), rstd[r], x.cols, accumulate_dx,
                   [&](Index c) { return zero_centred ? 1.0 + w[c] : static_cast<double>(w[c]); });
  });
  // dw += sum over rows of dy * x * rstd (the same for w and 1 + w).
  for_column_blocks(threads, x.cols, [&](Index first, Index last) {
    std::array<double, kColumnBlock> sum{};
    for (Index r = 0; r < x.rows; ++r)
      for (Index c = first; c < last; ++c)
        sum[c - first] += static_cast<double>(dout.row(r)[c]) * x.row(r)[c] * rstd[r];
    for (Index c = first; c < last; ++c) dw[c] = static_cast<T>(dw[c] + sum[c - first]);
  });
}

// A matrix [T, heads * width] read as T * heads rows of `width` columns: row r is token r / heads's head r % heads.
template <class T>
struct HeadRows {
  Mat<T> m;
  Index heads, width;
  T* row(Index r) const { return m.row(r / heads) + (r % heads) * width; }
  Index rows() const { return m.rows * heads; }
};

template <class T>
void gated_rmsnorm_forward(int threads, HeadRows<T> out, T* rstd, HeadRows<T> x, HeadRows<T> z, const T* w,
                           double eps) {
  const Index C = x.width;
  parallel_for(threads, x.rows(), [&](Index r) {
    const T* xr = x.row(r);
    const T* zr = z.row(r);
    T* o = out.row(r);
    const T s = inverse_rms(xr, C, eps);
    rstd[r] = s;
    for (Index c = 0; c < C; ++c) o[c] = w[c] * (xr[c] * s) * silu(zr[c]);  // HF's order
  });
}

template <class T>
void gated_rmsnorm_backward(int threads, HeadRows<T> dx, HeadRows<T> dz, T* dw, HeadRows<T> dout, HeadRows<T> x,
                            HeadRows<T> z, const T* rstd, const T* w) {
  const Index C = x.width, R = x.rows();
  parallel_for(threads, R, [&](Index r) {
    const T *dy = dout.row(r), *xr = x.row(r), *zr = z.row(r);
    T* dzr = dz.row(r);
    for (Index c = 0; c < C; ++c)
      dzr[c] = static_cast<T>(static_cast<double>(dy[c]) * w[c] * (xr[c] * rstd[r]) * silu_grad(zr[c]));
    rms_input_grad(dx.row(r), dy, xr, rstd[r], C, false,
                   [&](Index c) { return static_cast<double>(w[c]) * silu(zr[c]); });
  });
  for_column_blocks(threads, C, [&](Index first, Index last) {
    std::array<double, kColumnBlock> sum{};
    for (Index r = 0; r < R; ++r)
      for (Index c = first; c < last; ++c)
        sum[c - first] += static_cast<double>(dout.row(r)[c]) * (x.row(r)[c] * rstd[r]) * silu(z.row(r)[c]);
    for (Index c = first; c < last; ++c) dw[c] = static_cast<T>(dw[c] + sum[c - first]);
  });
}

// ---------------------------------------------------------------------------------------------------------
// Causal depthwise convolution with SiLU

// pre[t, c] = sum_j w[c, j] x[t - (W - 1) + j, c] over the taps at or after the sequence's first row `start`.
template <class T>
double conv_pre(const Mat<T>& x, const Mat<T>& w, Index t, Index c, Index start) {
  const Index W = w.cols;
  double sum = 0;
  for (Index j = std::max<Index>(0, start - (t - (W - 1))); j < W; ++j)
    sum += static_cast<double>(w.row(c)[j]) * x.row(t - (W - 1) + j)[c];
  return sum;
}

template <class T>
void conv1d_silu_forward(int threads, const Parts<T>& out, Mat<T> x, Mat<T> w, const Sequences& seq) {
  parallel_for(threads, x.rows, [&](Index t) {
    const Index start = seq.start_of(t);
    for (Index c = 0; c < x.cols; ++c) out.at(t, c) = silu(static_cast<T>(conv_pre(x, w, t, c, start)));
  });
}

// The decode step: each sequence's window (its W - 1 cached inputs, then x[n]) is row W - 1 of a matrix whose
// earlier rows are the history, so the sum is conv_pre's, term for term. window: N * W * C scratch values.
template <class T>
void conv1d_silu_step(int threads, const Parts<T>& out, Mat<T> x, Mat<T> w, Mat<T> state,
                      std::span<const std::int32_t> slots, T* window) {
  const Index W = w.cols, C = x.cols;
  parallel_for(threads, x.rows, [&](Index n) {
    const Mat<T> win{window + n * W * C, W, C, C};
    T* history = state.row(slots[n] * (W - 1));  // W - 1 contiguous rows
    std::copy_n(history, (W - 1) * C, win.data);
    std::copy_n(x.row(n), C, win.row(W - 1));
    for (Index c = 0; c < C; ++c) out.at(n, c) = silu(static_cast<T>(conv_pre(win, w, W - 1, c, 0)));
    std::copy_n(win.row(1), (W - 1) * C, history);
  });
}

// One thread per block of channels: it owns their dweight, walks every sequence backwards keeping the last W
// rows of dpre (the gradient of pre) in a ring, and writes dx[t] = sum_j w[c, j] dpre[t + (W - 1) - j].
template <class T>
void conv1d_silu_backward(int threads, Mat<T> dx, Mat<T> dw, const Parts<T>& dout, Mat<T> x, Mat<T> w,
                          const Sequences& seq) {
  const Index W = w.cols, C = x.cols;
  const Index blocks = (C + kColumnBlock - 1) / kColumnBlock;
  const Index per_block = 2 * W * kColumnBlock;  // the ring and the dweight sums, [W][kColumnBlock] each
  std::vector<double> scratch(blocks * per_block, 0.0);

  parallel_for(threads, blocks, [&](Index block) {
    const Index first = block * kColumnBlock, width = std::min(kColumnBlock, C - first);
    double* ring = scratch.data() + block * per_block;
    double* dw_sum = ring + W * kColumnBlock;
    for (Index n = 0; n < seq.count(); ++n) {
      const Index start = seq.begin(n), end = seq.end(n);
      for (Index t = end - 1; t >= start; --t) {
        for (Index i = 0; i < width; ++i) {
          const Index c = first + i;
          const T pre = static_cast<T>(conv_pre(x, w, t, c, start));
          const double dpre = static_cast<double>(dout.at(t, c)) * silu_grad(pre);
          ring[(t % W) * kColumnBlock + i] = dpre;
          double sum = 0;
          for (Index j = 0; j < W; ++j) {
            const Index later = t + (W - 1) - j;  // the row whose tap j reads row t
            if (later < end) sum += static_cast<double>(w.row(c)[j]) * ring[(later % W) * kColumnBlock + i];
          }
          dx.row(t)[c] = static_cast<T>(sum);
          for (Index j = std::max<Index>(0, start - (t - (W - 1))); j < W; ++j)
            dw_sum[j * kColumnBlock + i] += dpre * x.row(t - (W - 1) + j)[c];
        }
      }
    }
    for (Index i = 0; i < width; ++i)
      for (Index j = 0; j < W; ++j)
        dw.row(first + i)[j] = static_cast<T>(dw.row(first + i)[j] + dw_sum[j * kColumnBlock + i]);
  });
}

// ---------------------------------------------------------------------------------------------------------
// GDN gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)

template <class T>
void gdn_gates_forward(int threads, Mat<T> g, Mat<T> beta, Mat<T> a, Mat<T> b, const T* a_log, const T* dt_bias) {
  parallel_for(threads, a.rows, [&](Index t) {
    for (Index j = 0; j < a.cols; ++j) {
      g.row(t)[j] = -std::exp(a_log[j]) * softplus(static_cast<T>(a.row(t)[j] + dt_bias[j]));
      beta.row(t)[j] = sigmoid(b.row(t)[j]);
    }
  });
}

// One thread per head: it owns dA_log[j] and ddt_bias[j] and sums them over the tokens in order.
template <class T>
void gdn_gates_backward(int threads, Mat<T> da, Mat<T> db, T* da_log, T* ddt_bias, Mat<T> dg, Mat<T> dbeta, Mat<T> a,
                        Mat<T> b, const T* a_log, const T* dt_bias) {
  parallel_for(threads, a.cols, [&](Index j) {
    const double decay = std::exp(static_cast<double>(a_log[j]));
    double sum_a_log = 0, sum_dt_bias = 0;
    for (Index t = 0; t < a.rows; ++t) {
      const T x = a.row(t)[j] + dt_bias[j];
      const double dgt = dg.row(t)[j];
      const double dx = -dgt * decay * softplus_grad(x);
      da.row(t)[j] = static_cast<T>(dx);
      sum_dt_bias += dx;
      sum_a_log += -dgt * decay * softplus(x);  // dg/dA_log = g
      const T s = sigmoid(b.row(t)[j]);
      db.row(t)[j] = static_cast<T>(static_cast<double>(dbeta.row(t)[j]) * s * (T(1) - s));
    }
    da_log[j] = static_cast<T>(da_log[j] + sum_a_log);
    ddt_bias[j] = static_cast<T>(ddt_bias[j] + sum_dt_bias);
  });
}

// ---------------------------------------------------------------------------------------------------------
// RoPE, in the compute type like HF: inv_freq[i] = 1 / theta^(2i / rotary_dim), angle = position * inv_freq.

// position(t): the position of row t (inside its packed sequence, or given).
template <class T, class Position>
void rope(int threads, Mat<T> x, Index heads, Index head_dim, Index rotary_dim, double theta, const Position& position_of,
          bool inverse) {
  const Index half = rotary_dim / 2;
  std::vector<T> inv_freq(half);
  for (Index i = 0; i < half; ++i)
    inv_freq[i] = T(1) / std::pow(static_cast<T>(theta), static_cast<T>(2 * i) / static_cast<T>(rotary_dim));

  parallel_for(threads, x.rows, [&](Index t) {
    const T position = static_cast<T>(position_of(t));
    T* row = x.row(t);
    for (Index i = 0; i < half; ++i) {
      const T angle = position * inv_freq[i];
      const T c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
      for (Index h = 0; h < heads; ++h) {
        T* p = row + h * head_dim;
        const T x1 = p[i], x2 = p[i + half];
        p[i] = x1 * c - x2 * s;  // x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)
        p[i + half] = x2 * c + x1 * s;
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------------
// Causal attention with GQA. One thread per (sequence, kv head) pair: it computes all the pair's query heads,
// so that the GQA sums of dk and dv run in head order. Memory is linear in the sequence length: the forward
// keeps one row of scores, the backward recomputes each probability from lse.

struct AttentionShape {
  Index q_heads, kv_heads, head_dim;
  Index group() const { return q_heads / kv_heads; }
};

template <class T>
double dot(const T* x, const T* y, Index n) {
  double sum = 0;
  for (Index d = 0; d < n; ++d) sum += static_cast<double>(x[d]) * y[d];
  return sum;
}

// One query (D values at qt) reading kv head `kv` over the key rows [start, t] of k and v: writes D values at
// ot and returns the log-sum-exp of the scaled scores. scores: t - start + 1 doubles, acc: D doubles.
template <class T>
double attend(T* ot, const T* qt, const Mat<T>& k, const Mat<T>& v, Index kv, Index D, double scale, Index start,
              Index t, double* scores, double* acc) {
  double max = -std::numeric_limits<double>::infinity();
  for (Index u = start; u <= t; ++u) {
    scores[u - start] = scale * dot(qt, k.row(u) + kv * D, D);
    max = std::max(max, scores[u - start]);
  }
  double sum = 0;
  std::fill_n(acc, D, 0.0);
  for (Index u = start; u <= t; ++u) {
    const double p = std::exp(scores[u - start] - max);
    sum += p;
    const T* vu = v.row(u) + kv * D;
    for (Index d = 0; d < D; ++d) acc[d] += p * vu[d];
  }
  for (Index d = 0; d < D; ++d) ot[d] = static_cast<T>(acc[d] / sum);
  return max + std::log(sum);
}

template <class T>
void attention_forward(int threads, Mat<T> o, Mat<T> lse, Mat<T> q, Mat<T> k, Mat<T> v, AttentionShape s, double scale,
                       const Sequences& seq) {
  const Index D = s.head_dim, per_thread = seq.max_length() + D;
  std::vector<double> scratch(static_cast<std::size_t>(threads) * per_thread);
#pragma omp parallel num_threads(threads)
  {
    double* scores = scratch.data() + omp_get_thread_num() * per_thread;
    double* acc = scores + seq.max_length();
#pragma omp for schedule(dynamic)
    for (Index pair = 0; pair < seq.count() * s.kv_heads; ++pair) {
      const Index n = pair / s.kv_heads, kv = pair % s.kv_heads;
      for (Index h = kv * s.group(); h < (kv + 1) * s.group(); ++h)
        for (Index t = seq.begin(n); t < seq.end(n); ++t)
          lse.row(h)[t] = static_cast<T>(
              attend(o.row(t) + h * D, q.row(t) + h * D, k, v, kv, D, scale, seq.begin(n), t, scores, acc));
    }
  }
}

// Attention over a cache: one thread per (sequence, kv head) pair, each query reading its slot's cache rows
// through attend, as attention_forward's queries read their sequence's rows.
template <class T>
void cached_attention(int threads, Mat<T> o, Mat<T> q, Mat<T> k_cache, Mat<T> v_cache, Index slot_rows,
                      AttentionShape s, double scale, const Sequences& seq, std::span<const std::int32_t> slots,
                      std::span<const std::int32_t> lengths) {
  const Index D = s.head_dim, per_thread = slot_rows + D;
  std::vector<double> scratch(static_cast<std::size_t>(threads) * per_thread);
#pragma omp parallel num_threads(threads)
  {
    double* scores = scratch.data() + omp_get_thread_num() * per_thread;
    double* acc = scores + slot_rows;
#pragma omp for schedule(dynamic)
    for (Index pair = 0; pair < seq.count() * s.kv_heads; ++pair) {
      const Index n = pair / s.kv_heads, kv = pair % s.kv_heads;
      const Mat<T> k{k_cache.row(slots[n] * slot_rows), slot_rows, k_cache.cols, k_cache.ld};
      const Mat<T> v{v_cache.row(slots[n] * slot_rows), slot_rows, v_cache.cols, v_cache.ld};
      const Index first_position = lengths[n] - (seq.end(n) - seq.begin(n));
      for (Index h = kv * s.group(); h < (kv + 1) * s.group(); ++h)
        for (Index t = seq.begin(n); t < seq.end(n); ++t)
          attend(o.row(t) + h * D, q.row(t) + h * D, k, v, kv, D, scale, 0, first_position + (t - seq.begin(n)),
                 scores, acc);
    }
  }
}

// The gradients of one query row t of head h: dq[t] is written, dk and dv of the sequence's keys (rows of
// dk_sum and dv_sum, from the sequence start) accumulated. P = exp(scale q k^T - lse),
// dS = P (dO v^T - rowsum(dO * O)), dq = scale dS K, dk += scale dS^T q (scale applied by the caller), dv += P^T dO.
template <class T>
void attend_backward(const Mat<T>& dq, const Mat<T>& dout, const Mat<T>& q, const Mat<T>& k, const Mat<T>& v,
                     const Mat<T>& o, const Mat<T>& lse, Index h, Index kv, Index D, double scale, Index start, Index t,
                     double* dk_sum, double* dv_sum, double* dq_sum) {
  const T *qt = q.row(t) + h * D, *dot_row = dout.row(t) + h * D;
  const double delta = dot(dot_row, o.row(t) + h * D, D);
  const double lse_t = lse.row(h)[t];
  std::fill_n(dq_sum, D, 0.0);
  for (Index u = start; u <= t; ++u) {
    const T *ku = k.row(u) + kv * D, *vu = v.row(u) + kv * D;
    const double p = std::exp(scale * dot(qt, ku, D) - lse_t);
    const double ds = p * (dot(dot_row, vu, D) - delta);
    double* dku = dk_sum + (u - start) * D;
    double* dvu = dv_sum + (u - start) * D;
    for (Index d = 0; d < D; ++d) {
      dq_sum[d] += ds * ku[d];
      dku[d] += ds * qt[d];
      dvu[d] += p * dot_row[d];
    }
  }
  T* dqt = dq.row(t) + h * D;
  for (Index d = 0; d < D; ++d) dqt[d] = static_cast<T>(scale * dq_sum[d]);
}

template <class T>
void attention_backward(int threads, Mat<T> dq, Mat<T> dk, Mat<T> dv, Mat<T> dout, Mat<T> q, Mat<T> k, Mat<T> v,
                        Mat<T> o, Mat<T> lse, AttentionShape s, double scale, const Sequences& seq) {
  const Index D = s.head_dim, per_thread = (2 * seq.max_length() + 1) * D;
  std::vector<double> scratch(static_cast<std::size_t>(threads) * per_thread);
#pragma omp parallel num_threads(threads)
  {
    double* dk_sum = scratch.data() + omp_get_thread_num() * per_thread;
    double* dv_sum = dk_sum + seq.max_length() * D;
    double* dq_sum = dv_sum + seq.max_length() * D;
#pragma omp for schedule(dynamic)
    for (Index pair = 0; pair < seq.count() * s.kv_heads; ++pair) {
      const Index n = pair / s.kv_heads, kv = pair % s.kv_heads;
      const Index start = seq.begin(n), length = seq.end(n) - start;
      std::fill_n(dk_sum, length * D, 0.0);
      std::fill_n(dv_sum, length * D, 0.0);
      for (Index h = kv * s.group(); h < (kv + 1) * s.group(); ++h)
        for (Index t = start; t < start + length; ++t)
          attend_backward(dq, dout, q, k, v, o, lse, h, kv, D, scale, start, t, dk_sum, dv_sum, dq_sum);
      for (Index u = 0; u < length; ++u) {
        T *dku = dk.row(start + u) + kv * D, *dvu = dv.row(start + u) + kv * D;
        for (Index d = 0; d < D; ++d) {
          dku[d] = static_cast<T>(scale * dk_sum[u * D + d]);
          dvu[d] = static_cast<T>(dv_sum[u * D + d]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Cross-entropy, in place over each row of logits.

template <class T>
void cross_entropy(int threads, Mat<T> logits, std::span<const std::int32_t> targets, std::span<const double> weights,
                   std::span<double> logprob, bool want_grad) {
  const Index V = logits.cols;
  parallel_for(threads, logits.rows, [&](Index r) {
    T* row = logits.row(r);
    const Index target = targets[r];
    if (target < 0) {
      logprob[r] = 0;
      if (want_grad) std::fill_n(row, V, T(0));
      return;
    }
    const LogSumExp s = log_sum_exp(row, V);
    logprob[r] = s.log_prob(row[target]);
    if (!want_grad) return;
    const double lse = s.lse();
    for (Index c = 0; c < V; ++c) {
      const double p = std::exp(static_cast<T>(row[c] - lse));
      row[c] = static_cast<T>(weights[r] * (c == target ? p - 1.0 : p));
    }
  });
}

// ---------------------------------------------------------------------------------------------------------

// A float64 vector [n] in host memory as a span (cross_entropy's weights and log-probabilities).
std::span<double> host_doubles(const TensorView& v, const char* name) {
  if (v.dtype != DType::f64 || v.ndim != 1 || v.device.type != DeviceType::cpu || (v.shape[0] > 1 && v.strides[0] != 1))
    throw InvalidArgument(name, "must be a contiguous float64 host vector, got " + std::string(dtype_name(v.dtype)) + " " +
                                    v.shape_string());
  return {v.ptr<double>(), static_cast<std::size_t>(v.shape[0])};
}

class CpuOps final : public Ops {
 public:
  CpuOps(int threads, bool batch_invariant) : threads_(threads), batch_invariant_(batch_invariant) {}

  void gemm(bool trans_a, bool trans_b, double alpha, const TensorView& a, const TensorView& b, double beta,
            const TensorView& c) override {
    dispatch(c, "c", [&]<class T>() {
      model::gemm<T>(threads(), batch_invariant_, trans_a, trans_b, alpha, a, b, beta, c);
    });
  }

  void embedding_forward(const TensorView& out, const IndexArray& token_ids,
                         const TensorView& table) override {
    dispatch(table, "table", [&]<class T>() {
      const Mat<T> tab = matrix<T>(table, "table");
      const Mat<T> o = matrix<T>(out, "out", static_cast<Index>(token_ids.size()), tab.cols);
      check_tokens(token_ids.host, tab.rows);
      parallel_for(threads(), o.rows, [&](Index t) { std::copy_n(tab.row(token_ids.host[t]), tab.cols, o.row(t)); });
    });
  }

  void embedding_backward(const TensorView& dtable, const IndexArray& token_ids,
                          const TensorView& dout) override {
    dispatch(dtable, "dtable", [&]<class T>() {
      const Mat<T> tab = matrix<T>(dtable, "dtable");
      const Mat<T> d = matrix<T>(dout, "dout", static_cast<Index>(token_ids.size()), tab.cols);
      check_tokens(token_ids.host, tab.rows);
      model::embedding_backward<T>(threads(), tab, token_ids.host, d);
    });
  }

  void rmsnorm_forward(const TensorView& out, const TensorView& rstd, const TensorView& x, const TensorView& weight,
                       double eps, bool zero_centred) override {
    dispatch(x, "x", [&]<class T>() {
      const Mat<T> xm = matrix<T>(x, "x");
      check_positive(xm.cols, "x's columns");
      model::rmsnorm_forward<T>(threads(), matrix<T>(out, "out", xm.rows, xm.cols), vector<T>(rstd, "rstd", xm.rows),
                                xm, vector<T>(weight, "weight", xm.cols), eps, zero_centred);
    });
  }

  void rmsnorm_backward(const TensorView& dx, const TensorView& dweight, const TensorView& dout, const TensorView& x,
                        const TensorView& rstd, const TensorView& weight, bool zero_centred,
                        bool accumulate_dx) override {
    dispatch(x, "x", [&]<class T>() {
      const Mat<T> xm = matrix<T>(x, "x");
      const Index R = xm.rows, C = xm.cols;
      check_positive(C, "x's columns");
      model::rmsnorm_backward<T>(threads(), matrix<T>(dx, "dx", R, C), vector<T>(dweight, "dweight", C),
                                 matrix<T>(dout, "dout", R, C), xm, vector<T>(rstd, "rstd", R),
                                 vector<T>(weight, "weight", C), zero_centred, accumulate_dx);
    });
  }

  void gated_rmsnorm_forward(const TensorView& out, const TensorView& rstd, const TensorView& x, const TensorView& z,
                             const TensorView& weight, double eps) override {
    dispatch(x, "x", [&]<class T>() {
      const GatedNormLayout l = check_gated_rmsnorm(x, weight);
      auto heads = [&](const TensorView& v, const char* name) {
        return HeadRows<T>{matrix<T>(v, name, l.tokens, l.heads * l.width), l.heads, l.width};
      };
      model::gated_rmsnorm_forward<T>(threads(), heads(out, "out"), vector<T>(rstd, "rstd", l.tokens * l.heads),
                                      heads(x, "x"), heads(z, "z"), vector<T>(weight, "weight", l.width), eps);
    });
  }

  void gated_rmsnorm_backward(const TensorView& dx, const TensorView& dz, const TensorView& dweight,
                              const TensorView& dout, const TensorView& x, const TensorView& z, const TensorView& rstd,
                              const TensorView& weight) override {
    dispatch(x, "x", [&]<class T>() {
      const GatedNormLayout l = check_gated_rmsnorm(x, weight);
      auto heads = [&](const TensorView& v, const char* name) {
        return HeadRows<T>{matrix<T>(v, name, l.tokens, l.heads * l.width), l.heads, l.width};
      };
      model::gated_rmsnorm_backward<T>(threads(), heads(dx, "dx"), heads(dz, "dz"),
                                       vector<T>(dweight, "dweight", l.width), heads(dout, "dout"), heads(x, "x"),
                                       heads(z, "z"), vector<T>(rstd, "rstd", l.tokens * l.heads),
                                       vector<T>(weight, "weight", l.width));
    });
  }

  void conv1d_silu_forward(const ColumnParts& out, const TensorView& x, const TensorView& weight,
                           const IndexArray& cu_seqlens) override {
    dispatch(x, "x", [&]<class T>() {
      const Mat<T> xm = matrix<T>(x, "x");
      const Mat<T> w = matrix<T>(weight, "weight", xm.cols, kAny);
      check_positive(w.cols, "weight's width");
      const Sequences seq(cu_seqlens.host, xm.rows);
      model::conv1d_silu_forward<T>(threads(), parts<T>(out, "out", xm.rows, xm.cols), xm, w, seq);
    });
  }

  void conv1d_silu_backward(const TensorView& dx, const TensorView& dweight, const ColumnParts& dout,
                            const TensorView& x, const TensorView& weight,
                            const IndexArray& cu_seqlens) override {
    dispatch(x, "x", [&]<class T>() {
      const Mat<T> xm = matrix<T>(x, "x");
      const Mat<T> w = matrix<T>(weight, "weight", xm.cols, kAny);
      check_positive(w.cols, "weight's width");
      const Sequences seq(cu_seqlens.host, xm.rows);
      model::conv1d_silu_backward<T>(threads(), matrix<T>(dx, "dx", xm.rows, xm.cols),
                                     matrix<T>(dweight, "dweight", w.rows, w.cols),
                                     parts<T>(dout, "dout", xm.rows, xm.cols), xm, w, seq);
    });
  }

  void gdn_gates_forward(const TensorView& g, const TensorView& beta, const TensorView& a, const TensorView& b,
                         const TensorView& a_log, const TensorView& dt_bias) override {
    dispatch(a, "a", [&]<class T>() {
      const Mat<T> am = matrix<T>(a, "a");
      const Index R = am.rows, H = am.cols;
      model::gdn_gates_forward<T>(threads(), matrix<T>(g, "g", R, H), matrix<T>(beta, "beta", R, H), am,
                                  matrix<T>(b, "b", R, H), vector<T>(a_log, "a_log", H),
                                  vector<T>(dt_bias, "dt_bias", H));
    });
  }

  void gdn_gates_backward(const TensorView& da, const TensorView& db, const TensorView& da_log,
                          const TensorView& ddt_bias, const TensorView& dg, const TensorView& dbeta,
                          const TensorView& a, const TensorView& b, const TensorView& a_log,
                          const TensorView& dt_bias) override {
    dispatch(a, "a", [&]<class T>() {
      const Mat<T> am = matrix<T>(a, "a");
      const Index R = am.rows, H = am.cols;
      model::gdn_gates_backward<T>(
          threads(), matrix<T>(da, "da", R, H), matrix<T>(db, "db", R, H), vector<T>(da_log, "da_log", H),
          vector<T>(ddt_bias, "ddt_bias", H), matrix<T>(dg, "dg", R, H), matrix<T>(dbeta, "dbeta", R, H), am,
          matrix<T>(b, "b", R, H), vector<T>(a_log, "a_log", H), vector<T>(dt_bias, "dt_bias", H));
    });
  }

  void rope(const TensorView& x, int heads, int head_dim, int rotary_dim, double theta,
            const IndexArray& cu_seqlens, bool inverse) override {
    dispatch(x, "x", [&]<class T>() {
      check_rope(heads, head_dim, rotary_dim, theta);
      const Mat<T> xm = matrix<T>(x, "x", kAny, Index{heads} * head_dim);
      const Sequences seq(cu_seqlens.host, xm.rows);
      model::rope<T>(threads(), xm, heads, head_dim, rotary_dim, theta, [&](Index t) { return t - seq.start_of(t); },
                     inverse);
    });
  }

  void attention_forward(const TensorView& o, const TensorView& lse, const TensorView& q, const TensorView& k,
                         const TensorView& v, int q_heads, int kv_heads, int head_dim, double scale,
                         const IndexArray& cu_seqlens) override {
    dispatch(q, "q", [&]<class T>() {
      const AttentionShape s = attention_shape(q_heads, kv_heads, head_dim);
      const Mat<T> qm = matrix<T>(q, "q", kAny, s.q_heads * s.head_dim);
      const Index R = qm.rows, kv_cols = s.kv_heads * s.head_dim;
      const Sequences seq(cu_seqlens.host, R);
      model::attention_forward<T>(threads(), matrix<T>(o, "o", R, qm.cols), matrix<T>(lse, "lse", s.q_heads, R), qm,
                                  matrix<T>(k, "k", R, kv_cols), matrix<T>(v, "v", R, kv_cols), s, scale, seq);
    });
  }

  void attention_backward(const TensorView& dq, const TensorView& dk, const TensorView& dv, const TensorView& dout,
                          const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                          const TensorView& lse, int q_heads, int kv_heads, int head_dim, double scale,
                          const IndexArray& cu_seqlens) override {
    dispatch(q, "q", [&]<class T>() {
      const AttentionShape s = attention_shape(q_heads, kv_heads, head_dim);
      const Mat<T> qm = matrix<T>(q, "q", kAny, s.q_heads * s.head_dim);
      const Index R = qm.rows, q_cols = qm.cols, kv_cols = s.kv_heads * s.head_dim;
      const Sequences seq(cu_seqlens.host, R);
      model::attention_backward<T>(threads(), matrix<T>(dq, "dq", R, q_cols), matrix<T>(dk, "dk", R, kv_cols),
                                   matrix<T>(dv, "dv", R, kv_cols), matrix<T>(dout, "dout", R, q_cols), qm,
                                   matrix<T>(k, "k", R, kv_cols), matrix<T>(v, "v", R, kv_cols),
                                   matrix<T>(o, "o", R, q_cols), matrix<T>(lse, "lse", s.q_heads, R), s, scale, seq);
    });
  }

  void copy_rows(const TensorView& dst, const IndexArray& dst_rows, const TensorView& src,
                 const IndexArray& src_rows) override {
    check_copy_rows(dst, dst_rows, src, src_rows);
    dispatch(dst, "dst", [&]<class T>() {
      const Mat<T> d = matrix<T>(dst, "dst"), s = matrix<T>(src, "src");
      parallel_for(threads(), static_cast<Index>(dst_rows.size()),
                   [&](Index i) { std::copy_n(s.row(src_rows.host[i]), d.cols, d.row(dst_rows.host[i])); });
    });
  }

  void conv1d_silu_step(const ColumnParts& out, const TensorView& x, const TensorView& weight,
                        const TensorView& state, const IndexArray& slots) override {
    const CacheLayout layout = check_conv1d_silu_step(out, x, weight, state, slots);
    dispatch(x, "x", [&]<class T>() {
      const Mat<T> xm = matrix<T>(x, "x"), w = matrix<T>(weight, "weight");
      std::vector<T> window(static_cast<std::size_t>(xm.rows * w.cols * xm.cols));
      model::conv1d_silu_step<T>(threads(), parts<T>(out, "out", xm.rows, xm.cols), xm, w,
                                 cache_rows<T>(state, "state", layout), slots.host, window.data());
    });
  }

  void rope_at_positions(const TensorView& x, int heads, int head_dim, int rotary_dim, double theta,
                         const IndexArray& positions) override {
    check_rope_at_positions(x, heads, head_dim, rotary_dim, theta, positions);
    dispatch(x, "x", [&]<class T>() {
      model::rope<T>(threads(), matrix<T>(x, "x"), heads, head_dim, rotary_dim, theta,
                     [&](Index t) { return positions.host[t]; }, false);
    });
  }

  void cached_attention(const TensorView& o, const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                        int q_heads, int kv_heads, int head_dim, double scale, const IndexArray& cu_seqlens,
                        const IndexArray& slots, const IndexArray& lengths) override {
    const CacheLayout layout =
        check_cached_attention(o, q, k_cache, v_cache, q_heads, kv_heads, head_dim, cu_seqlens, slots, lengths);
    dispatch(q, "q", [&]<class T>() {
      const Mat<T> qm = matrix<T>(q, "q");
      model::cached_attention<T>(threads(), matrix<T>(o, "o"), qm, cache_rows<T>(k_cache, "k_cache", layout),
                                 cache_rows<T>(v_cache, "v_cache", layout), layout.slot_rows,
                                 attention_shape(q_heads, kv_heads, head_dim), scale,
                                 Sequences(cu_seqlens.host, qm.rows), slots.host, lengths.host);
    });
  }

  void sigmoid_gate_forward(const TensorView& out, const TensorView& x, const TensorView& gate) override {
    dispatch(x, "x", [&]<class T>() {
      const Mat<T> xm = matrix<T>(x, "x");
      const Mat<T> gm = matrix<T>(gate, "gate", xm.rows, xm.cols), om = matrix<T>(out, "out", xm.rows, xm.cols);
      for_each_element(xm, [&](Index r, Index c) { om.row(r)[c] = xm.row(r)[c] * sigmoid(gm.row(r)[c]); });
    });
  }

  void sigmoid_gate_backward(const TensorView& dx, const TensorView& dgate, const TensorView& dout, const TensorView& x,
                             const TensorView& gate) override {
    dispatch(x, "x", [&]<class T>() {
      const Mat<T> xm = matrix<T>(x, "x");
      const Index R = xm.rows, C = xm.cols;
      const Mat<T> gm = matrix<T>(gate, "gate", R, C), dom = matrix<T>(dout, "dout", R, C);
      const Mat<T> dxm = matrix<T>(dx, "dx", R, C), dgm = matrix<T>(dgate, "dgate", R, C);
      for_each_element(xm, [&](Index r, Index c) {
        const T s = sigmoid(gm.row(r)[c]), dy = dom.row(r)[c];
        dxm.row(r)[c] = dy * s;
        dgm.row(r)[c] = dy * xm.row(r)[c] * s * (T(1) - s);
      });
    });
  }

  void swiglu_forward(const TensorView& out, const TensorView& gate, const TensorView& up) override {
    dispatch(gate, "gate", [&]<class T>() {
      const Mat<T> gm = matrix<T>(gate, "gate");
      const Mat<T> um = matrix<T>(up, "up", gm.rows, gm.cols), om = matrix<T>(out, "out", gm.rows, gm.cols);
      for_each_element(gm, [&](Index r, Index c) { om.row(r)[c] = silu(gm.row(r)[c]) * um.row(r)[c]; });
    });
  }

  void swiglu_backward(const TensorView& dgate, const TensorView& dup, const TensorView& dout, const TensorView& gate,
                       const TensorView& up) override {
    dispatch(gate, "gate", [&]<class T>() {
      const Mat<T> gm = matrix<T>(gate, "gate");
      const Index R = gm.rows, C = gm.cols;
      const Mat<T> um = matrix<T>(up, "up", R, C), dom = matrix<T>(dout, "dout", R, C);
      const Mat<T> dgm = matrix<T>(dgate, "dgate", R, C), dum = matrix<T>(dup, "dup", R, C);
      for_each_element(gm, [&](Index r, Index c) {
        const T g = gm.row(r)[c], dy = dom.row(r)[c];
        dum.row(r)[c] = dy * silu(g);
        dgm.row(r)[c] = dy * um.row(r)[c] * silu_grad(g);
      });
    });
  }

  void add(const TensorView& y, const TensorView& x) override {
    dispatch(y, "y", [&]<class T>() {
      const Mat<T> ym = matrix<T>(y, "y");
      const Mat<T> xm = matrix<T>(x, "x", ym.rows, ym.cols);
      for_each_element(ym, [&](Index r, Index c) { ym.row(r)[c] += xm.row(r)[c]; });
    });
  }

  void copy(const TensorView& dst, const TensorView& src) override {
    dispatch(dst, "dst", [&]<class T>() {
      const Mat<T> d = matrix<T>(dst, "dst");
      const Mat<T> s = matrix<T>(src, "src", d.rows, d.cols);
      parallel_for(threads(), d.rows, [&](Index r) { std::copy_n(s.row(r), d.cols, d.row(r)); });
    });
  }

  void fill_zero(const TensorView& x) override {
    dispatch(x, "x", [&]<class T>() {
      const Mat<T> m = matrix<T>(x, "x");
      parallel_for(threads(), m.rows, [&](Index r) { std::fill_n(m.row(r), m.cols, T(0)); });
    });
  }

  void cross_entropy(const TensorView& logits, const IndexArray& target_ids, const TensorView& weight_values,
                     const TensorView& logprob_values, bool want_grad) override {
    const std::span<const std::int32_t> targets = target_ids.host;
    const std::span<const double> weights = want_grad ? host_doubles(weight_values, "weights") : std::span<double>();
    const std::span<double> logprob = host_doubles(logprob_values, "logprob");
    dispatch(logits, "logits", [&]<class T>() {
      const Mat<T> l = matrix<T>(logits, "logits");
      check_same_rows(l.rows, targets.size(), "targets");
      check_same_rows(l.rows, logprob.size(), "logprob");
      if (want_grad) check_same_rows(l.rows, weights.size(), "weights");
      for (const std::int32_t target : targets)
        if (target >= l.cols)
          throw InvalidArgument("targets", "must be < the vocabulary " + std::to_string(l.cols) +
                                               " (or negative: "
                                               "ignored), got " +
                                               std::to_string(target));
      model::cross_entropy<T>(threads(), l, targets, weights, logprob, want_grad);
    });
  }

 private:
  int threads() const { return threads_ > 0 ? threads_ : omp_get_max_threads(); }

  // body(r, c) for every element of m's shape, rows in parallel.
  template <class T, class Body>
  void for_each_element(const Mat<T>& m, const Body& body) const {
    parallel_for(threads(), m.rows, [&](Index r) {
      for (Index c = 0; c < m.cols; ++c) body(r, c);
    });
  }

  static AttentionShape attention_shape(int q_heads, int kv_heads, int head_dim) {
    check_attention_heads(q_heads, kv_heads, head_dim);
    return {q_heads, kv_heads, head_dim};
  }

  int threads_;
  bool batch_invariant_;
};

}  // namespace

std::unique_ptr<Ops> make_cpu_ops(int threads, bool batch_invariant) {
  if (threads < 0) throw InvalidArgument("threads", "must be >= 0 (0: all available), got " + std::to_string(threads));
  return std::make_unique<CpuOps>(threads, batch_invariant);
}

}  // namespace deltatrain::model
