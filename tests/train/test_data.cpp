// Token shards and the vocabulary file: round trips on random data, and every damaged file refused with an
// error that names it.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>
#include <string>

#include "deltatrain/core/error.h"
#include "deltatrain/train/data.h"
#include "train_testing.h"

namespace deltatrain::train {
namespace {

namespace fs = std::filesystem;

std::string bytes_of(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void put_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// The message of the error read_shard raises, which must name the file.
template <class ErrorType>
std::string refusal(const fs::path& path, std::int64_t vocab) {
  try {
    read_shard(path, vocab);
  } catch (const ErrorType& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
    return e.what();
  }
  ADD_FAILURE() << path << " was accepted";
  return {};
}

TEST(Shard, RoundTripsRandomDocuments) {
  std::mt19937_64 rng(testing::test_seed());
  testing::TempDir dir;
  for (int trial = 0; trial < 10; ++trial) {
    const TokenShard shard = testing::random_shard(rng, 1 + rng() % 70000, 1 + rng() % 20, 300);
    const fs::path path = dir.path() / ("s" + std::to_string(trial) + ".bin");
    write_shard(path, shard);
    const TokenShard back = read_shard(path, shard.vocab_size);
    EXPECT_EQ(back.vocab_size, shard.vocab_size);
    EXPECT_EQ(back.tokens, shard.tokens);
    EXPECT_EQ(back.document_offsets, shard.document_offsets);
    EXPECT_EQ(fs::file_size(path), 40 + 8 * shard.document_offsets.size() + 4 * shard.tokens.size());
  }
}

TEST(Shard, RefusesDamagedFilesNamingThem) {
  std::mt19937_64 rng(testing::test_seed());
  testing::TempDir dir;
  TokenShard shard = testing::random_shard(rng, 500, 5, 50);
  shard.tokens.push_back(7);
  shard.document_offsets.back() += 1;
  const fs::path good = dir.path() / "good.bin";
  write_shard(good, shard);
  const std::string bytes = bytes_of(good);

  const fs::path magic = dir.path() / "magic.bin";
  put_bytes(magic, "XX" + bytes.substr(2));
  EXPECT_NE(refusal<Failure>(magic, 500).find("magic"), std::string::npos);

  const fs::path version = dir.path() / "version.bin";
  std::string v = bytes;
  v[8] = 9;
  put_bytes(version, v);
  EXPECT_NE(refusal<Failure>(version, 500).find("version"), std::string::npos);

  const fs::path truncated = dir.path() / "truncated.bin";
  put_bytes(truncated, bytes.substr(0, bytes.size() - 3));
  EXPECT_NE(refusal<Failure>(truncated, 500).find("truncated"), std::string::npos);

  const fs::path header_only = dir.path() / "header_only.bin";
  put_bytes(header_only, bytes.substr(0, 20));
  EXPECT_NE(refusal<Failure>(header_only, 500).find("truncated"), std::string::npos);

  const fs::path count = dir.path() / "count.bin";  // the header claims one token fewer than the file holds
  std::string c = bytes;
  std::uint64_t tokens;
  std::memcpy(&tokens, c.data() + 24, 8);
  tokens -= 1;
  std::memcpy(c.data() + 24, &tokens, 8);
  put_bytes(count, c);
  EXPECT_NE(refusal<Failure>(count, 500).find("longer than its header"), std::string::npos);

  const fs::path offsets = dir.path() / "offsets.bin";  // the last offset disagrees with the token count
  std::string o = bytes;
  std::uint64_t last;
  const std::size_t at = 40 + 8 * (shard.document_offsets.size() - 1);
  std::memcpy(&last, o.data() + at, 8);
  last -= 1;
  std::memcpy(o.data() + at, &last, 8);
  put_bytes(offsets, o);
  EXPECT_NE(refusal<Failure>(offsets, 500).find("offsets"), std::string::npos);

  const fs::path large_id = dir.path() / "large_id.bin";  // a token id beyond the shard's own vocabulary
  std::string t = bytes;
  const std::uint32_t id = 500;
  std::memcpy(t.data() + t.size() - 4, &id, 4);
  put_bytes(large_id, t);
  EXPECT_NE(refusal<InvalidArgument>(large_id, 500).find("500"), std::string::npos);

  // A shard of a larger vocabulary than the model's.
  EXPECT_NE(refusal<InvalidArgument>(good, 300).find("vocabulary"), std::string::npos);
  EXPECT_NO_THROW(read_shard(good, 500));
}

TEST(Vocabulary, RoundTripsAndDecodesBytes) {
  std::mt19937_64 rng(testing::test_seed());
  testing::TempDir dir;
  Vocabulary vocabulary;
  for (int i = 0; i < 300; ++i) {
    std::string piece(rng() % 6, '\0');
    for (char& ch : piece) ch = static_cast<char>(rng() % 256);
    vocabulary.pieces.push_back(piece);
  }
  write_vocabulary(dir.path() / "vocab.bin", vocabulary);
  const Vocabulary back = read_vocabulary(dir.path() / "vocab.bin");
  EXPECT_EQ(back.pieces, vocabulary.pieces);
  const std::vector<std::int32_t> ids{5, 17, 299, 0};
  EXPECT_EQ(back.decode(ids), vocabulary.pieces[5] + vocabulary.pieces[17] + vocabulary.pieces[299] + vocabulary.pieces[0]);
  const std::vector<std::int32_t> outside{300};
  EXPECT_EQ(back.decode(outside), "<?>");
  const std::string bytes = bytes_of(dir.path() / "vocab.bin");
  put_bytes(dir.path() / "short.bin", bytes.substr(0, bytes.size() - 1));
  try {
    read_vocabulary(dir.path() / "short.bin");
    ADD_FAILURE() << "a truncated vocabulary was accepted";
  } catch (const Failure& e) {
    EXPECT_NE(std::string(e.what()).find("short.bin"), std::string::npos) << e.what();
  }
}

TEST(Dataset, ReadsShardsInNameOrderWithADocumentTable) {
  std::mt19937_64 rng(testing::test_seed());
  testing::TempDir dir;
  const TokenShard a = testing::random_shard(rng, 100, 4, 30), b = testing::random_shard(rng, 100, 3, 30);
  const TokenShard val = testing::random_shard(rng, 100, 2, 30);
  write_shard(dir.path() / "train-00001.bin", b);
  write_shard(dir.path() / "train-00000.bin", a);
  EXPECT_THROW(Dataset(dir.path(), 100), Failure);  // no val.bin yet
  write_shard(dir.path() / "val.bin", val);
  const Dataset data(dir.path(), 100);
  ASSERT_EQ(data.train_documents().size(), 7u);
  EXPECT_EQ(data.train_token_count(), static_cast<std::int64_t>(a.tokens.size() + b.tokens.size()));
  std::vector<std::int32_t> all;
  for (const Document& d : data.train_documents()) {
    const auto tokens = data.train_tokens(d);
    all.insert(all.end(), tokens.begin(), tokens.end());
  }
  std::vector<std::int32_t> expected = a.tokens;
  expected.insert(expected.end(), b.tokens.begin(), b.tokens.end());
  EXPECT_EQ(all, expected);
  EXPECT_EQ(data.validation_documents().size(), 2u);

  // The fingerprint follows the training tokens.
  TokenShard changed = b;
  if (changed.tokens.empty()) changed.tokens.push_back(1), changed.document_offsets.back() = 1;
  changed.tokens[0] = (changed.tokens[0] + 1) % 100;
  write_shard(dir.path() / "train-00001.bin", changed);
  EXPECT_NE(Dataset(dir.path(), 100).fingerprint(), data.fingerprint());
}

}  // namespace
}  // namespace deltatrain::train
