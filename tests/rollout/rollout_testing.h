// What the rollout tests on the CPU and the GPU share: the trainer's side of the true on-policy comparison.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "deltatrain/model/model.h"
#include "deltatrain/rollout/engine.h"

namespace deltatrain::rollout::testing {

// Every request's prompt and completion packed into one training batch, its completion tokens the targets, through
// a training forward of a fresh model with `options` on `params`: the largest |trainer - rollout| difference of the
// completion tokens' untempered log-probabilities (the requests must have asked for them).
inline double largest_logprob_gap(const model::Config& config, const model::ModelOptions& options,
                                  const model::TensorLookup& params, const std::vector<Request>& requests,
                                  const std::vector<Completion>& completions) {
  std::vector<std::int32_t> tokens, cu{0}, targets;
  std::vector<double> rollout;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const std::size_t first = tokens.size();
    tokens.insert(tokens.end(), requests[i].prompt.begin(), requests[i].prompt.end());
    tokens.insert(tokens.end(), completions[i].tokens.begin(), completions[i].tokens.end());
    for (std::size_t t = first; t < tokens.size(); ++t) {
      // Token t predicts t + 1, which is completion token t + 1 - first - prompt length when that is >= 0.
      const std::ptrdiff_t completion_index = static_cast<std::ptrdiff_t>(t + 1 - first) - std::ssize(requests[i].prompt);
      const bool target = completion_index >= 0 && t + 1 < tokens.size();
      targets.push_back(target ? tokens[t + 1] : -1);
      rollout.push_back(target ? completions[i].untempered_logprobs[completion_index] : 0.0);
    }
    cu.push_back(static_cast<std::int32_t>(tokens.size()));
  }
  model::Model trainer(config, options);
  trainer.bind(params);
  trainer.forward({tokens, cu, targets}, false);
  double largest = 0;
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    largest = std::max(largest, std::abs(trainer.token_logprobs()[t] - rollout[t]));
  }
  return largest;
}

}  // namespace deltatrain::rollout::testing
