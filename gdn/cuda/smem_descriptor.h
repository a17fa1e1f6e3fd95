// The shared-memory matrix descriptor of a wgmma operand (sm_90a) as plain arithmetic: the kernels form it
// (wgmma.cuh's k_major and mn_major), and host tests check it against the descriptor's layout
// (tests/gdn/test_smem_descriptor.cpp). Built without nvcc too.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace deltatrain::gdn::cuda {

// A descriptor of a 128-byte-swizzled operand starting `offset` bytes past shared address `base`: start address,
// leading and stride byte offsets in units of 16 bytes, swizzle mode 1 (128 B) in bits 62-63. The offset is added to
// the start field, not to the address, so that every step of a product over one tile shares the fields formed from
// its base and adds one number. The same descriptor as from the address base + offset wherever both are multiples of
// 16 and the operand lies in the CTA's shared memory: the field (14 bits, 256 KB) then never carries.
DELTATRAIN_HOST_DEVICE constexpr std::uint64_t smem_descriptor(std::uint32_t base, std::uint32_t offset,
                                                               std::uint32_t leading_bytes,
                                                               std::uint32_t stride_bytes) {
  const std::uint32_t low = (((base & 0x3FFFF) >> 4) | (leading_bytes >> 4) << 16) + (offset >> 4);
  const std::uint32_t high = (stride_bytes >> 4) | 1u << 30;
  return static_cast<std::uint64_t>(high) << 32 | low;
}

}  // namespace deltatrain::gdn::cuda
