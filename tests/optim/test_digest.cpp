// PieceDigest, the checkpoint files' digest: the same value however the stream is cut into updates (the
// pieces hashed in parallel), equal to its definition composed from one SHA-256 per piece, and the plain
// SHA-256 of the stream with pieces of 0. (tests/optim/checkpoint_numpy_check.py checks a saved file's
// digest against Python's hashlib, an implementation of its own.)
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "deltatrain/optim/digest.h"

namespace deltatrain::optim {
namespace {

std::string sha256_of(const unsigned char* data, std::size_t bytes) {
  Sha256 sha;
  sha.update(data, bytes);
  return sha.hex_digest();
}

// The definition: SHA-256 over the pieces' SHA-256 digests, back to back.
std::string by_definition(const std::vector<unsigned char>& stream, std::size_t piece_bytes) {
  std::vector<unsigned char> digests;
  for (std::size_t at = 0; at < stream.size(); at += piece_bytes) {
    Sha256 piece;
    piece.update(stream.data() + at, std::min(piece_bytes, stream.size() - at));
    const std::array<unsigned char, 32> digest = piece.digest();
    digests.insert(digests.end(), digest.begin(), digest.end());
  }
  return sha256_of(digests.data(), digests.size());
}

// The stream fed in updates of random sizes (empty ones, ones inside a piece, ones spanning many).
std::string in_random_updates(const std::vector<unsigned char>& stream, std::uint64_t piece_bytes, std::mt19937_64& rng) {
  PieceDigest digest(piece_bytes);
  const std::uint64_t scale = piece_bytes == 0 ? 4096 : piece_bytes;
  for (std::size_t at = 0; at < stream.size();) {
    const std::size_t bytes = std::min<std::size_t>(stream.size() - at, rng() % (5 * scale + 2));
    digest.update(stream.data() + at, bytes);
    at += bytes;
  }
  return digest.hex_digest();
}

TEST(PieceDigest, EqualsItsDefinitionHoweverTheStreamIsCut) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const std::size_t piece_bytes : {1ul, 7ul, 64ul, 4096ul}) {
    for (const std::size_t pieces_and_a_bit : {0ul, 1ul, 3ul, 40ul}) {
      std::vector<unsigned char> stream(piece_bytes * pieces_and_a_bit + rng() % (piece_bytes + 1));
      for (unsigned char& byte : stream) byte = static_cast<unsigned char>(rng());
      SCOPED_TRACE("piece " + std::to_string(piece_bytes) + ", " + std::to_string(stream.size()) + " bytes");
      const std::string expected = by_definition(stream, piece_bytes);
      for (int cut = 0; cut < 4; ++cut) EXPECT_EQ(in_random_updates(stream, piece_bytes, rng), expected);
      PieceDigest at_once(piece_bytes);
      at_once.update(stream.data(), stream.size());
      EXPECT_EQ(at_once.hex_digest(), expected);
      if (stream.empty()) continue;
      stream[rng() % stream.size()] ^= static_cast<unsigned char>(1u << rng() % 8);
      EXPECT_NE(in_random_updates(stream, piece_bytes, rng), expected) << "a flipped bit went unnoticed";
    }
  }
}

TEST(PieceDigest, PiecesOfZeroAreThePlainSha256) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<unsigned char> stream(100000 + rng() % 1000);
  for (unsigned char& byte : stream) byte = static_cast<unsigned char>(rng());
  EXPECT_EQ(in_random_updates(stream, 0, rng), sha256_of(stream.data(), stream.size()));
  // A digest of another piece size is another value: the metadata must say which one it records.
  EXPECT_NE(in_random_updates(stream, 4096, rng), sha256_of(stream.data(), stream.size()));
}

}  // namespace
}  // namespace deltatrain::optim
