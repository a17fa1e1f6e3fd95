// The whole model on the CPU: the checks of check.h (its forward against an independent float64 evaluation,
// its backward against central finite differences, packing, determinism, save/load) on a small hybrid and
// on the tiny preset, and the errors bad input gets. Fresh random weights and tokens each run; a failure
// prints the seed and DELTATRAIN_TEST_SEED=<seed> replays it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>

#include "deltatrain/core/error.h"
#include "deltatrain/model/check.h"
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

TEST_P(ModelChecks, PassOnASmallHybrid) { expect_all_pass(small_config(GetParam()), {}); }

INSTANTIATE_TEST_SUITE_P(Embeddings, ModelChecks, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "tied" : "untied"; });

// The tiny preset itself: GDN and attention head dims 64, a 4096-token vocabulary.
TEST_F(ModelTest, ChecksPassOnTheTinyPreset) { expect_all_pass(preset("tiny"), {.gradient_samples = 1}); }

// The forward check is not satisfied by any model: the same weights and tokens through a different function
// (RoPE's theta doubled in the model but not in the reference) fail it.
TEST_F(ModelTest, ForwardCheckFailsForAnotherFunction) {
  const Config config = small_config(true);
  EXPECT_TRUE(detail::forward_check_with_reference_config(config, config, seed_).pass());
  Config other = config;
  other.rope_theta *= 2;
  EXPECT_FALSE(detail::forward_check_with_reference_config(other, config, seed_).pass());
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
  // Still bound to the good parameters: a forward and backward run.
  store.zero_grads();
  EXPECT_TRUE(std::isfinite(model.forward({tokens, cu})));
  model.backward();
}

}  // namespace
}  // namespace deltatrain::model
