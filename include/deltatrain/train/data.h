// Token data on disk: binary shards of tokenized documents, and the vocabulary that decodes them.
//
// A data directory (python/deltatrain/prepare_text.py writes one; tests write their own):
//   train-00000.bin, train-00001.bin, ...   training shards, read in name order
//   val.bin                                  the held-out validation shard
//   vocab.bin                                id -> raw bytes, for printing samples (optional for training)
//
// Shard format, little-endian:
//   char[8]  magic "DTSHARD\0"
//   u32      format version (kShardVersion)
//   u32      reserved, 0
//   u64      vocab_size of the tokenizer that wrote it
//   u64      token count T
//   u64      document count D
//   u64[D+1] document offsets into the tokens: 0, ..., T, non-decreasing
//   u32[T]   token ids
// Documents are stored apart (the offsets table), so a reader never runs one into the next. The file size
// must be exactly what the header implies.
//
// Vocabulary format, little-endian: char[8] "DTVOCAB\0", u32 version (kVocabVersion), u32 count N, then N
// entries of (u32 byte length, bytes).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace deltatrain::train {

inline constexpr std::uint32_t kShardVersion = 1;
inline constexpr std::uint32_t kVocabVersion = 1;

struct TokenShard {
  std::int64_t vocab_size = 0;
  std::vector<std::int32_t> tokens;
  std::vector<std::int64_t> document_offsets{0};  // documents() + 1 entries
  std::int64_t documents() const { return static_cast<std::int64_t>(document_offsets.size()) - 1; }
};

// Writes `path` atomically (a temporary file beside it, fsynced, renamed). InvalidArgument naming `shard`
// when its offsets or token ids are inconsistent; Failure naming the file when it cannot be written.
void write_shard(const std::filesystem::path& path, const TokenShard& shard);

// Reads and checks a whole shard. Failure naming the file for a wrong magic or version, a truncated or
// over-long file, offsets that disagree with the token count; InvalidArgument ("data", naming the file)
// for a token id >= `vocab_size` or a shard written for a larger vocabulary than `vocab_size`.
TokenShard read_shard(const std::filesystem::path& path, std::int64_t vocab_size);

struct Vocabulary {
  std::vector<std::string> pieces;  // id -> raw bytes
  // Concatenated bytes; ids outside the vocabulary decode to "<?>" so a sample always prints.
  std::string decode(std::span<const std::int32_t> tokens) const;
};
void write_vocabulary(const std::filesystem::path& path, const Vocabulary& vocabulary);
Vocabulary read_vocabulary(const std::filesystem::path& path);  // Failure naming the file when damaged

// The shards of a data directory, loaded and checked, with a global document table over the training shards.
struct Document {
  int shard = 0;
  std::int64_t begin = 0;  // first token in the shard
  std::int64_t length = 0;
};

class Dataset {
 public:
  // Failure naming the directory when it has no train-*.bin or no val.bin, or naming val.bin when it holds no
  // tokens; shard errors as read_shard.
  Dataset(const std::filesystem::path& dir, std::int64_t vocab_size);

  const std::vector<std::filesystem::path>& train_files() const { return train_files_; }
  const std::filesystem::path& validation_file() const { return validation_file_; }
  // Training documents in shard order, then validation documents (a separate table).
  const std::vector<Document>& train_documents() const { return train_documents_; }
  const std::vector<Document>& validation_documents() const { return validation_documents_; }
  std::vector<std::int64_t> train_lengths() const;
  std::vector<std::int64_t> validation_lengths() const;
  std::span<const std::int32_t> train_tokens(const Document& document) const;
  std::span<const std::int32_t> validation_tokens(const Document& document) const;
  std::int64_t train_token_count() const;
  // SHA-256 over every training shard's offsets and tokens: a resumed run checks it reads the same data.
  const std::string& fingerprint() const { return fingerprint_; }
  // The vocabulary if the directory has vocab.bin; empty otherwise.
  const Vocabulary& vocabulary() const { return vocabulary_; }

 private:
  std::vector<std::filesystem::path> train_files_;
  std::filesystem::path validation_file_;
  std::vector<TokenShard> train_;
  TokenShard validation_;
  std::vector<Document> train_documents_, validation_documents_;
  std::string fingerprint_;
  Vocabulary vocabulary_;
};

}  // namespace deltatrain::train
