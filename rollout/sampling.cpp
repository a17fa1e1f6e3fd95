#include "deltatrain/rollout/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "deltatrain/core/error.h"
#include "deltatrain/model/log_softmax.h"

namespace deltatrain::rollout {
namespace {

// splitmix64's finaliser: a bijection of 64-bit words whose output bits each depend on every input bit.
std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The greedy token: the largest logit, the lowest id among equals.
std::int32_t argmax(std::span<const double> logits) {
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

}  // namespace

void validate(const SamplingParams& params, const std::string& where) {
  if (!(params.temperature >= 0) || !std::isfinite(params.temperature)) {
    throw InvalidArgument(where + ".temperature",
                          "must be a finite number >= 0 (0: greedy), got " + std::to_string(params.temperature));
  }
  if (!(params.top_p > 0 && params.top_p <= 1)) {
    throw InvalidArgument(where + ".top_p", "must be in (0, 1], got " + std::to_string(params.top_p));
  }
  if (params.top_k < 0) {
    throw InvalidArgument(where + ".top_k", "must be >= 0 (0: the whole vocabulary), got " + std::to_string(params.top_k));
  }
}

double uniform(std::uint64_t seed, std::uint64_t sequence, std::uint64_t index) {
  const std::uint64_t bits = mix(mix(mix(seed) ^ sequence) ^ index);
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

double log_softmax_at(std::span<const double> logits, std::int32_t token) {
  return model::log_sum_exp(logits.data(), std::ssize(logits)).log_prob(logits[token]);
}

Sample sample_token(std::span<const double> logits, const SamplingParams& params, double u, bool want_untempered,
              std::vector<std::int32_t>& order) {
  Sample out;
  const auto V = static_cast<std::int64_t>(logits.size());
  if (params.temperature == 0) {
    out.token = argmax(logits);
  } else {
    // Candidates, most probable first; only as much of the order is sorted as top-k and top-p need.
    const double inv_t = 1.0 / params.temperature;
    const auto before = [&](std::int32_t a, std::int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    order.resize(V);
    std::iota(order.begin(), order.end(), 0);
    std::int64_t kept = V;
    if (params.top_k > 0 && params.top_k < V) {
      kept = params.top_k;
      std::nth_element(order.begin(), order.begin() + (kept - 1), order.end(), before);
    }
    // The inverse CDF walks the candidates most probable first under top-p, in id order otherwise (never in
    // nth_element's arbitrary order, which a rounding-level change of the logits could reshuffle).
    const bool nucleus = params.top_p < 1;
    if (nucleus) std::sort(order.begin(), order.begin() + kept, before);
    else std::sort(order.begin(), order.begin() + kept);
    const double max = *std::max_element(logits.begin(), logits.end()) * inv_t;
    double total = 0;
    for (std::int64_t i = 0; i < kept; ++i) total += std::exp(logits[order[i]] * inv_t - max);
    if (nucleus) {
      // The shortest prefix of the sorted candidates whose probability reaches top_p.
      double mass = 0;
      std::int64_t n = 0;
      while (n < kept) {
        mass += std::exp(logits[order[n++]] * inv_t - max);
        if (mass >= params.top_p * total) break;
      }
      kept = n;
      total = mass;
    }
    // Inverse CDF over the candidates in their order (index order when nothing was sorted).
    const double target = u * total;
    double cumulative = 0;
    std::int64_t pick = kept - 1;  // u * total rounding up to total falls on the last candidate
    for (std::int64_t i = 0; i < kept; ++i) {
      cumulative += std::exp(logits[order[i]] * inv_t - max);
      if (target < cumulative) {
        pick = i;
        break;
      }
    }
    out.token = order[pick];
    out.logprob = logits[out.token] * inv_t - max - std::log(total);
  }
  if (want_untempered) out.untempered_logprob = log_softmax_at(logits, out.token);
  return out;
}

}  // namespace deltatrain::rollout
