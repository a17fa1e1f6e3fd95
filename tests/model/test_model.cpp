// The whole model on the CPU: the checks of check.h (its forward against an independent float64 evaluation,
// its backward against central finite differences, packing, determinism, save/load) on a small hybrid and
// on the tiny preset, and the errors bad input gets. Fresh random weights and tokens each run; a failure
// prints the seed and DELTATRAIN_TEST_SEED=<seed> replays it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "deltatrain/core/allocator.h"
#include "deltatrain/core/error.h"
#include "deltatrain/model/check.h"
#include "deltatrain/model/inference.h"
#include "deltatrain/model/model.h"
#include "deltatrain/model/params.h"
#include "model_testing.h"

namespace deltatrain::model {
namespace {

class ModelTest : public testing::SeededTest {
 protected:
  static Config small_config(bool tied) { return testing::small_hybrid_config(tied); }

  void expect_all_pass(const Config& config, CheckOptions options) {
    options.seed = seed_;
    for (const CheckResult& r : run_model_checks(config, options)) {
      EXPECT_TRUE(r.pass()) << r.name << ": error " << r.error << " > " << r.tolerance << " (" << r.detail << ")";
    }
  }


};

class ModelChecks : public ModelTest, public ::testing::WithParamInterface<bool> {};

// Host memory that remembers the most it held at once.
class CountingAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, const char* what) override {
    void* data = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (data == nullptr) throw std::bad_alloc();
    sizes_[data] = bytes;
    held_ += bytes;
    peak_ = std::max(peak_, held_);
    return data;
  }
  void deallocate(void* address) noexcept override {
    held_ -= sizes_[address];
    sizes_.erase(address);
    std::free(address);
  }
  Device device() const override { return {}; }
  std::size_t peak() const { return peak_; }

 private:
  std::map<void*, std::size_t> sizes_;
  std::size_t held_ = 0, peak_ = 0;
};

// The most memory a model of `layers` layers (the small hybrid's shape otherwise) takes for its activations in a
// prefill of `prompts` and in a training forward of the same tokens.
struct PeakBytes {
  std::size_t prefill = 0, training = 0;
};
PeakBytes activation_peaks(int layers, const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& cu,
                           std::uint64_t seed) {
  Config config = testing::small_hybrid_config(true);
  config.layer_types = interval_layer_types(layers, 2);
  ParamStore store(config, DType::f64);
  store.init(0.3, seed);
  PeakBytes peaks;
  const std::int64_t prompts = std::ssize(cu) - 1;
  {
    CountingAllocator memory;
    Model model(config, {.dtype = DType::f64, .cpu_threads = 1, .memory = &memory});
    model.bind(store.params());
    InferenceState state(config, {.dtype = DType::f64}, prompts, tokens.size());  // its own memory
    std::vector<std::int32_t> slots(prompts);
    std::iota(slots.begin(), slots.end(), 0);
    std::vector<double> logits(prompts * config.vocab_size);
    model.prefill({tokens, cu}, slots, state, logits);
    peaks.prefill = memory.peak();
  }
  CountingAllocator memory;
  Model model(config, {.dtype = DType::f64, .cpu_threads = 1, .memory = &memory});
  model.bind(store.params(), store.grads());
  model.forward({tokens, cu});
  peaks.training = memory.peak();
  return peaks;
}

// Inference keeps no layer's activations past the layer: a prefill takes the same memory whatever the number of
// layers, while a training forward (which keeps them for its backward) takes more with more layers. The tokens are
// enough for one layer's activations to outgrow the arena's smallest chunk, so that keeping them would show.
TEST_F(ModelTest, PrefillMemoryDoesNotGrowWithTheLayers) {
  std::vector<std::int32_t> cu{0};
  for (int n = 0; n < 8; ++n) cu.push_back(cu.back() + 200 + static_cast<std::int32_t>(rng_() % 100));
  const std::vector<std::int32_t> tokens = testing::random_tokens(rng_, cu.back(), small_config(true).vocab_size);
  const std::uint64_t seed = rng_();
  const PeakBytes two = activation_peaks(2, tokens, cu, seed), eight = activation_peaks(8, tokens, cu, seed);
  EXPECT_EQ(eight.prefill, two.prefill);
  EXPECT_GT(eight.training, two.training);
}

TEST_P(ModelChecks, PassOnASmallHybrid) { expect_all_pass(small_config(GetParam()), {}); }

INSTANTIATE_TEST_SUITE_P(Embeddings, ModelChecks, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "tied" : "untied"; });

// The tiny preset itself: GDN and attention head dims 64, a 4096-token vocabulary.
TEST_F(ModelTest, ChecksPassOnTheTinyPreset) { expect_all_pass(preset("tiny"), {.gradient_samples = 1}); }

// The forward check is not satisfied by any model: the same weights and tokens through a different function
// (RoPE's theta doubled in the model but not in the reference) fail it.
TEST_F(ModelTest, ForwardCheckFailsForAnotherFunction) {
  const Config config = small_config(true);
  Config other = config;
  other.rope_theta *= 2;
  for (DType dtype : {DType::f64, DType::f32}) {
    SCOPED_TRACE(dtype_name(dtype));
    EXPECT_TRUE(detail::forward_check_with_reference_config(config, config, seed_, dtype).pass());
    const CheckResult wrong = detail::forward_check_with_reference_config(other, config, seed_, dtype);
    EXPECT_FALSE(wrong.pass()) << wrong.detail;
    // float32's bound is relative to its rounding (a ratio); the other function is far past it, not near it.
    if (dtype == DType::f32) {
      EXPECT_GT(wrong.error, 100 * wrong.tolerance) << wrong.detail;
    }
  }
}

// Bad input gets an error naming what is wrong, and the model stays usable.
TEST_F(ModelTest, BadInputIsRefusedByName) {
  const Config config = small_config(true);
  ParamStore store(config, DType::f32);
  store.init(0.5, seed_);
  Model model(config);
  const std::vector<std::int32_t> tokens = testing::random_tokens(rng_, 6, config.vocab_size);
  const std::vector<std::int32_t> cu{0, 6};
  EXPECT_THROW(model.forward({tokens, cu}), StateError);  // nothing bound
  model.bind(store.params(), store.grads());
  EXPECT_THROW(model.backward(), StateError);  // no forward yet

  auto expect_invalid = [&](const Batch& batch, const std::string& argument) {
    try {
      model.forward(batch);
      ADD_FAILURE() << "no error for bad " << argument;
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  std::vector<std::int32_t> bad_tokens = tokens;
  bad_tokens[3] = static_cast<std::int32_t>(config.vocab_size);
  expect_invalid({bad_tokens, cu}, "tokens");
  bad_tokens[3] = -1;
  expect_invalid({bad_tokens, cu}, "tokens");
  expect_invalid({std::span<const std::int32_t>(), std::span<const std::int32_t>()}, "tokens");
  const std::vector<std::int32_t> short_cu{0, 5}, decreasing_cu{0, 4, 3, 6}, one_offset{0};
  expect_invalid({tokens, short_cu}, "cu_seqlens");
  expect_invalid({tokens, decreasing_cu}, "cu_seqlens");
  expect_invalid({tokens, one_offset}, "cu_seqlens");
  const std::vector<std::int32_t> bad_targets{1, 2, 3, -2, 0, 0}, short_targets{1, 2};
  expect_invalid({tokens, cu, bad_targets}, "targets");
  expect_invalid({tokens, cu, short_targets}, "targets");
  const std::vector<double> nan_weights{1, 1, std::nan(""), 1, 1, 1};
  expect_invalid({tokens, cu, {}, nan_weights}, "weights");

  // A parameter of the wrong shape or dtype is refused at bind(), naming it.
  Config other = config;
  other.intermediate_size += 1;
  ParamStore wrong_shape(other, DType::f32);
  EXPECT_THROW(model.bind(wrong_shape.params()), InvalidArgument);
  ParamStore wrong_dtype(config, DType::f64);
  try {
    model.bind(wrong_dtype.params());
    ADD_FAILURE() << "no error for float64 parameters in a float32 model";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("model.embed_tokens.weight"), std::string::npos) << e.what();
  }
  // An objective replaces the weights; both at once, or an empty function, are refused.
  const TokenObjective objective = [](std::int64_t, std::span<const double> lp, std::span<double> terms,
                                      std::span<double> derivatives) {
    for (std::size_t i = 0; i < lp.size(); ++i) terms[i] = derivatives[i] = 0;
  };
  const std::vector<double> weights(6, 0.1);
  expect_invalid({.tokens = tokens, .cu_seqlens = cu, .weights = weights, .objective = &objective}, "weights");
  const TokenObjective empty;
  expect_invalid({.tokens = tokens, .cu_seqlens = cu, .objective = &empty}, "objective");

  // Still bound to the good parameters: a forward and backward run.
  store.zero_grads();
  EXPECT_TRUE(std::isfinite(model.forward({tokens, cu})));
  model.backward();
}

// Projections whose weights do not lie side by side in memory (each parameter bound from a tensor of its own, as
// from another framework's) run one product each: the same loss and gradients as the stacked products the model
// runs over a ParamStore, whose projection weights are adjacent.
TEST_F(ModelTest, WeightsBoundFromSeparateTensorsGiveTheSameStep) {
  const Config config = small_config(false);
  ParamStore store(config, DType::f64);
  store.init(0.5, seed_);
  const std::vector<std::int32_t> cu{0, 6, 13};
  const std::vector<std::int32_t> tokens = testing::random_tokens(rng_, cu.back(), config.vocab_size);
  const std::vector<std::int32_t> targets = next_token_targets(tokens, cu);

  Model stacked(config, {.dtype = DType::f64});
  stacked.bind(store.params(), store.grads());
  store.zero_grads();
  const double loss = stacked.forward({tokens, cu, targets});
  stacked.backward();

  // One allocation per tensor, one element longer than the tensor, so that no two can be adjacent.
  std::map<std::string, std::vector<double>, std::less<>> params, grads;
  std::map<std::string, std::vector<std::int64_t>, std::less<>> shapes;
  for (const ParamInfo& info : param_infos(config)) {
    const TensorView v = store.params()(info.name);
    const double* values = static_cast<const double*>(v.data);
    params[info.name].assign(values, values + info.numel());
    params[info.name].push_back(0);
    grads[info.name].assign(info.numel() + 1, 0.0);
    shapes[info.name] = info.shape;
  }
  auto lookup = [&](std::map<std::string, std::vector<double>, std::less<>>& tensors) -> TensorLookup {
    return [&](std::string_view name) {
      double* data = tensors.find(name)->second.data();
      const std::vector<std::int64_t>& s = shapes.find(name)->second;
      if (s.size() == 1) return TensorView::contiguous(data, DType::f64, {s[0]});
      if (s.size() == 2) return TensorView::contiguous(data, DType::f64, {s[0], s[1]});
      return TensorView::contiguous(data, DType::f64, {s[0], s[1], s[2]});
    };
  };
  Model separate(config, {.dtype = DType::f64});
  separate.bind(lookup(params), lookup(grads));
  EXPECT_NEAR(separate.forward({tokens, cu, targets}), loss, 1e-12 * std::abs(loss));
  separate.backward();
  for (const ParamInfo& info : param_infos(config)) {
    const TensorView expected = store.grads()(info.name);
    const double* e = static_cast<const double*>(expected.data);
    double largest = 0, error = 0;
    for (std::int64_t i = 0; i < info.numel(); ++i) {
      largest = std::max(largest, std::abs(e[i]));
      error = std::max(error, std::abs(grads[info.name][i] - e[i]));
    }
    EXPECT_LE(error, 1e-10 * largest + 1e-300) << info.name;
  }
}

// loss_chunk 0 takes the device's default, the same loss and gradients as that chunk given explicitly; a
// negative chunk is refused by name.
TEST_F(ModelTest, LossChunkZeroIsTheDevicesDefault) {
  const Config config = small_config(false);
  const std::vector<std::int32_t> tokens = testing::random_tokens(rng_, 9, config.vocab_size);
  const std::vector<std::int32_t> cu{0, 4, 9};
  auto loss_and_grad = [&](std::int64_t chunk) {
    ParamStore store(config, DType::f64);
    store.init(0.5, seed_);
    Model model(config, {.dtype = DType::f64, .loss_chunk = chunk});
    model.bind(store.params(), store.grads());
    const double loss = model.forward({tokens, cu});
    model.backward();
    const TensorView g = store.grad("lm_head.weight");
    return std::pair{loss, std::vector<double>(g.ptr<double>(), g.ptr<double>() + g.numel())};
  };
  const std::int64_t cpu_default = default_loss_chunk(Device{});
  EXPECT_EQ(default_loss_chunk(Device{DeviceType::cuda, 0}) % cpu_default, 0);
  EXPECT_EQ(loss_and_grad(0), loss_and_grad(cpu_default));
  try {
    Model model(config, {.dtype = DType::f64, .loss_chunk = -1});
    ADD_FAILURE() << "loss_chunk -1 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "loss_chunk") << e.what();
  }
}

// A token objective (the RL losses') against a second algorithm: the objective's derivatives at the
// parameters' log-probabilities, computed by a separate forward, used as the weights of a plain weighted-NLL
// forward give the same gradient (d term / d logits = -weight * d nll / d logits). The objective here is
// nonlinear in logp, so a wrong chunk offset or a derivative applied with the wrong sign shows. Several
// chunks, a token without a target, two sequences.
TEST_F(ModelTest, TokenObjectiveGradientEqualsWeightsFromItsDerivatives) {
  const Config config = small_config(false);
  ParamStore store(config, DType::f64);
  store.init(0.5, seed_);
  Model model(config, {.dtype = DType::f64, .loss_chunk = 3});
  model.bind(store.params(), store.grads());
  const std::vector<std::int32_t> tokens = testing::random_tokens(rng_, 11, config.vocab_size);
  const std::vector<std::int32_t> cu{0, 5, 11};
  std::vector<std::int32_t> targets = next_token_targets(tokens, cu);
  targets[2] = -1;
  std::uniform_real_distribution<double> coefficient(-2, 2);
  std::vector<double> a(tokens.size()), b(tokens.size());
  for (std::size_t t = 0; t < tokens.size(); ++t) a[t] = coefficient(rng_), b[t] = coefficient(rng_);
  // term_t = a_t exp(logp_t) + b_t logp_t^2
  std::vector<std::int64_t> seen;
  const TokenObjective objective = [&](std::int64_t begin, std::span<const double> lp, std::span<double> terms,
                                       std::span<double> derivatives) {
    for (std::size_t i = 0; i < lp.size(); ++i) {
      const std::size_t t = static_cast<std::size_t>(begin) + i;
      seen.push_back(static_cast<std::int64_t>(t));
      if (targets[t] < 0) {
        terms[i] = derivatives[i] = 0;
        continue;
      }
      terms[i] = a[t] * std::exp(lp[i]) + b[t] * lp[i] * lp[i];
      derivatives[i] = a[t] * std::exp(lp[i]) + 2 * b[t] * lp[i];
    }
  };
  store.zero_grads();
  const double loss = model.forward({.tokens = tokens, .cu_seqlens = cu, .targets = targets, .objective = &objective});
  model.backward();
  std::vector<std::int64_t> every(tokens.size());
  for (std::size_t t = 0; t < every.size(); ++t) every[t] = static_cast<std::int64_t>(t);
  EXPECT_EQ(seen, every) << "the objective sees each token once, in order";
  const std::vector<double> objective_grads(store.grad_buffer().ptr<double>(),
                                            store.grad_buffer().ptr<double>() + store.numel());

  // The second algorithm: log-probabilities first, then the derivatives as weights of a weighted NLL.
  model.forward({tokens, cu, targets}, false);
  const std::vector<double> lp(model.token_logprobs().begin(), model.token_logprobs().end());
  std::vector<double> weights(tokens.size(), 0.0);
  double expected_loss = 0;
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    if (targets[t] < 0) continue;
    expected_loss += a[t] * std::exp(lp[t]) + b[t] * lp[t] * lp[t];
    weights[t] = -(a[t] * std::exp(lp[t]) + 2 * b[t] * lp[t]);
  }
  EXPECT_NEAR(loss, expected_loss, 1e-12 * (1 + std::abs(expected_loss)));
  store.zero_grads();
  model.forward({tokens, cu, targets, weights});
  model.backward();
  double largest = 0, difference = 0;
  for (std::int64_t i = 0; i < store.numel(); ++i) {
    largest = std::max(largest, std::abs(store.grad_buffer().ptr<double>()[i]));
    difference = std::max(difference, std::abs(store.grad_buffer().ptr<double>()[i] - objective_grads[i]));
  }
  EXPECT_GT(largest, 1e-3);
  EXPECT_LE(difference, 1e-12 * largest);
}

}  // namespace
}  // namespace deltatrain::model
