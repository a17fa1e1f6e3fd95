// Sampling against its definition: greedy is the argmax, the empirical distribution of many draws matches the
// transformed softmax (temperature, top-k, top-p) computed here from the definition, the returned logprobs are
// those of the transformed distribution, draws are a function of (seed, sequence, index) alone, and
// parameters out of range are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "deltatrain/core/error.h"
#include "deltatrain/rollout/sampling.h"

namespace deltatrain::rollout {
namespace {

// p(token) after temperature, top-k and top-p, from the definition (a full sort, ties to the lower id).
std::vector<double> transformed(const std::vector<double>& logits, const SamplingParams& p) {
  const auto V = static_cast<int>(logits.size());
  std::vector<int> ids(V);
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  const int k = p.top_k > 0 ? std::min(p.top_k, V) : V;
  std::vector<double> w(V, 0.0);
  double z = 0;
  for (int i = 0; i < k; ++i) z += w[ids[i]] = std::exp((logits[ids[i]] - logits[ids[0]]) / p.temperature);
  double mass = 0;
  int kept = 0;
  while (kept < k) {
    mass += w[ids[kept++]] / z;
    if (mass >= p.top_p * (1 - 1e-12)) break;
  }
  std::vector<double> out(V, 0.0);
  for (int i = 0; i < kept; ++i) out[ids[i]] = w[ids[i]] / z / mass;
  return out;
}

std::vector<double> random_logits(std::mt19937_64& rng, int V) {
  std::normal_distribution<double> n(0, 2);
  std::vector<double> l(V);
  for (auto& x : l) x = n(rng);
  return l;
}

TEST(Sampling, GreedyIsTheArgmaxWithLowestIdOnTies) {
  std::vector<std::int32_t> scratch;
  const std::vector<double> logits{0.5, 3.0, -1.0, 3.0, 2.9};
  const Sample s = sample_token(logits, {.temperature = 0}, 0.999, true, scratch);
  EXPECT_EQ(s.token, 1);
  EXPECT_EQ(s.logprob, 0.0);
  double z = 0;
  for (double l : logits) z += std::exp(l);
  EXPECT_NEAR(s.untempered_logprob, 3.0 - std::log(z), 1e-14);
}

// Each transform: the logprob returned is log of the reference probability, and the frequencies of 40k draws
// (uniforms from the counter RNG) are within 5 standard errors of it; tokens outside the kept set never appear.
TEST(Sampling, DrawsFollowTheTransformedDistribution) {
  std::mt19937_64 rng(12345);
  const std::vector<SamplingParams> cases{{.temperature = 1.0},
                                          {.temperature = 0.5},
                                          {.temperature = 2.0, .top_k = 3},
                                          {.temperature = 1.0, .top_p = 0.6},
                                          {.temperature = 0.7, .top_p = 0.8, .top_k = 4},
                                          {.temperature = 1.0, .top_k = 1}};
  std::vector<std::int32_t> scratch;
  for (const SamplingParams& p : cases) {
    const std::vector<double> logits = random_logits(rng, 11);
    const std::vector<double> ref = transformed(logits, p);
    std::vector<int> counts(logits.size(), 0);
    const int draws = 40000;
    for (int i = 0; i < draws; ++i) {
      const Sample s = sample_token(logits, p, uniform(99, 3, i), false, scratch);
      ASSERT_GT(ref[s.token], 0.0) << "drew a token outside the kept set";
      EXPECT_NEAR(s.logprob, std::log(ref[s.token]), 1e-12);
      ++counts[s.token];
    }
    for (std::size_t v = 0; v < logits.size(); ++v) {
      const double f = double(counts[v]) / draws, se = std::sqrt(ref[v] * (1 - ref[v]) / draws);
      EXPECT_NEAR(f, ref[v], 5 * se + 1e-12) << "token " << v << " temperature " << p.temperature << " top_p "
                                             << p.top_p << " top_k " << p.top_k;
    }
  }
}

TEST(Sampling, UniformIsAFunctionOfItsCountersAndLooksUniform) {
  EXPECT_EQ(uniform(1, 2, 3), uniform(1, 2, 3));
  std::set<double> seen{uniform(1, 2, 3), uniform(2, 2, 3), uniform(1, 3, 3), uniform(1, 2, 4)};
  EXPECT_EQ(seen.size(), 4u) << "each counter changes the draw";
  const int n = 100000;
  std::vector<int> bins(10, 0);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    const double u = uniform(7, i % 13, i / 13);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    ++bins[static_cast<int>(u * 10)];
    sum += u;
  }
  for (int b : bins) EXPECT_NEAR(b, n / 10, 5 * std::sqrt(n * 0.1 * 0.9));
  EXPECT_NEAR(sum / n, 0.5, 5 * std::sqrt(1.0 / 12 / n));
}

TEST(Sampling, ParametersOutOfRangeAreRefusedByName) {
  const auto argument = [](const SamplingParams& p) {
    try {
      validate(p, "r");
    } catch (const InvalidArgument& e) {
      return e.argument();
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(argument({.temperature = 0}), "(accepted)");
  EXPECT_EQ(argument({.temperature = 1, .top_p = 1, .top_k = 0}), "(accepted)");
  EXPECT_EQ(argument({.temperature = -1e-9}), "r.temperature");
  EXPECT_EQ(argument({.temperature = INFINITY}), "r.temperature");
  EXPECT_EQ(argument({.top_p = 0}), "r.top_p");
  EXPECT_EQ(argument({.top_p = 1.0000001}), "r.top_p");
  EXPECT_EQ(argument({.top_p = NAN}), "r.top_p");
  EXPECT_EQ(argument({.top_k = -3}), "r.top_k");
}

}  // namespace
}  // namespace deltatrain::rollout
