// bfloat16 <-> float on the host: a bf16 value is the upper 16 bits of a float32.
#pragma once

#include <cstdint>
#include <cstring>

namespace deltatrain {

inline float bf16_to_float(std::uint16_t bits) {
  const std::uint32_t word = static_cast<std::uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// Round to nearest even, as the hardware does; NaN stays NaN.
inline std::uint16_t float_to_bf16(float value) {
  std::uint32_t word;
  std::memcpy(&word, &value, sizeof word);
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((word >> 16) | 0x40u);
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<std::uint16_t>(word >> 16);
}

}  // namespace deltatrain
