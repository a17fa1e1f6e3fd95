// The bounded warm-up's rule (gdn/cuda/warmup.h), which the cuda kernels apply on the device: a token's stretch
// against the spectral norm of its transition, computed here by Jacobi rotations in double; the chosen first chunk
// against the definition, the latest chunk whose run to the end sums (in double) to the bound or less, on random
// bounds with -inf (a full reset) and NaN among them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cuda/warmup.h"

namespace {

using deltatrain::gdn::cuda::kWarmupLogBound;
using deltatrain::gdn::cuda::transition_log_stretch;
using deltatrain::gdn::cuda::warmup_first_chunk;

// The spectral norm of I - beta k k^T, symmetric: its largest eigenvalue in magnitude, by cyclic Jacobi rotations in
// double (each zeroes one off-diagonal entry; sweeps until the off-diagonal part vanishes).
double spectral_norm(const std::vector<double>& k, double beta) {
  const std::size_t n = k.size();
  std::vector<std::vector<double>> a(n, std::vector<double>(n));
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) a[i][j] = (i == j ? 1.0 : 0.0) - beta * k[i] * k[j];
  }
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t j = i + 1; j < n; ++j) off += a[i][j] * a[i][j];
    }
    if (off < 1e-30) break;
    for (std::size_t p = 0; p < n; ++p) {
      for (std::size_t q = p + 1; q < n; ++q) {
        if (a[p][q] == 0) continue;
        const double theta = (a[q][q] - a[p][p]) / (2 * a[p][q]);
        const double t = (theta >= 0 ? 1 : -1) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (std::size_t r = 0; r < n; ++r) {  // A <- A J (columns p, q), then J^T A (rows p, q)
          const double ap = a[r][p], aq = a[r][q];
          a[r][p] = c * ap - s * aq;
          a[r][q] = s * ap + c * aq;
        }
        for (std::size_t r = 0; r < n; ++r) {
          const double pa = a[p][r], qa = a[q][r];
          a[p][r] = c * pa - s * qa;
          a[q][r] = s * pa + c * qa;
        }
      }
    }
  }
  double norm = 0;
  for (std::size_t i = 0; i < n; ++i) norm = std::max(norm, std::fabs(a[i][i]));
  return norm;
}

TEST(Warmup, StretchIsTheLogOfTheTransitionsNormBeyondItsDecay) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<double> betas(-0.5, 2.0), scales(0.2, 2.0);
  std::normal_distribution<double> normal;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<double> k(8);
    double norm2 = 0;
    for (double& e : k) e = normal(rng);
    const double scale = scales(rng);
    for (double& e : k) {
      e *= scale / std::sqrt(8.0);
      norm2 += e * e;
    }
    const double beta = betas(rng);
    const double expected = std::log(spectral_norm(k, beta));
    EXPECT_NEAR(transition_log_stretch(static_cast<float>(beta), static_cast<float>(norm2)), expected, 1e-5)
        << "beta " << beta << ", |k|^2 " << norm2;
  }
}

TEST(Warmup, UnitKeysWithBetaInTheUnitIntervalOnlyDecay) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> betas(0.f, 1.f);
  for (int trial = 0; trial < 1000; ++trial) EXPECT_EQ(transition_log_stretch(betas(rng), 1.f), 0.f);
}

// The latest chunk j whose chunks j..end sum to the bound or less, in double; -1 where none. `ambiguous` is set where
// a run's sum lies so near the bound that float32's order of sums may decide either way.
int first_chunk_by_definition(const std::vector<float>& bounds, bool& ambiguous) {
  double sum = 0;
  ambiguous = false;
  for (int j = static_cast<int>(bounds.size()) - 1; j >= 0; --j) {
    sum += bounds[j];
    if (std::isnan(sum)) return -1;
    if (std::fabs(sum - kWarmupLogBound) < 1e-3) ambiguous = true;
    if (sum <= kWarmupLogBound) return j;
  }
  return -1;
}

TEST(Warmup, FirstChunkIsTheLatestWhoseRunReachesTheBound) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> counts(1, 300), kinds(0, 99);
  std::uniform_real_distribution<float> decays(-6.f, 0.5f), slow(-0.2f, 0.f);
  int found = 0, none = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::vector<float> bounds(counts(rng));
    const bool slow_heads = trial % 3 == 0;  // most runs then end without reaching the bound
    for (float& b : bounds) {
      const int kind = kinds(rng);
      b = kind == 0 ? -std::numeric_limits<float>::infinity()
          : kind == 1 ? std::numeric_limits<float>::quiet_NaN()
                      : (slow_heads ? slow(rng) : decays(rng));
    }
    bool ambiguous = false;
    const int expected = first_chunk_by_definition(bounds, ambiguous);
    if (ambiguous) continue;
    const int chosen = warmup_first_chunk(static_cast<int>(bounds.size()), [&](int j) { return bounds[j]; });
    ASSERT_EQ(chosen, expected) << "trial " << trial << ", " << bounds.size() << " chunks";
    (expected >= 0 ? found : none) += 1;
  }
  EXPECT_GT(found, 1000);
  EXPECT_GT(none, 1000);
}

}  // namespace
