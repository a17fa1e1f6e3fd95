#include "chunked_read.h"

#include <algorithm>
#include <array>
#include <future>

#include "deltatrain/core/device_memory.h"
#include "deltatrain/core/error.h"
#include "memory.h"

namespace deltatrain::optim {

void read_chunked(const File& file, const ChunkedRead& read) {
  if (read.chunk_bytes == 0) throw InvalidArgument("chunk_bytes", "must be positive");
  std::vector<ByteRange> chunks;
  for (const ByteRange& range : read.ranges) {
    for (std::uint64_t at = range.begin; at < range.end; at += read.chunk_bytes) {
      chunks.push_back({at, std::min<std::uint64_t>(range.end, at + read.chunk_bytes)});
    }
  }
  std::size_t largest = 0;
  for (const ByteRange& chunk : chunks) largest = std::max<std::size_t>(largest, chunk.end - chunk.begin);
  const bool to_gpu = read.device.type != DeviceType::cpu;
  std::array<StagingBuffer, 2> buffers{StagingBuffer(largest, to_gpu), StagingBuffer(largest, to_gpu)};
  std::future<void> hashed;  // declared after the buffers: destroyed (and so waited for) before them
  // The disk reads the next chunks into the page cache while this thread waits for the hash and the copies of
  // the last one below, instead of idling between two reads; two ahead, so that its queue never runs dry.
  constexpr std::size_t kPrefetched = 2;
  const auto prefetch = [&](std::size_t i) {
    if (i < chunks.size()) file.prefetch(chunks[i].begin, chunks[i].end - chunks[i].begin);
  };
  for (std::size_t i = 0; i < kPrefetched; ++i) prefetch(i);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const std::size_t bytes = chunks[i].end - chunks[i].begin;
    prefetch(i + kPrefetched);
    char* buffer = buffers[i % 2].data();
    file.read_exact(buffer, bytes, chunks[i].begin);
    // The last chunk's hash and copies end before this one's start: then its buffer is free for the next read.
    if (hashed.valid()) hashed.get();
    synchronize(read.device, read.stream);
    if (read.digest != nullptr) {
      hashed = std::async(std::launch::async, [digest = read.digest, buffer, bytes] { digest->update(buffer, bytes); });
    }
    if (read.deliver) read.deliver(chunks[i].begin, buffer, bytes);
  }
  if (hashed.valid()) hashed.get();
  synchronize(read.device, read.stream);
}

}  // namespace deltatrain::optim
