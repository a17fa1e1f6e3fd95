#include "deltatrain/rl/grpo.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "deltatrain/core/error.h"

namespace deltatrain::rl {

void check_options(const GrpoOptions& o) {
  auto in_unit = [](const char* flag, double value) {
    if (!(value >= 0 && value < 1)) throw InvalidArgument(flag, "must be in [0, 1), got " + std::to_string(value));
  };
  in_unit("clip", o.clip_low);
  if (!(o.clip_high >= 0 && std::isfinite(o.clip_high))) {
    throw InvalidArgument("clip-high", "must be finite and >= 0, got " + std::to_string(o.clip_high));
  }
  if (!(o.kl_coef >= 0 && std::isfinite(o.kl_coef))) {
    throw InvalidArgument("kl-coef", "must be finite and >= 0, got " + std::to_string(o.kl_coef));
  }
  if (!(o.tis_cap > 0 && std::isfinite(o.tis_cap))) {
    throw InvalidArgument("tis-cap", "must be finite and > 0, got " + std::to_string(o.tis_cap));
  }
}

std::vector<double> group_advantages(std::span<const double> rewards, std::int64_t group_size) {
  const auto n = static_cast<std::int64_t>(rewards.size());
  if (group_size < 1 || n % group_size != 0) {
    throw InvalidArgument("samples-per-prompt", "must be >= 1 and divide the " + std::to_string(n) +
                                                    " rewards, got " + std::to_string(group_size));
  }
  std::vector<double> advantages(rewards.size());
  for (std::int64_t begin = 0; begin < n; begin += group_size) {
    double mean = 0;
    for (std::int64_t i = begin; i < begin + group_size; ++i) mean += rewards[i];
    mean /= static_cast<double>(group_size);
    double variance = 0;
    for (std::int64_t i = begin; i < begin + group_size; ++i) variance += (rewards[i] - mean) * (rewards[i] - mean);
    const double std_dev = std::sqrt(variance / static_cast<double>(group_size));
    for (std::int64_t i = begin; i < begin + group_size; ++i) advantages[i] = (rewards[i] - mean) / (std_dev + 1e-6);
  }
  return advantages;
}

TokenLoss grpo_token_loss(const GrpoOptions& o, const TokenInputs& in) {
  TokenLoss out;
  const double ratio = std::exp(in.logprob - in.old_logprob);
  const double clipped_ratio = std::clamp(ratio, 1.0 - o.clip_low, 1.0 + o.clip_high);
  const double pg = -in.advantage * ratio, pg_clipped = -in.advantage * clipped_ratio;
  // When the clipped bound is the larger, it is constant in logprob: no gradient.
  out.clipped = pg_clipped > pg;
  const double policy = out.clipped ? pg_clipped : pg;
  const double d_policy = out.clipped ? 0.0 : -in.advantage * ratio;
  out.tis = o.tis ? std::min(std::exp(in.old_logprob - in.rollout_logprob), o.tis_cap) : 1.0;
  double kl = 0, d_kl = 0;
  if (o.kl_coef > 0) {
    const double log_ratio = in.ref_logprob - in.logprob;
    kl = std::exp(log_ratio) - log_ratio - 1;
    d_kl = 1 - std::exp(log_ratio);
  }
  out.kl = kl;
  out.term = in.weight * (out.tis * policy + o.kl_coef * kl);
  out.derivative = in.weight * (out.tis * d_policy + o.kl_coef * d_kl);
  return out;
}

}  // namespace deltatrain::rl
