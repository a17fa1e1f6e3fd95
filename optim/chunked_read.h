// Reading byte ranges of a file once, in large chunks through two staging buffers: the next chunk is read
// while the last one is hashed (on other threads) and its bytes are copied on to where they belong (a
// device's memory, asynchronously). One pass then costs the longest of reading, hashing and copying, not their
// sum, and no buffer of the whole file is ever allocated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "deltatrain/core/tensor.h"
#include "deltatrain/optim/digest.h"
#include "deltatrain/optim/safetensors.h"
#include "file_io.h"

namespace deltatrain::optim {

struct ByteRange {
  std::uint64_t begin = 0, end = 0;
};

struct ChunkedRead {
  std::vector<ByteRange> ranges = {};  // in increasing order, disjoint: the bytes to read
  std::size_t chunk_bytes = kDefaultChunkBytes;
  PieceDigest* digest = nullptr;  // when given, updated with every byte read, in order
  // Called on this thread for each chunk read, with the chunk's offset in the file. It may enqueue copies out
  // of `data` to `device` on `stream` (queued with copy_bytes): they are waited for before the buffer is reused.
  std::function<void(std::uint64_t offset, const char* data, std::size_t bytes)> deliver = {};
  Device device{};
  void* stream = nullptr;
};

void read_chunked(const File& file, const ChunkedRead& read);

}  // namespace deltatrain::optim
