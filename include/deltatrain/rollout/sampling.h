// Sampling one token from a row of logits, in float64 on the host: temperature, top-k, top-p (nucleus), greedy.
//
// The distribution a token is drawn from: the logits divided by the temperature, then only the top_k largest
// kept (0: all), then only the smallest set of the most probable tokens whose probability reaches top_p (the
// token that crosses top_p included), renormalised. Temperature 0 is greedy: the largest logit (the lowest
// id among equal ones) with probability 1. Ties in the orderings go to the lower token id, so the result is a
// function of the logits and the draw alone.
//
// The draw is counter-based: uniform(seed, sequence, index) hashes the three, so token `index` of sequence
// `sequence` gets the same draw whatever batch it runs in and whatever ran before (batch invariance, exact
// resume).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace deltatrain::rollout {

struct SamplingParams {
  double temperature = 1.0;  // >= 0; 0: greedy
  double top_p = 1.0;        // in (0, 1]
  std::int32_t top_k = 0;    // >= 0; 0: the whole vocabulary
  std::uint64_t seed = 0;
};

// InvalidArgument naming `<where>.temperature` (or top_p, top_k) and the rule, for a value out of range.
void validate(const SamplingParams& params, const std::string& where);

// A uniform double in [0, 1) (53 random bits) from the three counters.
double uniform(std::uint64_t seed, std::uint64_t sequence, std::uint64_t index);

struct Sample {
  std::int32_t token = 0;
  double logprob = 0;  // log p(token) under the sampling distribution (0 for greedy: probability 1)
  double untempered_logprob = 0;  // log softmax(logits)[token] over the whole vocabulary, when asked for
};

// Draws from `logits` with the draw u in [0, 1). scratch: reused between calls (no allocation per token once it
// has grown). The logits must be finite; params valid.
Sample sample_token(std::span<const double> logits, const SamplingParams& params, double u, bool want_untempered,
              std::vector<std::int32_t>& scratch);

// log softmax(logits)[token] in float64.
double log_softmax_at(std::span<const double> logits, std::int32_t token);

}  // namespace deltatrain::rollout
