// A float32 bit pattern rounded to TF32 (1 sign, 8 exponent, 10 fraction bits) as plain integer arithmetic: the
// TF32 products' operands (mma.cuh's tf32_parts) are formed by it, and host tests check it against the rounding written
// out on the CPU (tests/gdn/test_tf32_rounding.cpp). Built without nvcc too.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace deltatrain::gdn::cuda {

inline constexpr std::uint32_t kTf32DroppedBits = 13;

// The top 19 bits of `bits` rounded to nearest, ties away from zero, as cvt.rna.tf32.f32 rounds a finite value: half
// of the dropped bits' unit is added to the pattern, and a carry out of the fraction into the exponent is the rounding
// up it should be. The low 13 bits are left over: a tensor core reads a TF32 operand's top 19 bits and ignores them.
DELTATRAIN_HOST_DEVICE constexpr std::uint32_t tf32_operand(std::uint32_t bits) {
  return bits + (1u << (kTf32DroppedBits - 1));
}

// The same rounding with the low 13 bits cleared: the pattern of the TF32 value itself, for arithmetic on it.
DELTATRAIN_HOST_DEVICE constexpr std::uint32_t tf32_value(std::uint32_t bits) {
  return tf32_operand(bits) & ~((1u << kTf32DroppedBits) - 1);
}

}  // namespace deltatrain::gdn::cuda
