// The chunk's dense products: row-major C (M x N) = alpha * op(A) B + beta * C, for the small shapes
// of one chunk (64 x 64 x 256 at most); a transposed right operand is transposed once by the caller. A register tile of kTileRows x kTileCols outputs is accumulated
// over the whole inner dimension before it is written, so each loaded row piece of B feeds kTileRows
// fused multiply-adds from registers; op(A) = A or A^T is only a choice of strides.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace deltatrain::gdn::cpu {

template <class T>
struct Matrix {
  T* data;
  std::int64_t rows, cols, ld;
  T* row(std::int64_t i) const { return data + i * ld; }
  T& operator()(std::int64_t i, std::int64_t j) const { return data[i * ld + j]; }
  operator Matrix<const T>() const
    requires(!std::is_const_v<T>)
  {
    return {data, rows, cols, ld};
  }
};

template <class T>
Matrix<T> matrix(T* data, std::int64_t rows, std::int64_t cols) {
  return {data, rows, cols, cols};
}

namespace detail {

// Eight rows by two 64-byte vectors: 16 accumulator registers, within AVX-512's 32.
inline constexpr int kTileRows = 8;
template <class T>
inline constexpr int kTileCols = 128 / sizeof(T);

// One tile of C at (i0, j0); `cols` <= Cols columns are live (Cols when the tile is full).
template <class T, int Rows, int Cols, bool Full>
inline void tile(const Matrix<T>& c, std::int64_t i0, std::int64_t j0, std::int64_t cols, const T* a,
                 std::int64_t a_row_stride, std::int64_t a_inner_stride, const Matrix<const T>& b, T alpha, T beta) {
  T acc[Rows][Cols] = {};
  const std::int64_t inner = b.rows;
  for (std::int64_t k = 0; k < inner; ++k) {
    const T* __restrict brow = b.row(k) + j0;
    for (int r = 0; r < Rows; ++r) {
      const T ar = a[(i0 + r) * a_row_stride + k * a_inner_stride];
      if constexpr (Full) {
#pragma omp simd
        for (int j = 0; j < Cols; ++j) acc[r][j] += ar * brow[j];
      } else {
        for (int j = 0; j < cols; ++j) acc[r][j] += ar * brow[j];
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    T* __restrict out = c.row(i0 + r) + j0;
    const int live = Full ? Cols : static_cast<int>(cols);
    for (int j = 0; j < live; ++j) out[j] = alpha * acc[r][j] + (beta == T(0) ? T(0) : beta * out[j]);
  }
}

template <class T, int Rows>
inline void tile_row(const Matrix<T>& c, std::int64_t i0, const T* a, std::int64_t a_row_stride,
                     std::int64_t a_inner_stride, const Matrix<const T>& b, T alpha, T beta) {
  constexpr int Cols = kTileCols<T>;
  std::int64_t j0 = 0;
  for (; j0 + Cols <= c.cols; j0 += Cols) {
    tile<T, Rows, Cols, true>(c, i0, j0, Cols, a, a_row_stride, a_inner_stride, b, alpha, beta);
  }
  if (j0 < c.cols) tile<T, Rows, Cols, false>(c, i0, j0, c.cols - j0, a, a_row_stride, a_inner_stride, b, alpha, beta);
}

// C = alpha * op(A) B + beta * C with op(A)(i, k) = a[i * a_row_stride + k * a_inner_stride].
template <class T>
void gemm(const Matrix<T>& c, const T* a, std::int64_t a_row_stride, std::int64_t a_inner_stride,
          const Matrix<const T>& b, T alpha, T beta) {
  std::int64_t i0 = 0;
  for (; i0 + kTileRows <= c.rows; i0 += kTileRows) {
    tile_row<T, kTileRows>(c, i0, a, a_row_stride, a_inner_stride, b, alpha, beta);
  }
  for (; i0 < c.rows; ++i0) tile_row<T, 1>(c, i0, a, a_row_stride, a_inner_stride, b, alpha, beta);
}

}  // namespace detail

// C = alpha * A B + beta * C;  A is M x K, B is K x N.
template <class T>
void gemm_nn(const Matrix<T>& c, const Matrix<const T>& a, const Matrix<const T>& b, T alpha = 1, T beta = 0) {
  detail::gemm<T>(c, a.data, a.ld, 1, b, alpha, beta);
}

// C = alpha * A^T B + beta * C;  A is K x M, B is K x N.
template <class T>
void gemm_tn(const Matrix<T>& c, const Matrix<const T>& a, const Matrix<const T>& b, T alpha = 1, T beta = 0) {
  detail::gemm<T>(c, a.data, 1, a.ld, b, alpha, beta);
}

// dst (cols x rows, densely packed) = src^T. Products with a transposed right operand transpose it once
// with this and reuse the copy. Square blocks keep both the reads and the writes within a few cache lines.
template <class T>
void transpose(const Matrix<const T>& src, T* dst) {
  constexpr std::int64_t kBlock = 16;
  for (std::int64_t i0 = 0; i0 < src.rows; i0 += kBlock) {
    const std::int64_t i1 = std::min(i0 + kBlock, src.rows);
    for (std::int64_t j0 = 0; j0 < src.cols; j0 += kBlock) {
      const std::int64_t j1 = std::min(j0 + kBlock, src.cols);
      for (std::int64_t j = j0; j < j1; ++j)
        for (std::int64_t i = i0; i < i1; ++i) dst[j * src.rows + i] = src(i, j);
    }
  }
}

// Unit lower-triangular solves with a strictly lower A (L x L): X <- (I + A)^-1 X and X <- (I + A)^-T X,
// X being L x N. Blocks of kSolveBlock rows: the coupling to the rows already solved is one product per
// block, so only the small diagonal blocks are solved row by row.
inline constexpr std::int64_t kSolveBlock = 16;

template <class T>
void solve_unit_lower(const Matrix<const T>& a, const Matrix<T>& x) {
  const std::int64_t L = a.rows, N = x.cols;
  for (std::int64_t b0 = 0; b0 < L; b0 += kSolveBlock) {
    const std::int64_t b1 = std::min(b0 + kSolveBlock, L);
    const Matrix<T> block{x.row(b0), b1 - b0, N, x.ld};
    if (b0 > 0) {
      gemm_nn<T>(block, Matrix<const T>{a.row(b0), b1 - b0, b0, a.ld}, Matrix<const T>{x.data, b0, N, x.ld}, T(-1),
                 T(1));
    }
    for (std::int64_t i = b0 + 1; i < b1; ++i) {
      T* __restrict row = x.row(i);
      for (std::int64_t c = b0; c < i; ++c) {
        const T factor = a(i, c);
        const T* __restrict solved = x.row(c);
#pragma omp simd
        for (std::int64_t e = 0; e < N; ++e) row[e] -= factor * solved[e];
      }
    }
  }
}

template <class T>
void solve_unit_lower_transposed(const Matrix<const T>& a, const Matrix<T>& x) {
  const std::int64_t L = a.rows, N = x.cols;
  for (std::int64_t b1 = L; b1 > 0; b1 -= kSolveBlock) {
    const std::int64_t b0 = std::max<std::int64_t>(b1 - kSolveBlock, 0);
    const Matrix<T> block{x.row(b0), b1 - b0, N, x.ld};
    if (b1 < L) {
      gemm_tn<T>(block, Matrix<const T>{a.row(b1) + b0, L - b1, b1 - b0, a.ld},
                 Matrix<const T>{x.row(b1), L - b1, N, x.ld}, T(-1), T(1));
    }
    for (std::int64_t i = b1 - 2; i >= b0; --i) {
      T* __restrict row = x.row(i);
      for (std::int64_t later = i + 1; later < b1; ++later) {
        const T factor = a(later, i);
        const T* __restrict solved = x.row(later);
#pragma omp simd
        for (std::int64_t e = 0; e < N; ++e) row[e] -= factor * solved[e];
      }
    }
  }
}

}  // namespace deltatrain::gdn::cpu
