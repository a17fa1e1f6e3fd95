// The chunk's dense products: row-major C (M x N) = alpha * op(A) op(B) + beta * C, for the small
// shapes of one chunk (64 x 64 x 256 at most). The innermost loop always runs along a contiguous row
// of C and B, so the compiler vectorises it; four rows of C are updated per pass over B to reuse
// each loaded row of B four times from registers.
#pragma once

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

template <class T>
void scale_rows(const Matrix<T>& c, T beta) {
  for (std::int64_t i = 0; i < c.rows; ++i) {
    T* row = c.row(i);
    for (std::int64_t j = 0; j < c.cols; ++j) row[j] = beta == T(0) ? T(0) : row[j] * beta;
  }
}

// C = alpha * A B + beta * C;  A is M x K, B is K x N.
template <class T>
void gemm_nn(const Matrix<T>& c, const Matrix<const T>& a, const Matrix<const T>& b, T alpha = 1, T beta = 0) {
  scale_rows(c, beta);
  const std::int64_t M = c.rows, N = c.cols, K = a.cols;
  std::int64_t i = 0;
  for (; i + 4 <= M; i += 4) {
    T* __restrict c0 = c.row(i);
    T* __restrict c1 = c.row(i + 1);
    T* __restrict c2 = c.row(i + 2);
    T* __restrict c3 = c.row(i + 3);
    for (std::int64_t k = 0; k < K; ++k) {
      const T a0 = alpha * a(i, k), a1 = alpha * a(i + 1, k), a2 = alpha * a(i + 2, k), a3 = alpha * a(i + 3, k);
      const T* __restrict brow = b.row(k);
#pragma omp simd
      for (std::int64_t j = 0; j < N; ++j) {
        const T x = brow[j];
        c0[j] += a0 * x;
        c1[j] += a1 * x;
        c2[j] += a2 * x;
        c3[j] += a3 * x;
      }
    }
  }
  for (; i < M; ++i) {
    T* __restrict crow = c.row(i);
    for (std::int64_t k = 0; k < K; ++k) {
      const T ak = alpha * a(i, k);
      const T* __restrict brow = b.row(k);
#pragma omp simd
      for (std::int64_t j = 0; j < N; ++j) crow[j] += ak * brow[j];
    }
  }
}

// C = alpha * A^T B + beta * C;  A is K x M, B is K x N.
template <class T>
void gemm_tn(const Matrix<T>& c, const Matrix<const T>& a, const Matrix<const T>& b, T alpha = 1, T beta = 0) {
  scale_rows(c, beta);
  const std::int64_t M = c.rows, N = c.cols, K = a.rows;
  std::int64_t i = 0;
  for (; i + 4 <= M; i += 4) {
    T* __restrict c0 = c.row(i);
    T* __restrict c1 = c.row(i + 1);
    T* __restrict c2 = c.row(i + 2);
    T* __restrict c3 = c.row(i + 3);
    for (std::int64_t k = 0; k < K; ++k) {
      const T* arow = a.row(k);
      const T a0 = alpha * arow[i], a1 = alpha * arow[i + 1], a2 = alpha * arow[i + 2], a3 = alpha * arow[i + 3];
      const T* __restrict brow = b.row(k);
#pragma omp simd
      for (std::int64_t j = 0; j < N; ++j) {
        const T x = brow[j];
        c0[j] += a0 * x;
        c1[j] += a1 * x;
        c2[j] += a2 * x;
        c3[j] += a3 * x;
      }
    }
  }
  for (; i < M; ++i) {
    T* __restrict crow = c.row(i);
    for (std::int64_t k = 0; k < K; ++k) {
      const T ak = alpha * a(k, i);
      const T* __restrict brow = b.row(k);
#pragma omp simd
      for (std::int64_t j = 0; j < N; ++j) crow[j] += ak * brow[j];
    }
  }
}

// C = alpha * A B^T + beta * C;  A is M x K, B is N x K. B is transposed into `scratch`
// (K x N, at least K * N elements) so that the product runs in the vectorised A B form.
template <class T>
void gemm_nt(const Matrix<T>& c, const Matrix<const T>& a, const Matrix<const T>& b, T* scratch, T alpha = 1,
             T beta = 0) {
  const std::int64_t N = b.rows, K = b.cols;
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t k = 0; k < K; ++k) scratch[k * N + n] = b(n, k);
  gemm_nn<T>(c, a, Matrix<const T>{scratch, K, N, N}, alpha, beta);
}

}  // namespace deltatrain::gdn::cpu
