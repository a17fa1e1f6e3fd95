// Helpers of the train tests: a seed printed for replay (DELTATRAIN_TEST_SEED), a temporary directory, and
// synthetic token data written in the shard format.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "deltatrain/train/data.h"

namespace deltatrain::train::testing {

inline std::uint64_t test_seed() {
  const char* fixed = std::getenv("DELTATRAIN_TEST_SEED");
  const std::uint64_t seed = fixed != nullptr ? std::strtoull(fixed, nullptr, 10)
                                              : (std::uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  std::fprintf(stderr, "random seed %llu: replay with DELTATRAIN_TEST_SEED=%llu\n",
               static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  return seed;
}

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "deltatrain-train-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// `documents` documents of 0..max_length tokens drawn from `vocab`.
inline TokenShard random_shard(std::mt19937_64& rng, std::int64_t vocab, int documents, int max_length) {
  TokenShard shard;
  shard.vocab_size = vocab;
  std::uniform_int_distribution<int> length(0, max_length);
  std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(vocab - 1));
  for (int d = 0; d < documents; ++d) {
    const int n = length(rng);
    for (int i = 0; i < n; ++i) shard.tokens.push_back(token(rng));
    shard.document_offsets.push_back(static_cast<std::int64_t>(shard.tokens.size()));
  }
  return shard;
}

}  // namespace deltatrain::train::testing
