#include "deltatrain/rollout/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "deltatrain/core/error.h"
#include "deltatrain/model/log_softmax.h"
#include "device_sampler.h"

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

// Neumaier's compensated sum: the error of a float64 sum of the kept weights stays near one rounding whatever their
// number and order (a plain running sum of 248k weights, most far below the total, loses ~1e-12 of it), so the
// CPU's totals agree with the GPU's tree sums (rollout/cuda/) to rounding.
class CompensatedSum {
 public:
  void add(double x) {
    const double t = sum_ + x;
    compensation_ += std::abs(sum_) >= std::abs(x) ? (sum_ - t) + x : (x - t) + sum_;
    sum_ = t;
  }
  double value() const { return sum_ + compensation_; }

 private:
  double sum_ = 0, compensation_ = 0;
};

}  // namespace

int greedy_parts(std::int64_t rows, std::int64_t vocab, int multiprocessors) {
  const std::int64_t fill = (2 * std::int64_t{multiprocessors} + rows - 1) / std::max<std::int64_t>(rows, 1);
  const std::int64_t most = std::max<std::int64_t>(1, vocab / kGreedyMinValues);
  return static_cast<int>(std::clamp<std::int64_t>(fill, 1, most));
}

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
    const double inv_t = 1.0 / params.temperature;
    const double max = *std::max_element(logits.begin(), logits.end()) * inv_t;
    const auto weight = [&](std::int32_t id) { return std::exp(logits[id] * inv_t - max); };
    // The ranking: the larger logit first, the lower id among equals. The kept tokens are order[0, kept).
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
    const bool nucleus = params.top_p < 1;
    if (nucleus) std::sort(order.begin(), order.begin() + kept, before);
    CompensatedSum kept_mass;
    for (std::int64_t i = 0; i < kept; ++i) kept_mass.add(weight(order[i]));
    double total = kept_mass.value();
    if (nucleus) {
      // The shortest prefix of the ranking whose probability reaches top_p.
      CompensatedSum mass;
      std::int64_t n = 0;
      while (n < kept) {
        mass.add(weight(order[n++]));
        if (mass.value() >= params.top_p * total) break;
      }
      kept = n;
      total = mass.value();
    }
    // The inverse CDF over the kept tokens in id order (sampling.h says why).
    std::sort(order.begin(), order.begin() + kept);
    const double target = u * total;
    CompensatedSum cumulative;
    std::int64_t pick = kept - 1;  // u * total rounding up to total falls on the last kept token
    for (std::int64_t i = 0; i < kept; ++i) {
      cumulative.add(weight(order[i]));
      if (target < cumulative.value()) {
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

BatchSampler::BatchSampler() = default;
BatchSampler::~BatchSampler() = default;

std::vector<Sample> BatchSampler::sample(const TensorView& logits, std::span<const RowSampling> rows, void* stream) {
  launch(logits, rows, stream);
  return collect();
}

void BatchSampler::launch(const TensorView& logits, std::span<const RowSampling> rows, void* stream,
                          std::int32_t* device_tokens) {
  const bool on_cpu = logits.device.type == DeviceType::cpu;
  const bool dtype_ok = on_cpu ? logits.dtype == DType::f32 || logits.dtype == DType::f64 : logits.dtype == DType::bf16;
  if (logits.ndim != 2 || logits.shape[1] < 1 || !logits.is_contiguous() || !dtype_ok) {
    throw InvalidArgument("logits", std::string("must be a contiguous [N, V >= 1] matrix of ") +
                                        (on_cpu ? "float32 or float64 on the CPU" : "bfloat16 on a GPU") + ", got " +
                                        logits.shape_string() + " " + dtype_name(logits.dtype) + " on " +
                                        device_name(logits.device));
  }
  if (on_cpu && device_tokens != nullptr) {
    throw InvalidArgument("device_tokens", "takes the token ids of logits on a GPU; these are on the CPU");
  }
  const std::int64_t N = logits.shape[0], V = logits.shape[1];
  if (std::ssize(rows) != N) {
    throw InvalidArgument("rows", "needs one per row of logits (" + std::to_string(N) + "), got " +
                                      std::to_string(rows.size()));
  }
  for (std::int64_t n = 0; n < N; ++n) {
    validate(rows[n].params, "rows[" + std::to_string(n) + "].params");
    if (!(rows[n].u >= 0 && rows[n].u < 1)) {
      throw InvalidArgument("rows[" + std::to_string(n) + "].u", "must be in [0, 1), got " + std::to_string(rows[n].u));
    }
  }
  Launched batch{std::vector<Sample>(N), false};
  if (N > 0 && !on_cpu) {
    if (!device_ || !(device_->device() == logits.device)) {
      if (std::any_of(launched_.begin(), launched_.end(), [](const Launched& b) { return b.on_device; })) {
        throw InvalidArgument("logits", "are on " + device_name(logits.device) +
                                            ", while a batch on another device is still to be collected");
      }
      device_ = make_cuda_sampler(logits.device);
    }
    device_->launch(logits, rows, stream, device_tokens);
    batch.on_device = true;
  } else if (N > 0) {
    row_.resize(V);
    for (std::int64_t n = 0; n < N; ++n) {
      if (logits.dtype == DType::f64) std::copy_n(logits.ptr<double>() + n * V, V, row_.begin());
      else std::copy_n(logits.ptr<float>() + n * V, V, row_.begin());
      batch.samples[n] = sample_token(row_, rows[n].params, rows[n].u, rows[n].want_untempered, scratch_);
    }
  }
  launched_.push_back(std::move(batch));
}

std::vector<Sample> BatchSampler::collect() {
  if (launched_.empty()) throw InvalidArgument("collect", "no batch was launched that is still to be collected");
  Launched batch = std::move(launched_.front());
  launched_.pop_front();
  if (batch.on_device) device_->collect(batch.samples);
  return std::move(batch.samples);
}

}  // namespace deltatrain::rollout
