// The wgmma operand descriptor the kernels form (gdn/cuda/smem_descriptor.h) against the descriptor's layout written
// out field by field: formed from a tile's base and an offset, it must equal the descriptor of the address base +
// offset, for any base of the CTA's shared memory (with the cluster's rank bits above it or not) and any offset that
// keeps the operand inside it.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "cuda/smem_descriptor.h"

namespace {

using deltatrain::gdn::cuda::smem_descriptor;

// The descriptor of the operand at shared address `address`: the start address in 16-byte units in bits 0-13 (the
// shared window's low 18 bits), the leading byte offset in bits 16-29 and the stride byte offset in bits 32-45 (both
// in 16-byte units), and swizzle mode 1 (128-byte) in bits 62-63.
std::uint64_t descriptor_of(std::uint32_t address, std::uint32_t leading_bytes, std::uint32_t stride_bytes) {
  const std::uint64_t start = (address & 0x3FFFFu) >> 4;
  const std::uint64_t leading = (leading_bytes >> 4) & 0x3FFFu;
  const std::uint64_t stride = (stride_bytes >> 4) & 0x3FFFu;
  return start | leading << 16 | stride << 32 | std::uint64_t{1} << 62;
}

constexpr std::uint32_t kSharedBytes = 227 * 1024;  // the most a CTA of sm_90 may have

TEST(SmemDescriptor, BaseAndOffsetGiveTheDescriptorOfTheirSum) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<std::uint32_t> sixteens(0, kSharedBytes / 16 - 1), rank(0, 15), any(0, 1);
  const std::uint32_t leadings[] = {16, 64 * 128, 128 * 128};  // k_major's, and mn_major's block bytes
  for (int trial = 0; trial < 100000; ++trial) {
    std::uint32_t low = 16 * sixteens(rng), offset = 16 * sixteens(rng);
    if (low + offset >= kSharedBytes) offset = kSharedBytes - 16 - low;  // the operand stays in shared memory
    const std::uint32_t base = (any(rng) ? rank(rng) << 24 : 0) | low;  // a cluster CTA's window carries its rank
    const std::uint32_t leading = leadings[trial % 3], stride = 8 * 128;
    ASSERT_EQ(smem_descriptor(base, offset, leading, stride), descriptor_of(base + offset, leading, stride))
        << "base " << base << " offset " << offset << " leading " << leading;
  }
}

}  // namespace
