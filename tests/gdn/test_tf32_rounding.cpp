// The TF32 rounding of the 3xTF32 products' split (gdn/cuda/tf32_rounding.h) against round-to-nearest, ties away from
// zero, at TF32's precision written out in double arithmetic: over random finite floats of every exponent, subnormals,
// values whose rounding carries into the exponent, and exact ties.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "cuda/tf32_rounding.h"

namespace {

using deltatrain::gdn::cuda::tf32_operand;
using deltatrain::gdn::cuda::tf32_value;

// x rounded to 11 significant bits (TF32's 10 stored fraction bits and the implicit one), to nearest with ties away
// from zero; below float32's normal range at TF32's fixed spacing there, 2^-126 / 2^10.
double tf32_reference(float x) {
  const double v = x;
  if (v == 0) return v;
  int exponent = 0;
  std::frexp(v, &exponent);  // |v| = m 2^exponent, m in [0.5, 1)
  const double spacing = std::ldexp(1.0, std::max(exponent, -125) - 11);
  return std::round(v / spacing) * spacing;  // std::round rounds halves away from zero
}

float from_bits(std::uint32_t bits) { return std::bit_cast<float>(bits); }

void expect_rounds(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const double expected = tf32_reference(x);
  if (!std::isfinite(expected) || std::fabs(expected) > std::numeric_limits<float>::max()) return;  // overflows
  ASSERT_EQ(static_cast<double>(from_bits(tf32_value(bits))), expected) << "x = " << x << " (bits " << bits << ")";
  ASSERT_EQ(tf32_operand(bits) >> 13, tf32_value(bits) >> 13) << "the operand's top 19 bits are the value's";
}

TEST(Tf32Rounding, RoundsToNearestWithTiesAwayFromZero) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<std::uint32_t> any_bits(0, 0xFFFFFFFFu);
  for (int trial = 0; trial < 200000; ++trial) {
    const std::uint32_t bits = any_bits(rng);
    if (!std::isfinite(from_bits(bits))) continue;
    expect_rounds(from_bits(bits));
    expect_rounds(from_bits((bits & ~0x1FFFu) | 0x1000u));   // an exact tie
    expect_rounds(from_bits((bits & ~0x1FFFu) | 0x0FFFu));   // just below one
    expect_rounds(from_bits(bits | 0x007FF000u));            // the fraction's top bits set: a carry into the exponent
    expect_rounds(from_bits(bits & 0x807FFFFFu));            // a subnormal
  }
}

TEST(Tf32Rounding, SplitRecoversTheFloatToTwentyTwoBits) {
  // hi + lo, each as the tensor core reads it (the top 19 bits), against x: the 3xTF32 products' premise.
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> magnitude(-30.f, 30.f), sign(-1.f, 1.f);
  for (int trial = 0; trial < 100000; ++trial) {
    const float x = std::copysign(std::exp2(magnitude(rng)), sign(rng));
    const float hi = from_bits(tf32_value(std::bit_cast<std::uint32_t>(x)));
    const float lo = from_bits(tf32_value(std::bit_cast<std::uint32_t>(x - hi)));
    ASSERT_LE(std::fabs((static_cast<double>(hi) + lo - x) / x), std::ldexp(1.0, -22)) << "x = " << x;
  }
}

}  // namespace
