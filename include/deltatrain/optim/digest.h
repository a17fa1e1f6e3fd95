// SHA-256 (OpenSSL's EVP interface) of bytes, of files, and of an optimizer's gathered state.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

#include "deltatrain/optim/adamw.h"

struct evp_md_ctx_st;  // OpenSSL's EVP_MD_CTX, kept out of this header

namespace deltatrain::optim {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void update(const void* data, std::size_t bytes);
  // Lower-case hex of the digest; the object is spent afterwards.
  std::string hex_digest();

 private:
  evp_md_ctx_st* context_;
};

// Reads the whole file. Failure naming the file when it cannot be read.
std::string sha256_file(const std::filesystem::path& path);

// Digests of the gathered state, independent of the dp size: `params` over the float32 main
// parameters, `state` over the step (int64, little-endian) followed by exp_avg and exp_avg_sq.
struct StateDigest {
  std::string params;
  std::string state;
};
StateDigest digest_state(const DistributedAdamW& optimizer);  // collective

}  // namespace deltatrain::optim
