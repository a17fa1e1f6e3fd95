// GRPO's arithmetic, as pure functions (the RL loop applies them; tests check them against a direct
// computation): group-normalised advantages, and the clipped, token-level policy loss with the optional
// truncated importance sampling (TIS) correction for the train/rollout mismatch and a KL penalty to a
// reference policy.
//
// For a response token t with the trainer's log-probability logp, the old policy's logp_old (the trainer's
// at the parameters that generated the rollout), the rollout's own logp_rollout and the advantage A:
//   ratio = exp(logp - logp_old)
//   pg    = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))        (PPO's pessimistic bound)
//   tis   = min(exp(logp_old - logp_rollout), tis_cap)  with --tis, else 1     (a constant weight)
//   kl    = exp(logp_ref - logp) - (logp_ref - logp) - 1                      (k3, >= 0, with kl_coef > 0)
//   term  = weight * (tis * pg + kl_coef * kl)
// where `weight` makes the loss a mean over every response token of the global batch.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace deltatrain::rl {

struct GrpoOptions {
  double clip_low = 0.2;    // --clip
  double clip_high = 0.28;  // --clip-high
  double kl_coef = 0;       // --kl-coef
  bool tis = false;         // --tis
  double tis_cap = 2.0;
};

// InvalidArgument naming the flag (clip, clip-high, kl-coef) for a value out of range.
void check_options(const GrpoOptions& options);

// (r - mean) / (std + 1e-6) within each group of `group_size` consecutive rewards (population std): a group
// whose rewards are all equal gets advantages 0. InvalidArgument when group_size < 1 or does not divide the
// count.
std::vector<double> group_advantages(std::span<const double> rewards, std::int64_t group_size);

struct TokenInputs {
  double logprob = 0;          // the trainer's, now
  double old_logprob = 0;      // the trainer's at the rollout's parameters (a constant)
  double rollout_logprob = 0;  // the rollout's, for the sampled token
  double ref_logprob = 0;      // the reference policy's (read only when kl_coef > 0)
  double advantage = 0;
  double weight = 0;
};

struct TokenLoss {
  double term = 0;
  double derivative = 0;  // d term / d logprob
  bool clipped = false;   // the clipped branch is the active one (no policy gradient from this token)
  double tis = 1;         // the TIS weight applied
  double kl = 0;          // k3 (0 without a reference)
};

TokenLoss grpo_token_loss(const GrpoOptions& options, const TokenInputs& in);

}  // namespace deltatrain::rl
