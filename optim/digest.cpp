#include "deltatrain/optim/digest.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstdint>
#include <future>
#include <thread>
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

std::array<unsigned char, 32> Sha256::digest() {
  std::array<unsigned char, 32> digest{};
  unsigned int length = 0;
  openssl_check(EVP_DigestFinal_ex(context_, digest.data(), &length), "EVP_DigestFinal_ex");
  return digest;
}

std::string Sha256::hex_digest() {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char byte : digest()) {
    hex += kHex[byte >> 4];
    hex += kHex[byte & 15];
  }
  return hex;
}

PieceDigest::PieceDigest(std::uint64_t piece_bytes) : piece_bytes_(piece_bytes) {
  if (piece_bytes_ == 0) open_piece_ = std::make_unique<Sha256>();
}

PieceDigest::~PieceDigest() = default;

void PieceDigest::update(const void* data, std::size_t bytes) {
  const auto* from = static_cast<const unsigned char*>(data);
  if (piece_bytes_ == 0) {
    open_piece_->update(from, bytes);
    return;
  }
  // The bytes split at piece boundaries: each part belongs to a piece of its own, so the parts hash in parallel.
  struct Part {
    const unsigned char* data;
    std::size_t bytes;
    std::unique_ptr<Sha256> sha;
  };
  std::vector<Part> parts;
  for (std::size_t done = 0; done < bytes;) {
    const std::uint64_t into_piece = (position_ + done) % piece_bytes_;
    const std::size_t part = std::min<std::uint64_t>(bytes - done, piece_bytes_ - into_piece);
    std::unique_ptr<Sha256> sha = into_piece != 0 ? std::move(open_piece_) : std::make_unique<Sha256>();
    parts.push_back({from + done, part, std::move(sha)});
    done += part;
  }
  const std::size_t workers =
      std::min<std::size_t>({parts.size(), std::max(1u, std::thread::hardware_concurrency()), 8});
  const auto hash_every = [&parts, workers](std::size_t first) {
    for (std::size_t p = first; p < parts.size(); p += workers) parts[p].sha->update(parts[p].data, parts[p].bytes);
  };
  {
    std::vector<std::future<void>> others;  // destroyed (so waited for) before `parts`, also on a throw
    for (std::size_t w = 1; w < workers; ++w) others.push_back(std::async(std::launch::async, hash_every, w));
    hash_every(0);
    for (std::future<void>& other : others) other.get();
  }
  position_ += bytes;
  for (std::size_t p = 0; p < parts.size(); ++p) {
    if (p + 1 == parts.size() && position_ % piece_bytes_ != 0) {
      open_piece_ = std::move(parts[p].sha);  // a piece the next update continues
    } else {
      const std::array<unsigned char, 32> digest = parts[p].sha->digest();
      piece_digests_.insert(piece_digests_.end(), digest.begin(), digest.end());
    }
  }
}

std::string PieceDigest::hex_digest() {
  if (piece_bytes_ == 0) return open_piece_->hex_digest();
  if (open_piece_) {
    const std::array<unsigned char, 32> digest = open_piece_->digest();
    piece_digests_.insert(piece_digests_.end(), digest.begin(), digest.end());
  }
  Sha256 of_pieces;
  of_pieces.update(piece_digests_.data(), piece_digests_.size());
  return of_pieces.hex_digest();
}

std::string file_digest(const std::filesystem::path& path, std::uint64_t piece_bytes) {
  const File file = File::open_read(path);
  PieceDigest digest(piece_bytes);
  read_chunked(file, {.ranges = {{0, file.size()}}, .digest = &digest});
  return digest.hex_digest();
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
