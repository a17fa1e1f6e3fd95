// log softmax(row)[token] in float64: the one formula the CPU model's loss and the rollout's sampling share, so
// that in batch-invariant mode (ModelOptions::batch_invariant) the trainer's log-probability of a token and the
// rollout's are the same number, not two roundings of it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace deltatrain::model {

struct LogSumExp {
  double max = -std::numeric_limits<double>::infinity();
  double log_sum = 0;  // log sum_c exp(row[c] - max)
  double lse() const { return max + log_sum; }
  double log_prob(double logit) const { return (logit - max) - log_sum; }
};

// Every value widened to float64 first, summed in index order.
template <class T>
LogSumExp log_sum_exp(const T* row, std::int64_t n) {
  LogSumExp s;
  for (std::int64_t c = 0; c < n; ++c) s.max = std::max(s.max, static_cast<double>(row[c]));
  double sum = 0;
  for (std::int64_t c = 0; c < n; ++c) sum += std::exp(static_cast<double>(row[c]) - s.max);
  s.log_sum = std::log(sum);
  return s;
}

}  // namespace deltatrain::model
