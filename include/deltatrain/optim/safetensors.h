// The safetensors format, as checkpoint shards use it: an 8-byte little-endian header length, a
// JSON header (per tensor: dtype, shape, data_offsets relative to the end of the header; optional
// "__metadata__" of strings), then the raw little-endian bytes. Python's safetensors and numpy read it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "deltatrain/core/tensor.h"
#include "deltatrain/optim/digest.h"

namespace deltatrain::optim {

// "F32", "BF16", ... and back; InvalidArgument for a name safetensors does not define here.
const char* safetensors_dtype(DType dtype);
DType dtype_from_safetensors(const std::string& name);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  // data_offsets, relative to data_start
};

struct SafetensorsHeader {
  std::uint64_t data_start = 0;  // 8 + the header's length
  std::vector<SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;

  const SafetensorsEntry* find(const std::string& name) const;
};

// Reads and checks a file's header: the length, the JSON, each tensor's byte count against its
// dtype and shape, and that every tensor lies inside the file. Failure naming the file and what is
// wrong (truncated, unreadable header, ...).
SafetensorsHeader read_safetensors_header(const std::filesystem::path& path);

// The bytes moved at once between a file, its hash and a device: large enough that each read, write, hash
// update and copy costs far more than its call, small enough that the two staging buffers are cheap.
inline constexpr std::size_t kDefaultChunkBytes = std::size_t{64} << 20;

struct TensorToWrite {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;  // {} for a scalar
  const void* data = nullptr;       // host memory, numel * dtype_size bytes; null when `read` supplies them
  // For bytes that are not in host memory (a GPU's): copies bytes [offset, offset + bytes) of the tensor into
  // `staging` (host memory, page-locked where CUDA can pin it) and returns once they are there. The writer asks
  // chunk by chunk, for the next chunk while the last one is written and hashed, so no host copy of the whole
  // tensor is ever made.
  std::function<void(std::uint64_t offset, std::size_t bytes, void* staging)> read = {};
};

struct SafetensorsWriteOptions {
  // Called after each tensor's bytes are written, with how many tensors are written so far.
  std::function<void(std::size_t)> after_tensor = {};
  // The most bytes of a tensor handled at once; two staging buffers of this size are allocated when some
  // tensor comes through `read`.
  std::size_t chunk_bytes = kDefaultChunkBytes;
  // The returned digest's pieces (digest.h's PieceDigest; 0: the plain SHA-256 of the file); none: no digest, for
  // files whose digest nobody records (the hashing threads would compete with the writes for nothing).
  std::optional<std::uint64_t> digest_piece_bytes = kDigestPieceBytes;
};

// Creates `path` (Failure if it exists), writes the tensors in order and fsyncs it. Returns the file's
// PieceDigest, computed while writing (empty without digest_piece_bytes). InvalidArgument naming the tensor when
// it has neither data nor read.
std::string write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata,
                              const SafetensorsWriteOptions& options = {});

}  // namespace deltatrain::optim
