#include "deltatrain/train/data.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "deltatrain/core/error.h"
#include "deltatrain/optim/digest.h"
#include "optim/file_io.h"

namespace deltatrain::train {

namespace fs = std::filesystem;

namespace {

static_assert(std::endian::native == std::endian::little, "shards are little-endian and read in place");

constexpr char kShardMagic[8] = {'D', 'T', 'S', 'H', 'A', 'R', 'D', '\0'};
constexpr char kVocabMagic[8] = {'D', 'T', 'V', 'O', 'C', 'A', 'B', '\0'};
constexpr std::uint64_t kShardHeaderBytes = 40;

struct ShardHeader {
  char magic[8];
  std::uint32_t version;
  std::uint32_t reserved;
  std::uint64_t vocab_size;
  std::uint64_t tokens;
  std::uint64_t documents;
};
static_assert(sizeof(ShardHeader) == kShardHeaderBytes);

[[noreturn]] void bad_shard(const fs::path& path, const std::string& what) {
  throw Failure("token shard " + path.string() + " is not valid: " + what);
}

template <class T>
void append(std::string& out, const T& value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}

}  // namespace

void write_shard(const fs::path& path, const TokenShard& shard) {
  const auto& offsets = shard.document_offsets;
  if (offsets.empty() || offsets.front() != 0 || offsets.back() != static_cast<std::int64_t>(shard.tokens.size()) ||
      !std::is_sorted(offsets.begin(), offsets.end())) {
    throw InvalidArgument("shard", "document offsets must run from 0 to the token count without decreasing");
  }
  for (std::int32_t token : shard.tokens) {
    if (token < 0 || token >= shard.vocab_size) {
      throw InvalidArgument("shard", "token id " + std::to_string(token) + " is outside [0, " +
                                         std::to_string(shard.vocab_size) + ")");
    }
  }
  ShardHeader header{};
  std::memcpy(header.magic, kShardMagic, sizeof kShardMagic);
  header.version = kShardVersion;
  header.vocab_size = static_cast<std::uint64_t>(shard.vocab_size);
  header.tokens = shard.tokens.size();
  header.documents = static_cast<std::uint64_t>(shard.documents());
  std::string bytes;
  bytes.reserve(kShardHeaderBytes + offsets.size() * 8 + shard.tokens.size() * 4);
  append(bytes, header);
  for (std::int64_t offset : offsets) append(bytes, static_cast<std::uint64_t>(offset));
  for (std::int32_t token : shard.tokens) append(bytes, static_cast<std::uint32_t>(token));
  optim::replace_file_atomically(path, bytes);
}

TokenShard read_shard(const fs::path& path, std::int64_t vocab_size) {
  const optim::File file = optim::File::open_read(path);
  const std::uint64_t size = file.size();
  if (size < kShardHeaderBytes) bad_shard(path, "truncated: " + std::to_string(size) + " bytes, shorter than the header");
  ShardHeader header;
  file.read_exact(&header, sizeof header, 0);
  if (std::memcmp(header.magic, kShardMagic, sizeof kShardMagic) != 0) bad_shard(path, "wrong magic (not a token shard)");
  if (header.version != kShardVersion) {
    bad_shard(path, "format version " + std::to_string(header.version) + ", this build reads version " +
                        std::to_string(kShardVersion));
  }
  // Bounds before arithmetic, so a damaged count cannot overflow the expected size.
  if (header.tokens > (std::uint64_t{1} << 40) || header.documents > (std::uint64_t{1} << 40)) {
    bad_shard(path, "implausible counts in the header (" + std::to_string(header.tokens) + " tokens, " +
                        std::to_string(header.documents) + " documents)");
  }
  const std::uint64_t expected = kShardHeaderBytes + (header.documents + 1) * 8 + header.tokens * 4;
  if (size != expected) {
    bad_shard(path, std::string(size < expected ? "truncated" : "longer than its header says") + ": " +
                        std::to_string(size) + " bytes, the header's " + std::to_string(header.tokens) +
                        " tokens and " + std::to_string(header.documents) + " documents need " +
                        std::to_string(expected));
  }
  if (header.vocab_size > static_cast<std::uint64_t>(vocab_size)) {
    throw InvalidArgument("data", "token shard " + path.string() + " was written for a vocabulary of " +
                                      std::to_string(header.vocab_size) + " tokens, more than the model's " +
                                      std::to_string(vocab_size));
  }
  TokenShard shard;
  shard.vocab_size = static_cast<std::int64_t>(header.vocab_size);
  std::vector<std::uint64_t> offsets(header.documents + 1);
  file.read_exact(offsets.data(), offsets.size() * 8, kShardHeaderBytes);
  if (offsets.front() != 0 || offsets.back() != header.tokens || !std::is_sorted(offsets.begin(), offsets.end())) {
    bad_shard(path, "document offsets do not run from 0 to the token count " + std::to_string(header.tokens));
  }
  shard.document_offsets.assign(offsets.begin(), offsets.end());
  std::vector<std::uint32_t> tokens(header.tokens);
  file.read_exact(tokens.data(), tokens.size() * 4, kShardHeaderBytes + offsets.size() * 8);
  shard.tokens.resize(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= header.vocab_size) {
      throw InvalidArgument("data", "token shard " + path.string() + " holds token id " + std::to_string(tokens[i]) +
                                        " at position " + std::to_string(i) + ", outside the vocabulary of " +
                                        std::to_string(header.vocab_size));
    }
    shard.tokens[i] = static_cast<std::int32_t>(tokens[i]);
  }
  return shard;
}

std::string Vocabulary::decode(std::span<const std::int32_t> tokens) const {
  std::string text;
  for (std::int32_t token : tokens) {
    text += token >= 0 && static_cast<std::size_t>(token) < pieces.size() ? pieces[token] : std::string("<?>");
  }
  return text;
}

void write_vocabulary(const fs::path& path, const Vocabulary& vocabulary) {
  std::string bytes(kVocabMagic, sizeof kVocabMagic);
  append(bytes, kVocabVersion);
  append(bytes, static_cast<std::uint32_t>(vocabulary.pieces.size()));
  for (const std::string& piece : vocabulary.pieces) {
    append(bytes, static_cast<std::uint32_t>(piece.size()));
    bytes += piece;
  }
  optim::replace_file_atomically(path, bytes);
}

Vocabulary read_vocabulary(const fs::path& path) {
  const std::string bytes = optim::read_text_file(path);
  auto bad = [&](const std::string& what) -> void { throw Failure("vocabulary " + path.string() + " is not valid: " + what); };
  std::size_t at = 0;
  auto take = [&](void* out, std::size_t n) {
    if (bytes.size() - at < n) bad("truncated at byte " + std::to_string(at));
    std::memcpy(out, bytes.data() + at, n);
    at += n;
  };
  char magic[8];
  std::uint32_t version = 0, count = 0;
  take(magic, sizeof magic);
  if (std::memcmp(magic, kVocabMagic, sizeof magic) != 0) bad("wrong magic (not a vocabulary file)");
  take(&version, sizeof version);
  if (version != kVocabVersion) bad("format version " + std::to_string(version));
  take(&count, sizeof count);
  Vocabulary vocabulary;
  vocabulary.pieces.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    std::uint32_t length = 0;
    take(&length, sizeof length);
    std::string piece(length, '\0');
    take(piece.data(), length);
    vocabulary.pieces.push_back(std::move(piece));
  }
  if (at != bytes.size()) bad("trailing bytes after " + std::to_string(count) + " entries");
  return vocabulary;
}

Dataset::Dataset(const fs::path& dir, std::int64_t vocab_size) {
  if (!fs::is_directory(dir)) throw Failure("data directory " + dir.string() + " does not exist");
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("train-") && name.ends_with(".bin")) train_files_.push_back(entry.path());
  }
  std::sort(train_files_.begin(), train_files_.end());
  validation_file_ = dir / "val.bin";
  if (train_files_.empty()) throw Failure("data directory " + dir.string() + " has no training shard (train-*.bin)");
  if (!fs::exists(validation_file_)) throw Failure("data directory " + dir.string() + " has no validation shard (val.bin)");

  optim::Sha256 digest;
  for (std::size_t s = 0; s < train_files_.size(); ++s) {
    train_.push_back(read_shard(train_files_[s], vocab_size));
    const TokenShard& shard = train_.back();
    for (std::int64_t d = 0; d < shard.documents(); ++d) {
      train_documents_.push_back({static_cast<int>(s), shard.document_offsets[d],
                                  shard.document_offsets[d + 1] - shard.document_offsets[d]});
    }
    digest.update(shard.document_offsets.data(), shard.document_offsets.size() * sizeof(std::int64_t));
    digest.update(shard.tokens.data(), shard.tokens.size() * sizeof(std::int32_t));
  }
  fingerprint_ = digest.hex_digest();
  validation_ = read_shard(validation_file_, vocab_size);
  for (std::int64_t d = 0; d < validation_.documents(); ++d) {
    validation_documents_.push_back(
        {0, validation_.document_offsets[d], validation_.document_offsets[d + 1] - validation_.document_offsets[d]});
  }
  if (validation_.tokens.empty()) throw Failure("validation shard " + validation_file_.string() + " holds no tokens");
  if (fs::exists(dir / "vocab.bin")) vocabulary_ = read_vocabulary(dir / "vocab.bin");
}

std::vector<std::int64_t> Dataset::train_lengths() const {
  std::vector<std::int64_t> lengths;
  for (const Document& d : train_documents_) lengths.push_back(d.length);
  return lengths;
}

std::vector<std::int64_t> Dataset::validation_lengths() const {
  std::vector<std::int64_t> lengths;
  for (const Document& d : validation_documents_) lengths.push_back(d.length);
  return lengths;
}

std::span<const std::int32_t> Dataset::train_tokens(const Document& document) const {
  return std::span<const std::int32_t>(train_[document.shard].tokens).subspan(document.begin, document.length);
}

std::span<const std::int32_t> Dataset::validation_tokens(const Document& document) const {
  return std::span<const std::int32_t>(validation_.tokens).subspan(document.begin, document.length);
}

std::int64_t Dataset::train_token_count() const {
  std::int64_t total = 0;
  for (const TokenShard& shard : train_) total += static_cast<std::int64_t>(shard.tokens.size());
  return total;
}

}  // namespace deltatrain::train
