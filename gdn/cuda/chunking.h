// The chunk, the unit of the chunked algorithm's WY/UT transform, and the chunk table's entry: shared by the
// kernels (params.h) and the host's pure planning of a call's memory (layout.h), which is built without nvcc too.
#pragma once

#include <cstdint>

namespace deltatrain::gdn::cuda {

inline constexpr int kChunk = 64;  // tokens per chunk: the unit of the WY/UT transform
// Key columns one CTA of the chunk-gradient kernel covers: K / kKeySlice CTAs split a chunk's keys, so that
// its accumulators and tiles leave room for two CTAs per SM.
inline constexpr int kKeySlice = 64;

// One chunk of one sequence: tokens [start, start + length) of the flattened B*T tokens.
struct ChunkInfo {
  std::int32_t start;
  std::int32_t length;  // 1..kChunk
  std::int32_t sequence;
  std::int32_t unused;
};

}  // namespace deltatrain::gdn::cuda
