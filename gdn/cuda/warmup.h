// Segment starts by a bounded warm-up (docs/gdn-algorithm.md, "A bounded warm-up"): where a segment's chunks nearest
// the next segment (its last in the forward, its first in the backward) forget enough of the state entering them,
// the next segment's start is their walk from a zero start, not the exact composition through the segment's map M.
// One rule for every kernel that asks (prepare writes each chunk's bound, the segment ends passes choose their chunks
// from them); built without nvcc too, for its CPU tests (tests/gdn/test_warmup.cpp).
#pragma once

#include <cmath>

#include "host_device.h"

namespace deltatrain::gdn::cuda {

// ln 2^-24: a warm-up may stop where the part of the state it forgets weighs at most float32's unit roundoff.
inline constexpr float kWarmupLogBound = -16.635532f;

// log max(1, |1 - beta |k|^2|): how much a token's transition e^g (I - beta k k^T) may stretch the state beyond its
// decay. Its spectral norm is exactly e^g times max(1, |1 - beta |k|^2|) (symmetric, eigenvalues e^g and
// e^g (1 - beta |k|^2)), so a chunk's map has norm at most e^B, B = its gates' sum plus its tokens' stretches.
DELTATRAIN_HOST_DEVICE inline float transition_log_stretch(float beta, float key_norm2) {
  const float stretch = std::fabs(1.f - beta * key_norm2);
  return stretch > 1.f ? std::log(stretch) : 0.f;  // (a NaN beta gives 0: the outputs are NaN whatever the start)
}

// The first of a run of `count` chunks from which a walk to its end may start from zero: the latest chunk j whose
// chunks j..count-1 have log bounds (log_norm(i)) summing to kWarmupLogBound or less, summed from the last chunk back,
// or -1 where the whole run does not (the exact composition then stays). Eight bounds are loaded before each eight
// additions, so that a kernel's loads overlap; the order of the additions, and so the choice, is the same on the host
// and on every CTA that asks.
template <class LogNorm>
DELTATRAIN_HOST_DEVICE int warmup_first_chunk(int count, LogNorm&& log_norm) {
  constexpr int kLoads = 8;
  float sum = 0.f;
  for (int top = count - 1; top >= 0; top -= kLoads) {
    float bound[kLoads];
    for (int i = 0; i < kLoads; ++i) bound[i] = top - i >= 0 ? log_norm(top - i) : 0.f;
    for (int i = 0; i < kLoads; ++i) {
      if (top - i < 0) return -1;
      sum += bound[i];
      if (sum <= kWarmupLogBound) return top - i;
    }
  }
  return -1;
}

}  // namespace deltatrain::gdn::cuda
