// Sampling tokens from rows of logits, in float64: temperature, top-k, top-p (nucleus), greedy.
//
// The distribution a token is drawn from: the logits divided by the temperature, then only the top_k largest
// kept (0: all), then only the smallest set of the most probable tokens whose probability reaches top_p (the
// token that crosses top_p included), renormalised. Temperature 0 is greedy: the largest logit (the lowest
// id among equal ones) with probability 1. Ties in the orderings go to the lower token id, so the result is a
// function of the logits and the draw alone.
//
// The draw u maps to a token by the inverse CDF over the kept tokens in id order (whatever top-k and top-p
// kept): the first kept token whose cumulative probability exceeds u. Id order, not probability order, so that
// a GPU finds the token with one block-wide prefix sum over the row, exactly as the CPU walks it.
//
// The draw is counter-based: uniform(seed, sequence, index) hashes the three, so token `index` of sequence
// `sequence` gets the same draw whatever batch it runs in and whatever ran before (batch invariance, exact
// resume).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "deltatrain/core/tensor.h"

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

// What one row of a batch is sampled with.
struct RowSampling {
  SamplingParams params;  // valid (validate); its seed is not read: u is the draw
  double u = 0;           // the draw in [0, 1), e.g. uniform(params.seed, sequence, index)
  bool want_untempered = false;
};

class DeviceSampler;  // rollout/device_sampler.h

// Samples every row of a logits matrix in one call, where the logits are: on the CPU (float32 or float64, each
// row widened to float64 and drawn by sample_token), or on a GPU (bfloat16, computed there in float64 by the
// same algorithm, only the N samples coming back). Holds the scratch each side reuses, so that a call allocates
// nothing once a batch of its size has run.
class BatchSampler {
 public:
  BatchSampler();
  ~BatchSampler();
  BatchSampler(const BatchSampler&) = delete;
  BatchSampler& operator=(const BatchSampler&) = delete;

  // logits [N, V] contiguous, finite; rows [N]. stream: on a GPU, the cudaStream_t the logits were written on
  // (the sampling runs after that work, on it); unused on the CPU. InvalidArgument names "logits" (its shape,
  // dtype, layout) or "rows" (their count, or `rows[n].params...` out of range); Unavailable on a GPU in a
  // build without CUDA.
  std::vector<Sample> sample(const TensorView& logits, std::span<const RowSampling> rows, void* stream = nullptr);

  // sample() in two halves, so that a caller may queue more GPU work before it waits for the samples: launch checks
  // and queues a batch (on the CPU: samples it), collect returns the oldest batch launched and not yet collected
  // (InvalidArgument naming "collect" when there is none). Two GPU batches may be in flight at once (InvalidArgument
  // naming "launch" for a third). device_tokens: int32 [N] on the logits' GPU that also receives the token ids, for
  // work queued after the launch on the same stream (InvalidArgument for logits on the CPU).
  void launch(const TensorView& logits, std::span<const RowSampling> rows, void* stream = nullptr,
              std::int32_t* device_tokens = nullptr);
  std::vector<Sample> collect();

 private:
  struct Launched {
    std::vector<Sample> samples;  // sampled already (the CPU), or the room the device's fill
    bool on_device = false;
  };
  std::vector<double> row_;
  std::vector<std::int32_t> scratch_;
  std::unique_ptr<DeviceSampler> device_;  // made at the first GPU call
  std::deque<Launched> launched_;          // not yet collected, oldest first
};

}  // namespace deltatrain::rollout
