#include "deltatrain/optim/digest.h"

#include <openssl/evp.h>

#include <cstdint>
#include <vector>

#include "deltatrain/core/error.h"
#include "chunked_read.h"
#include "file_io.h"

namespace deltatrain::optim {

namespace {

void openssl_check(int ok, const char* call) {
  if (ok != 1) throw Failure(std::string(call) + " failed (OpenSSL)");
}

}  // namespace

Sha256::Sha256() : context_(EVP_MD_CTX_new()) {
  if (context_ == nullptr) throw Failure("EVP_MD_CTX_new failed (OpenSSL)");
  openssl_check(EVP_DigestInit_ex(context_, EVP_sha256(), nullptr), "EVP_DigestInit_ex");
}

Sha256::~Sha256() { EVP_MD_CTX_free(context_); }

void Sha256::update(const void* data, std::size_t bytes) {
  openssl_check(EVP_DigestUpdate(context_, data, bytes), "EVP_DigestUpdate");
}

std::string Sha256::hex_digest() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  openssl_check(EVP_DigestFinal_ex(context_, digest, &length), "EVP_DigestFinal_ex");
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) {
    hex += kHex[digest[i] >> 4];
    hex += kHex[digest[i] & 15];
  }
  return hex;
}

std::string sha256_file(const std::filesystem::path& path) {
  const File file = File::open_read(path);
  Sha256 sha;
  read_chunked(file, {.ranges = {{0, file.size()}}, .sha = &sha});
  return sha.hex_digest();
}

StateDigest digest_state(const DistributedAdamW& optimizer) {
  const std::vector<float> params = optimizer.gather_state(StateTensor::main_param);
  const std::vector<float> exp_avg = optimizer.gather_state(StateTensor::exp_avg);
  const std::vector<float> exp_avg_sq = optimizer.gather_state(StateTensor::exp_avg_sq);
  Sha256 params_sha;
  params_sha.update(params.data(), params.size() * sizeof(float));
  Sha256 state_sha;
  const std::int64_t step = optimizer.step_count();
  state_sha.update(&step, sizeof step);
  state_sha.update(exp_avg.data(), exp_avg.size() * sizeof(float));
  state_sha.update(exp_avg_sq.data(), exp_avg_sq.size() * sizeof(float));
  return {params_sha.hex_digest(), state_sha.hex_digest()};
}

}  // namespace deltatrain::optim
