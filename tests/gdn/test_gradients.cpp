// Backward passes against central finite differences of the forward, in fp64, for every input (q, k, v,
// g, beta, initial_state), with and without the in-kernel L2 norm, batched and packed: the reference's
// exact reverse mode is checked here, independently of any other backend, and so is the cpu backend's.
#include <string>
#include <tuple>
#include <vector>

#include "gdn_testing.h"

namespace deltatrain::gdn::testing {
namespace {

struct SmallLayout {
  const char* name;
  Layout layout;
};

const SmallLayout kLayouts[] = {
    {"batched", {2, 5, 2, 4, 8, 4, {}}},
    {"packed_with_empty", packed({3, 0, 4}, 1, 2, 8, 4)},
    {"packed_across_a_chunk", packed({70, 3}, 1, 2, 8, 4)},
};

class GradientsMatchFiniteDifferences
    : public SeededTest,
      public ::testing::WithParamInterface<std::tuple<std::string, SmallLayout, bool>> {};

TEST_P(GradientsMatchFiniteDifferences, EveryInput) {
  const auto& [backend, small, l2norm] = GetParam();
  Sample sample = random_sample(small.layout, DType::f64, DType::f64, l2norm, true, rng_);
  const Cotangents cotangents = random_cotangents(sample, true, rng_);
  const RunOptions options{backend, false, true, 0};

  // L = <do, o> + <dht, final_state>, whose gradient the backward computes.
  const auto loss = [&](const Sample& s) {
    const ForwardResult r = run_forward(s, options);
    const std::vector<double> o = r.o.values(), ht = r.ht.values();
    double sum = 0;
    for (std::size_t i = 0; i < o.size(); ++i) sum += cotangents.d_o[i] * o[i];
    for (std::size_t i = 0; i < ht.size(); ++i) sum += cotangents.dht[i] * ht[i];
    return sum;
  };
  const BackwardResult analytic = run_backward(sample, cotangents, options);

  constexpr double kStep = 1e-6;
  for (const auto& [name, input, gradient] :
       {std::tuple{"dq", &Sample::q, &analytic.dq}, {"dk", &Sample::k, &analytic.dk}, {"dv", &Sample::v, &analytic.dv},
        {"dg", &Sample::g, &analytic.dg}, {"dbeta", &Sample::beta, &analytic.dbeta},
        {"dh0", &Sample::h0, &analytic.dh0}}) {
    std::vector<double>& values = sample.*input;
    std::vector<double> numeric(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
      const double saved = values[i];
      values[i] = saved + kStep;
      const double up = loss(sample);
      values[i] = saved - kStep;
      const double down = loss(sample);
      values[i] = saved;
      numeric[i] = (up - down) / (2 * kStep);
    }
    EXPECT_TRUE(close(name, gradient->values(), numeric, 1e-7));
  }
}

INSTANTIATE_TEST_SUITE_P(Fp64, GradientsMatchFiniteDifferences,
                         ::testing::Combine(::testing::Values("reference", "cpu"), ::testing::ValuesIn(kLayouts),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::get<1>(info.param).name +
                                  (std::get<2>(info.param) ? "_l2norm" : "");
                         });

}  // namespace
}  // namespace deltatrain::gdn::testing
