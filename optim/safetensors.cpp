#include "deltatrain/optim/safetensors.h"

#include <algorithm>
#include <array>
#include <bit>
#include <future>
#include <optional>
#include <nlohmann/json.hpp>

#include "deltatrain/core/error.h"
#include "deltatrain/optim/digest.h"
#include "file_io.h"
#include "memory.h"

namespace deltatrain::optim {

static_assert(std::endian::native == std::endian::little, "safetensors files are little-endian; so is this host");

namespace {

// safetensors rejects larger headers; so does this reader, before allocating for one.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {{DType::f16, "F16"}, {DType::bf16, "BF16"}, {DType::f32, "F32"},
                                     {DType::f64, "F64"}, {DType::i32, "I32"},   {DType::i64, "I64"},
                                     {DType::u8, "U8"}};

std::uint64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::uint64_t numel = 1;
  for (std::int64_t dim : shape) numel *= static_cast<std::uint64_t>(dim);
  return numel;
}

[[noreturn]] void bad_header(const std::filesystem::path& path, const std::string& what) {
  throw Failure("file " + path.string() + " has a bad safetensors header: " + what);
}

}  // namespace

const char* safetensors_dtype(DType dtype) {
  for (const DTypeName& entry : kDTypeNames) {
    if (entry.dtype == dtype) return entry.name;
  }
  throw InvalidArgument("dtype", "has no safetensors name");
}

DType dtype_from_safetensors(const std::string& name) {
  for (const DTypeName& entry : kDTypeNames) {
    if (name == entry.name) return entry.dtype;
  }
  throw InvalidArgument("dtype", "must be one of F16, BF16, F32, F64, I32, I64, U8; got '" + name + "'");
}

const SafetensorsEntry* SafetensorsHeader::find(const std::string& name) const {
  for (const SafetensorsEntry& entry : tensors) {
    if (entry.name == name) return &entry;
  }
  return nullptr;
}

SafetensorsHeader read_safetensors_header(const std::filesystem::path& path) {
  const File file = File::open_read(path);
  const std::uint64_t file_size = file.size();
  std::uint64_t header_length = 0;
  file.read_exact(&header_length, sizeof header_length, 0);
  if (header_length > kMaxHeaderBytes) {
    bad_header(path, "its length field says " + std::to_string(header_length) + " bytes");
  }
  std::string text(header_length, '\0');
  file.read_exact(text.data(), text.size(), sizeof header_length);

  SafetensorsHeader header;
  header.data_start = sizeof header_length + header_length;
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    bad_header(path, std::string("not JSON (") + e.what() + ")");
  }
  if (!json.is_object()) bad_header(path, "not a JSON object");
  for (const auto& [name, value] : json.items()) {
    try {
      if (name == "__metadata__") {
        for (const auto& [key, item] : value.items()) header.metadata[key] = item.get<std::string>();
        continue;
      }
      SafetensorsEntry entry;
      entry.name = name;
      entry.dtype = dtype_from_safetensors(value.at("dtype").get<std::string>());
      entry.shape = value.at("shape").get<std::vector<std::int64_t>>();
      const auto offsets = value.at("data_offsets").get<std::vector<std::uint64_t>>();
      if (offsets.size() != 2 || offsets[1] < offsets[0]) bad_header(path, "tensor '" + name + "' has bad data_offsets");
      entry.begin = offsets[0];
      entry.end = offsets[1];
      for (std::int64_t dim : entry.shape) {
        if (dim < 0) bad_header(path, "tensor '" + name + "' has a negative dimension");
      }
      if (entry.end - entry.begin != numel_of(entry.shape) * dtype_size(entry.dtype)) {
        bad_header(path, "tensor '" + name + "' spans " + std::to_string(entry.end - entry.begin) +
                             " bytes, which does not match its dtype and shape");
      }
      if (header.data_start + entry.end > file_size) {
        throw Failure("file " + path.string() + " is truncated: tensor '" + name + "' ends at byte " +
                      std::to_string(header.data_start + entry.end) + " but the file has " +
                      std::to_string(file_size) + " bytes");
      }
      header.tensors.push_back(std::move(entry));
    } catch (const nlohmann::json::exception& e) {
      bad_header(path, "entry '" + name + "': " + e.what());
    } catch (const InvalidArgument& e) {
      bad_header(path, "entry '" + name + "': " + e.what());
    }
  }
  return header;
}

std::string write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata,
                              const SafetensorsWriteOptions& options) {
  if (options.chunk_bytes == 0) throw InvalidArgument("chunk_bytes", "must be positive");
  nlohmann::ordered_json json;
  if (!metadata.empty()) json["__metadata__"] = metadata;
  // Tensors are written in chunks, so that fetching, hashing and writing interleave over bounded memory.
  struct Chunk {
    std::size_t tensor;
    std::uint64_t offset;  // in the tensor
    std::size_t bytes;
    bool ends_tensor;
  };
  std::vector<Chunk> chunks;
  std::size_t largest_staged = 0;
  std::uint64_t offset = 0;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const TensorToWrite& tensor = tensors[t];
    const std::uint64_t bytes = numel_of(tensor.shape) * dtype_size(tensor.dtype);
    if (bytes > 0 && tensor.data == nullptr && !tensor.read) {
      throw InvalidArgument("tensors", "tensor '" + tensor.name + "' has neither data nor read");
    }
    json[tensor.name] = {{"dtype", safetensors_dtype(tensor.dtype)},
                         {"shape", tensor.shape},
                         {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    if (bytes == 0) chunks.push_back({t, 0, 0, true});  // still reported to after_tensor, in order
    for (std::uint64_t at = 0; at < bytes; at += options.chunk_bytes) {
      const std::size_t chunk = std::min<std::uint64_t>(options.chunk_bytes, bytes - at);
      chunks.push_back({t, at, chunk, at + chunk == bytes});
      if (tensor.data == nullptr) largest_staged = std::max(largest_staged, chunk);
    }
  }
  std::string text = json.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data then starts 8-byte aligned, as safetensors writes it

  File file = File::create_new(path);
  std::optional<PieceDigest> digest;
  if (options.digest_piece_bytes) digest.emplace(*options.digest_piece_bytes);
  const std::uint64_t header_length = text.size();
  for (const auto& [data, bytes] : {std::pair<const void*, std::size_t>{&header_length, sizeof header_length},
                                    std::pair<const void*, std::size_t>{text.data(), text.size()}}) {
    if (digest) digest->update(data, bytes);
    file.write_all(data, bytes);
  }
  std::uint64_t file_offset = sizeof header_length + text.size();
  // Two, so that the next chunk is fetched into one while the last one is written and hashed out of the other.
  // Page-locked: `read` copies out of a GPU.
  std::array<StagingBuffer, 2> staging{StagingBuffer(largest_staged, true), StagingBuffer(largest_staged, true)};
  const auto fetch = [&](std::size_t i) -> const char* {
    const Chunk& chunk = chunks[i];
    const TensorToWrite& tensor = tensors[chunk.tensor];
    if (tensor.data != nullptr || chunk.bytes == 0) return static_cast<const char*>(tensor.data) + chunk.offset;
    char* buffer = staging[i % 2].data();
    tensor.read(chunk.offset, chunk.bytes, buffer);
    return buffer;
  };
  const char* data = chunks.empty() ? nullptr : fetch(0);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const Chunk& chunk = chunks[i];
    // The chunk is hashed and written on two more threads while this one fetches the next: a save takes the
    // longest of the three, not their sum. (The futures' destructors wait, so a failure never leaves them
    // running.)
    std::future<void> hashed;
    if (digest) hashed = std::async(std::launch::async, [&digest, data, &chunk] { digest->update(data, chunk.bytes); });
    std::future<void> written = std::async(std::launch::async, [&file, data, &chunk, file_offset] {
      file.write_all(data, chunk.bytes);
      // Without this the kernel starts writing a large file back only once its dirty pages pass
      // dirty_background_ratio (gigabytes on a large host) or at the fsync below, which then flushes nearly all
      // of it after everything else is done; started chunk by chunk, the disk writes while the rest is fetched
      // and hashed, and the fsync waits for the last chunks only.
      file.start_writeback(file_offset, chunk.bytes);
    });
    const char* next = i + 1 < chunks.size() ? fetch(i + 1) : nullptr;
    written.get();
    if (hashed.valid()) hashed.get();
    file_offset += chunk.bytes;
    if (chunk.ends_tensor && options.after_tensor) options.after_tensor(chunk.tensor + 1);
    data = next;
  }
  file.sync();
  return digest ? digest->hex_digest() : std::string();
}

}  // namespace deltatrain::optim
