// Sampling against its definition: greedy is the argmax, the empirical distribution of many draws matches the
// transformed softmax (temperature, top-k, top-p) computed here from the definition (per token and by a
// chi-square over the kept set, ties included), a draw u maps to the kept token where the id-order cumulative
// probability first exceeds u, the returned logprobs are those of the transformed distribution, draws are a
// function of (seed, sequence, index) alone, BatchSampler's rows are sample_token's, and parameters out of range
// are refused by name. Fresh random logits each run (a failing test prints its seed).
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
#include "device_sampler.h"
#include "model_testing.h"

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

class SamplingTest : public model::testing::SeededTest {};

std::vector<double> random_logits(std::mt19937_64& rng, int V) {
  std::normal_distribution<double> n(0, 2);
  std::vector<double> l(V);
  for (auto& x : l) x = n(rng);
  return l;
}

// How many blocks a greedy row is spread over on the GPU: the batch fills the GPU twice over where the vocabulary
// allows, no part below kGreedyMinValues values, at least one.
TEST_F(SamplingTest, GreedyPartsFillTheGpuWithoutPartsTooSmall) {
  for (int trial = 0; trial < 5000; ++trial) {
    const std::int64_t rows = std::uniform_int_distribution<std::int64_t>(1, 1024)(rng_);
    const std::int64_t vocab = std::uniform_int_distribution<std::int64_t>(1, 300000)(rng_);
    const int sms = std::uniform_int_distribution<int>(1, 200)(rng_);
    const int parts = greedy_parts(rows, vocab, sms);
    SCOPED_TRACE(std::to_string(rows) + " rows, vocabulary " + std::to_string(vocab) + ", " + std::to_string(sms) +
                 " SMs: " + std::to_string(parts) + " parts");
    ASSERT_GE(parts, 1);
    EXPECT_TRUE(rows * parts >= 2 * sms || parts == std::max<std::int64_t>(1, vocab / kGreedyMinValues));
    if (parts > 1) {
      EXPECT_GE(vocab / parts, kGreedyMinValues);
      EXPECT_LT(rows * (parts - 1), 2 * sms) << "no more parts than filling the GPU twice needs";
    }
  }
  EXPECT_EQ(greedy_parts(1, 248320, 132), 60);  // the Qwen vocabulary at batch 1 on an H200: 4,139 values a part
  EXPECT_EQ(greedy_parts(64, 248320, 132), 5);
  EXPECT_EQ(greedy_parts(256, 248320, 132), 2);
  EXPECT_EQ(greedy_parts(512, 248320, 132), 1);
  EXPECT_EQ(greedy_parts(1, 4000, 132), 1);
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

// Logits with many ties: small integers over a few values, scaled, so that top-k and top-p cuts fall inside runs
// of equal logits.
std::vector<double> tied_logits(std::mt19937_64& rng, int V, int distinct) {
  std::uniform_int_distribution<int> level(0, distinct - 1);
  std::vector<double> l(V);
  for (auto& x : l) x = 0.75 * level(rng);
  return l;
}

// The cases every distribution test runs: plain, temperatures, top-k (inside a tie, >= V), top-p (tiny, 1,
// inside a tie), both.
std::vector<SamplingParams> sampling_cases(int V) {
  return {{.temperature = 1.0},
          {.temperature = 0.6},
          {.temperature = 1.7, .top_k = 3},
          {.temperature = 1.0, .top_k = V},
          {.temperature = 1.0, .top_k = V + 5},
          {.temperature = 1.0, .top_k = 1},
          {.temperature = 1.0, .top_p = 0.5},
          {.temperature = 0.8, .top_p = 1e-9},
          {.temperature = 1.0, .top_p = 1.0, .top_k = 4},
          {.temperature = 1.3, .top_p = 0.7, .top_k = 6}};
}

std::string describe(const SamplingParams& p) {
  return "temperature " + std::to_string(p.temperature) + " top_p " + std::to_string(p.top_p) + " top_k " +
         std::to_string(p.top_k);
}

// A chi-square's bins: the cells in order of their expected counts, the smallest merged until each bin expects 5 or
// more (a last bin short of that joins the one before it), so that the statistic follows its distribution.
struct Bin {
  double expected = 0, observed = 0;
};
std::vector<Bin> chi_square_bins(std::vector<Bin> cells) {
  std::sort(cells.begin(), cells.end(), [](const Bin& a, const Bin& b) { return a.expected < b.expected; });
  std::vector<Bin> bins;
  Bin open;
  for (const Bin& c : cells) {
    open.expected += c.expected;
    open.observed += c.observed;
    if (open.expected >= 5) {
      bins.push_back(open);
      open = {};
    }
  }
  if (open.expected > 0) {
    if (bins.empty()) {
      bins.push_back(open);
    } else {
      bins.back().expected += open.expected;
      bins.back().observed += open.observed;
    }
  }
  return bins;
}

// The inverse CDF in id order: u maps to the first kept token whose cumulative probability (in id order) exceeds
// u. Checked on random and tied logits for draws not within 1e-9 of a boundary of the reference's cumulative sums.
TEST_F(SamplingTest, ADrawMapsToTheKeptTokenWhoseIdOrderCumulativeProbabilityFirstExceedsIt) {
  std::vector<std::int32_t> scratch;
  int checked = 0;
  for (const bool tied : {false, true}) {
    const int V = 29;
    for (const SamplingParams& p : sampling_cases(V)) {
      const std::vector<double> logits = tied ? tied_logits(rng_, V, 4) : random_logits(rng_, V);
      const std::vector<double> ref = transformed(logits, p);
      for (int i = 0; i < 500; ++i) {
        const double u = uniform(rng_(), 1, i);
        double cumulative = 0, nearest_boundary = 1;
        int expected = -1;
        for (int v = 0; v < V; ++v) {
          if (ref[v] == 0) continue;
          cumulative += ref[v];
          nearest_boundary = std::min(nearest_boundary, std::abs(cumulative - u));
          if (expected < 0 && u < cumulative) expected = v;
        }
        if (nearest_boundary < 1e-9 || expected < 0) continue;
        const Sample s = sample_token(logits, p, u, false, scratch);
        ASSERT_EQ(s.token, expected) << describe(p) << (tied ? " tied" : "") << " u " << u;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 9000);
}

// 20000 draws per case against the reference probabilities by a chi-square over the kept tokens: its mean is
// the degrees of freedom d and its standard deviation sqrt(2 d) when the draws follow the reference; the bound
// d + 7 sqrt(2 d) + 10 fails a wrong distribution (a token's probability off by a tenth moves the statistic by
// hundreds) and a correct one practically never. That holds where every bin expects about 5 draws or more: one
// draw of a token expected 0.05 times adds 18 by itself (seed 2188 failed so, at 87.5 against 65.6), so the
// rarest kept tokens share bins (chi_square_bins). Tokens outside the kept set must never be drawn.
TEST_F(SamplingTest, DrawsPassAChiSquareAgainstTheReferenceWithTies) {
  std::vector<std::int32_t> scratch;
  for (const bool tied : {false, true}) {
    const int V = 17;
    for (const SamplingParams& p : sampling_cases(V)) {
      const std::vector<double> logits = tied ? tied_logits(rng_, V, 3) : random_logits(rng_, V);
      const std::vector<double> ref = transformed(logits, p);
      std::vector<int> counts(V, 0);
      const int draws = 20000;
      const std::uint64_t seed = rng_();
      for (int i = 0; i < draws; ++i) {
        const Sample s = sample_token(logits, p, uniform(seed, 5, i), false, scratch);
        ASSERT_GT(ref[s.token], 0.0) << "drew a token outside the kept set: " << describe(p);
        ASSERT_NEAR(s.logprob, std::log(ref[s.token]), 1e-12) << describe(p);
        ++counts[s.token];
      }
      std::vector<Bin> kept;
      for (int v = 0; v < V; ++v) {
        if (ref[v] > 0) kept.push_back({draws * ref[v], static_cast<double>(counts[v])});
      }
      const std::vector<Bin> bins = chi_square_bins(kept);
      double chi2 = 0;
      for (const Bin& b : bins) chi2 += (b.observed - b.expected) * (b.observed - b.expected) / b.expected;
      const double d = static_cast<double>(bins.size()) - 1;
      EXPECT_LT(chi2, d + 7 * std::sqrt(2 * d) + 10) << describe(p) << (tied ? " tied" : "") << ": " << kept.size()
                                                     << " kept, " << bins.size() << " bins";
    }
  }
}

// Where the cuts fall inside runs of equal logits, the lower ids are kept: all-equal logits keep ids [0, k) under
// top_k = k and the first ceil(top_p V) ids under top_p; top_k = 1 keeps the first of the largest.
TEST(Sampling, CutsInsideTiesKeepTheLowerIds) {
  std::vector<std::int32_t> scratch;
  const std::vector<double> flat(10, 0.25);
  for (int i = 0; i < 200; ++i) {
    const double u = uniform(3, 4, i);
    EXPECT_LT(sample_token(flat, {.top_k = 3}, u, false, scratch).token, 3);
    EXPECT_EQ(sample_token(flat, {.top_k = 3}, u, false, scratch).token, static_cast<int>(u * 3));
    EXPECT_LT(sample_token(flat, {.top_p = 0.45}, u, false, scratch).token, 5);
    const Sample s = sample_token(flat, {.top_p = 0.5}, u, false, scratch);
    EXPECT_LT(s.token, 5);
    EXPECT_NEAR(s.logprob, std::log(0.2), 1e-15);
  }
  const std::vector<double> two_tops{1.0, 2.0, -1.0, 2.0};
  EXPECT_EQ(sample_token(two_tops, {.top_k = 1}, 0.99, false, scratch).token, 1);
  EXPECT_EQ(sample_token(two_tops, {.top_p = 0.1}, 0.99, false, scratch).token, 1);
}

// Every row of a float32 or float64 matrix, each with its own parameters, draw and untempered flag: the tokens and
// logprobs (bit for bit) of sample_token on the row widened to float64.
TEST_F(SamplingTest, BatchSamplerRowsAreSampleTokenOnEachRow) {
  BatchSampler sampler;
  std::vector<std::int32_t> scratch;
  for (const DType dtype : {DType::f32, DType::f64}) {
    for (const int V : {1, 7, 301}) {
      const int N = 23;
      const std::vector<SamplingParams> cases = sampling_cases(V);
      std::vector<double> values(N * V);
      std::vector<float> narrow(N * V);
      std::vector<RowSampling> rows(N);
      for (int n = 0; n < N; ++n) {
        const std::vector<double> row = n % 3 == 0 ? tied_logits(rng_, V, 5) : random_logits(rng_, V);
        for (int v = 0; v < V; ++v) {
          narrow[n * V + v] = static_cast<float>(row[v]);
          values[n * V + v] = dtype == DType::f32 ? double(narrow[n * V + v]) : row[v];
        }
        SamplingParams p = n % 5 == 4 ? SamplingParams{.temperature = 0} : cases[n % cases.size()];
        rows[n] = {p, uniform(rng_(), n, 0), n % 2 == 0};
      }
      void* data = dtype == DType::f32 ? static_cast<void*>(narrow.data()) : static_cast<void*>(values.data());
      const std::vector<Sample> out = sampler.sample(TensorView::contiguous(data, dtype, {N, V}), rows);
      ASSERT_EQ(out.size(), std::size_t(N));
      for (int n = 0; n < N; ++n) {
        const std::span<const double> row(values.data() + n * V, V);
        const Sample expected = sample_token(row, rows[n].params, rows[n].u, rows[n].want_untempered, scratch);
        EXPECT_EQ(out[n].token, expected.token) << "row " << n << " V " << V;
        EXPECT_EQ(out[n].logprob, expected.logprob) << "row " << n << " V " << V;
        EXPECT_EQ(out[n].untempered_logprob, expected.untempered_logprob) << "row " << n << " V " << V;
        if (rows[n].want_untempered) {
          EXPECT_EQ(out[n].untempered_logprob, log_softmax_at(row, out[n].token));
        }
      }
    }
  }
}

TEST(Sampling, BatchSamplerRefusesBadArgumentsByName) {
  BatchSampler sampler;
  std::vector<float> logits(2 * 3, 0.f);
  std::vector<std::uint16_t> bf16(2 * 3, 0);
  const TensorView view = TensorView::contiguous(logits.data(), DType::f32, {2, 3});
  std::vector<RowSampling> rows(2);
  const auto argument_of = [&](const TensorView& v, const std::vector<RowSampling>& r) {
    try {
      sampler.sample(v, r);
    } catch (const InvalidArgument& e) {
      return e.argument();
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(argument_of(view, rows), "(accepted)");
  EXPECT_EQ(argument_of(TensorView::contiguous(bf16.data(), DType::bf16, {2, 3}), rows), "logits");
  EXPECT_EQ(argument_of(TensorView::contiguous(logits.data(), DType::f32, {6}), rows), "logits");
  EXPECT_EQ(argument_of(TensorView::contiguous(logits.data(), DType::f32, {2, 0}), rows), "logits");
  EXPECT_EQ(argument_of(view, std::vector<RowSampling>(3)), "rows");
  std::vector<RowSampling> bad = rows;
  bad[1].u = 1.0;
  EXPECT_EQ(argument_of(view, bad), "rows[1].u");
  bad = rows;
  bad[0].params.top_p = 0;
  EXPECT_EQ(argument_of(view, bad), "rows[0].params.top_p");
}

}  // namespace
}  // namespace deltatrain::rollout
