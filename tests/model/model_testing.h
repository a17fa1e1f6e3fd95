// Helpers of the model's tests (and the rollout's): a seed per test, printed on failure and replayable with
// DELTATRAIN_TEST_SEED, a fresh temporary directory, random valid configs and a small hybrid config.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "deltatrain/model/config.h"

namespace deltatrain::model::testing {

// Columns [first, first + count) of row-major [rows, cols] values.
template <class Values>
Values columns_of(const Values& v, std::int64_t cols, std::int64_t first, std::int64_t count) {
  Values out;
  for (std::int64_t r = 0; r < std::ssize(v) / cols; ++r)
    out.insert(out.end(), v.begin() + r * cols + first, v.begin() + r * cols + first + count);
  return out;
}

class SeededTest : public ::testing::Test {
 protected:
  SeededTest() {
    const char* fixed = std::getenv("DELTATRAIN_TEST_SEED");
    seed_ = fixed ? std::strtoull(fixed, nullptr, 10) : std::random_device{}();
    rng_.seed(seed_);
  }
  void TearDown() override {
    if (HasFailure()) {
      std::fprintf(stderr, "random seed %llu: replay with DELTATRAIN_TEST_SEED=%llu\n",
                   static_cast<unsigned long long>(seed_), static_cast<unsigned long long>(seed_));
    }
  }
  std::uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

// A directory of its own under the system's temporary directory, removed with its contents.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "deltatrain-model-io-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code error;
    std::filesystem::remove_all(path_, error);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A small hybrid: GDN and attention layers alternate, GVA and GQA both grouped, partial rotary, dv != dk.
inline Config small_hybrid_config(bool tied) {
  Config c;
  c.vocab_size = 23;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.layer_types = interval_layer_types(4, 2);
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 10000;
  c.partial_rotary_factor = 0.5;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 4;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 6;
  c.linear_conv_kernel_dim = 4;
  c.tie_word_embeddings = tied;
  return c;
}

// n token ids drawn uniformly from [0, vocab).
inline std::vector<std::int32_t> random_tokens(std::mt19937_64& rng, std::int64_t n, std::int64_t vocab) {
  std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(vocab - 1));
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
  for (auto& t : tokens) t = token(rng);
  return tokens;
}

// A random valid config with small shapes: every layer pattern, head ratio, tie and float field varies.
inline Config random_config(std::mt19937_64& rng) {
  auto pick = [&](std::int64_t low, std::int64_t high) {
    return std::uniform_int_distribution<std::int64_t>(low, high)(rng);
  };
  auto real = [&](double low, double high) { return std::uniform_real_distribution<double>(low, high)(rng); };
  Config c;
  c.vocab_size = pick(1, 300);
  c.hidden_size = pick(1, 48);
  c.intermediate_size = pick(1, 96);
  c.layer_types.resize(static_cast<std::size_t>(pick(1, 6)));
  for (LayerKind& kind : c.layer_types) kind = pick(0, 1) ? LayerKind::full_attention : LayerKind::linear_attention;
  c.num_key_value_heads = static_cast<int>(pick(1, 3));
  c.num_attention_heads = c.num_key_value_heads * static_cast<int>(pick(1, 3));
  c.head_dim = 8 * static_cast<int>(pick(1, 4));
  const double factors[] = {0.25, 0.5, 0.75, 1.0};
  c.partial_rotary_factor = factors[pick(0, 3)];
  c.rope_theta = real(100, 1e7);
  c.linear_num_key_heads = static_cast<int>(pick(1, 3));
  c.linear_num_value_heads = c.linear_num_key_heads * static_cast<int>(pick(1, 3));
  c.linear_key_head_dim = static_cast<int>(pick(1, 24));
  c.linear_value_head_dim = static_cast<int>(pick(1, 24));
  c.linear_conv_kernel_dim = static_cast<int>(pick(1, 5));
  c.rms_norm_eps = real(1e-8, 1e-3);
  c.tie_word_embeddings = pick(0, 1) == 1;
  c.initializer_range = real(0.001, 0.1);
  return c;
}

// How far two float64 log-probabilities over V logits may differ when their normalising sums add the same V positive
// terms in different orders (a GPU's tree, a CPU's loop): a sum of V positive terms in any order is within
// (V - 1) u of the exact one, relatively (u = 2^-53), so its log within (V - 1) u absolutely; the rest of the formula
// rounds at the log-probability's own magnitude. Twice that, as the two sides' errors add. (A flat 1e-12 failed on
// one row in 25 runs of the GPU sampler's test at V = 248,320: 1.1e-12 apart at -27.7.)
inline double log_softmax_tolerance(std::int64_t V, double logprob) {
  const double u = std::numeric_limits<double>::epsilon() / 2;
  return 2 * u * (static_cast<double>(V) + 4 * std::abs(logprob));
}

}  // namespace deltatrain::model::testing
