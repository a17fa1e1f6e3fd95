// SHA-256 (OpenSSL's EVP interface) of bytes, of files, and of an optimizer's gathered state.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

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
  // The digest; the object is spent afterwards.
  std::array<unsigned char, 32> digest();
  // Lower-case hex of digest().
  std::string hex_digest();

 private:
  evp_md_ctx_st* context_;
};

// The checkpoint files' digest: the SHA-256 of the concatenated SHA-256 digests of the stream's consecutive
// pieces of `piece_bytes` (the last one shorter), whose pieces are hashed on several threads at once. One
// SHA-256 stream runs at ~1.1 GB/s on a core of the H200 machine, below its disk's read rate, so a plain file
// hash would bound every checkpoint load. piece_bytes 0: the plain SHA-256 of the stream (checkpoint formats 1
// and 2).
inline constexpr std::uint64_t kDigestPieceBytes = std::uint64_t{4} << 20;

class PieceDigest {
 public:
  explicit PieceDigest(std::uint64_t piece_bytes);
  ~PieceDigest();
  PieceDigest(const PieceDigest&) = delete;
  PieceDigest& operator=(const PieceDigest&) = delete;

  // The stream's next bytes, in order; returns once they are hashed.
  void update(const void* data, std::size_t bytes);
  // Lower-case hex; the object is spent afterwards.
  std::string hex_digest();

 private:
  std::uint64_t piece_bytes_;
  std::uint64_t position_ = 0;
  std::unique_ptr<Sha256> open_piece_;  // the piece position_ is inside of, or (piece_bytes 0) the whole stream
  std::vector<unsigned char> piece_digests_;
};

// PieceDigest(piece_bytes) of the whole file. Failure naming the file when it cannot be read.
std::string file_digest(const std::filesystem::path& path, std::uint64_t piece_bytes);

// Digests of the gathered state, independent of the dp size: `params` over the float32 main
// parameters, `state` over the step (int64, little-endian) followed by exp_avg and exp_avg_sq.
struct StateDigest {
  std::string params;
  std::string state;
};
StateDigest digest_state(const DistributedAdamW& optimizer);  // collective

}  // namespace deltatrain::optim
