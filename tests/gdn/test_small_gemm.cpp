// The cpu backend's chunk products and triangular solves against plain float64 loops, on random sizes
// that are and are not multiples of the register tile (8 rows x 2 vectors) and of the solve block (16).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/small_gemm.h"
#include "gdn_testing.h"

namespace deltatrain::gdn::testing {
namespace {

using cpu::matrix;

class SmallGemm : public SeededTest {
 protected:
  std::vector<float> random_matrix(std::int64_t rows, std::int64_t cols) {
    std::normal_distribution<float> normal;
    std::vector<float> m(rows * cols);
    for (float& x : m) x = normal(rng_);
    return m;
  }
  std::int64_t random_extent(std::int64_t most) { return std::uniform_int_distribution<std::int64_t>(1, most)(rng_); }
};

std::vector<double> as_double(const std::vector<float>& m) { return {m.begin(), m.end()}; }

TEST_F(SmallGemm, ProductsMatchPlainLoops) {
  for (int trial = 0; trial < 20; ++trial) {
    const std::int64_t M = random_extent(70), N = random_extent(140), K = random_extent(140);
    const auto a = random_matrix(M, K), a_t = random_matrix(K, M), b = random_matrix(K, N), c0 = random_matrix(M, N);
    std::vector<float> nn = c0, tn = c0, b_t(N * K);
    cpu::gemm_nn<float>(matrix(nn.data(), M, N), matrix(a.data(), M, K), matrix(b.data(), K, N), 0.5f, 2.0f);
    cpu::gemm_tn<float>(matrix(tn.data(), M, N), matrix(a_t.data(), K, M), matrix(b.data(), K, N), -1.0f, 1.0f);
    cpu::transpose<float>(matrix(b.data(), K, N), b_t.data());
    for (std::int64_t k = 0; k < K; ++k)
      for (std::int64_t j = 0; j < N; ++j) ASSERT_EQ(b_t[j * K + k], b[k * N + j]) << "transpose at " << k << ", " << j;

    std::vector<double> want_nn(M * N), want_tn(M * N);
    for (std::int64_t i = 0; i < M; ++i) {
      for (std::int64_t j = 0; j < N; ++j) {
        double sum_nn = 0, sum_tn = 0;
        for (std::int64_t k = 0; k < K; ++k) {
          sum_nn += double(a[i * K + k]) * b[k * N + j];
          sum_tn += double(a_t[k * M + i]) * b[k * N + j];
        }
        want_nn[i * N + j] = 0.5 * sum_nn + 2.0 * c0[i * N + j];
        want_tn[i * N + j] = -sum_tn + c0[i * N + j];
      }
    }
    EXPECT_TRUE(close("A B", as_double(nn), want_nn, 1e-5)) << M << "x" << N << "x" << K;
    EXPECT_TRUE(close("A^T B", as_double(tn), want_tn, 1e-5)) << M << "x" << N << "x" << K;
  }
}

TEST_F(SmallGemm, TriangularSolvesInvertTheirProducts) {
  for (int trial = 0; trial < 20; ++trial) {
    const std::int64_t L = random_extent(64), N = random_extent(140);
    // A strictly lower with small entries, as beta (k_i . k_j) Gamma_ij is for normalised keys.
    std::vector<float> a = random_matrix(L, L);
    for (std::int64_t i = 0; i < L; ++i)
      for (std::int64_t j = 0; j < L; ++j) a[i * L + j] = j < i ? a[i * L + j] * 0.1f : 0.0f;
    const auto x = random_matrix(L, N);
    // b = (I + A) x and b_t = (I + A)^T x in float64; the solves must give x back.
    std::vector<float> b(L * N), b_t(L * N);
    for (std::int64_t i = 0; i < L; ++i) {
      for (std::int64_t e = 0; e < N; ++e) {
        double sum = x[i * N + e], sum_t = x[i * N + e];
        for (std::int64_t j = 0; j < L; ++j) {
          sum += double(a[i * L + j]) * x[j * N + e];
          sum_t += double(a[j * L + i]) * x[j * N + e];
        }
        b[i * N + e] = static_cast<float>(sum);
        b_t[i * N + e] = static_cast<float>(sum_t);
      }
    }
    cpu::solve_unit_lower<float>(matrix(a.data(), L, L), matrix(b.data(), L, N));
    cpu::solve_unit_lower_transposed<float>(matrix(a.data(), L, L), matrix(b_t.data(), L, N));
    EXPECT_TRUE(close("(I + A)^-1", as_double(b), as_double(x), 1e-4)) << L << "x" << N;
    EXPECT_TRUE(close("(I + A)^-T", as_double(b_t), as_double(x), 1e-4)) << L << "x" << N;
  }
}

}  // namespace
}  // namespace deltatrain::gdn::testing
