// The cpu backend (chunked, WY/UT) against the fp64 token-by-token reference on random problems:
// head dims, GVA ratios, lengths that do not fill a chunk, packed sequences (empty ones too), initial and
// final states, the in-kernel L2 norm, and every input dtype. Half-precision inputs are compared with the
// reference run on the same rounded values.
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "gdn_testing.h"

namespace deltatrain::gdn::testing {
namespace {

struct Shape {
  const char* name;
  Layout layout;
  bool l2norm, initial_state, final_state;
};

const Shape kShapes[] = {
    {"K64_single_token", {1, 1, 2, 2, 64, 64, {}}, false, true, true},
    {"K64_T63_GVA2", {2, 63, 1, 2, 64, 64, {}}, true, false, true},
    {"K128_T65_GVA4_l2norm", {1, 65, 1, 4, 128, 128, {}}, true, true, true},
    {"K256_T65", {1, 65, 1, 1, 256, 256, {}}, false, true, true},
    {"K64_V128_T130_GVA2", {1, 130, 2, 4, 64, 128, {}}, true, true, false},
    {"K128_V64_T130_no_states", {1, 130, 1, 1, 128, 64, {}}, false, false, false},
    {"varlen_with_empty_sequences", packed({0, 63, 0, 70, 1, 65}, 1, 2, 64, 64), true, true, true},
    // The L2 norm's backward removes the gradient's component along a row: for K = 1 that is all of it
    // but eps, and for K = 2 nearly so; the subtraction must not cancel.
    {"K1_l2norm", {1, 70, 1, 2, 1, 16, {}}, true, true, true},
    {"K2_l2norm", {2, 33, 2, 2, 2, 8, {}}, true, false, true},
    // Head dims of fla's tests (60, 100) and others up to 256, K and V unequal.
    {"K60_V100_GVA2_l2norm", {1, 130, 1, 2, 60, 100, {}}, true, true, true},
    {"K100_V60_varlen", packed({65, 0, 3}, 1, 1, 100, 60), true, true, true},
    {"K16_V200", {2, 65, 1, 1, 16, 200, {}}, false, true, true},
    {"K200_V16_no_states", {1, 70, 2, 2, 200, 16, {}}, true, false, false},
    {"K256_V128", {1, 66, 1, 1, 256, 128, {}}, true, true, true},
};

struct Precision {
  const char* name;
  DType io, gate;
};

const Precision kPrecisions[] = {
    {"f64", DType::f64, DType::f64},   {"f32", DType::f32, DType::f32},   {"bf16", DType::bf16, DType::f32},
    {"bf16_gates_bf16", DType::bf16, DType::bf16}, {"f16", DType::f16, DType::f32},
};

void PrintTo(const Shape& shape, std::ostream* os) { *os << shape.name; }
void PrintTo(const Precision& precision, std::ostream* os) { *os << precision.name; }

class CpuMatchesReference : public SeededTest, public ::testing::WithParamInterface<std::tuple<Shape, Precision>> {};

TEST_P(CpuMatchesReference, ForwardAndBackward) {
  const auto& [shape, precision] = GetParam();
  const Sample sample =
      random_sample(shape.layout, precision.io, precision.gate, shape.l2norm, shape.initial_state, rng_);
  const Cotangents cotangents = random_cotangents(sample, shape.final_state, rng_);
  const double tol = tolerance(precision.io);
  const RunOptions cpu{"cpu", false, shape.final_state, 0}, reference{"reference", false, shape.final_state, 0};

  const ForwardResult got = run_forward(sample, cpu);
  const ForwardResult want = run_forward(as_float64(sample), reference);
  EXPECT_TRUE(close("o", got.o.values(), want.o.values(), tol));
  if (shape.final_state) {
    EXPECT_TRUE(close("final_state", got.ht.values(), want.ht.values(), tol));
  }

  const BackwardResult grads = run_backward(sample, cotangents, cpu);
  const BackwardResult exact = run_backward(as_float64(sample), cotangents, reference);
  EXPECT_TRUE(close("dq", grads.dq.values(), exact.dq.values(), tol));
  EXPECT_TRUE(close("dk", grads.dk.values(), exact.dk.values(), tol));
  EXPECT_TRUE(close("dv", grads.dv.values(), exact.dv.values(), tol));
  EXPECT_TRUE(close("dg", grads.dg.values(), exact.dg.values(), tol));
  EXPECT_TRUE(close("dbeta", grads.dbeta.values(), exact.dbeta.values(), tol));
  if (shape.initial_state) {
    EXPECT_TRUE(close("dh0", grads.dh0.values(), exact.dh0.values(), tol));
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, CpuMatchesReference,
                         ::testing::Combine(::testing::ValuesIn(kShapes), ::testing::ValuesIn(kPrecisions)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" + std::get<1>(info.param).name;
                         });

// Decay at the extremes: g = -20 (the state forgets within a token; exp(cumsum) underflows across a chunk),
// g = 0 (no forgetting at all), and the two mixed token by token; g = -inf (a full reset of the state:
// the chunk's cumulative sums are -inf from there on, and exp(-inf - -inf) would be NaN) and g = -1e4
// (sums so large that the small gates after them round away) mixed with ordinary gates.
struct Decay {
  const char* name;
  double lo, hi;  // g drawn from {lo, hi} with equal odds
};

constexpr double kInfinity = std::numeric_limits<double>::infinity();

void PrintTo(const Decay& decay, std::ostream* os) { *os << decay.name; }

class ExtremeDecay : public SeededTest, public ::testing::WithParamInterface<std::tuple<Decay, DType>> {};

TEST_P(ExtremeDecay, StaysFiniteAndAccurate) {
  const auto& [decay, io] = GetParam();
  Sample sample = random_sample(packed({130, 64, 7}, 2, 4, 64, 64), io, io == DType::f64 ? io : DType::f32, true,
                                true, rng_);
  std::bernoulli_distribution coin(0.5);
  for (double& g : sample.g) g = coin(rng_) ? decay.lo : decay.hi;
  const Cotangents cotangents = random_cotangents(sample, true, rng_);
  const double tol = tolerance(io);
  const RunOptions cpu{"cpu", false, true, 0}, reference{"reference", false, true, 0};

  const ForwardResult got = run_forward(sample, cpu), want = run_forward(as_float64(sample), reference);
  EXPECT_TRUE(all_finite("o", got.o.values()));
  EXPECT_TRUE(close("o", got.o.values(), want.o.values(), tol));
  EXPECT_TRUE(close("final_state", got.ht.values(), want.ht.values(), tol));

  const BackwardResult grads = run_backward(sample, cotangents, cpu);
  const BackwardResult exact = run_backward(as_float64(sample), cotangents, reference);
  for (const auto& [name, actual, expected] :
       {std::tuple{"dq", &grads.dq, &exact.dq}, {"dk", &grads.dk, &exact.dk}, {"dv", &grads.dv, &exact.dv},
        {"dg", &grads.dg, &exact.dg}, {"dbeta", &grads.dbeta, &exact.dbeta}, {"dh0", &grads.dh0, &exact.dh0}}) {
    EXPECT_TRUE(all_finite(name, actual->values()));
    EXPECT_TRUE(close(name, actual->values(), expected->values(), tol));
  }
}

INSTANTIATE_TEST_SUITE_P(Gates, ExtremeDecay,
                         ::testing::Combine(::testing::Values(Decay{"strong", -20, -20}, Decay{"none", 0, 0},
                                                              Decay{"strong_or_none", -20, 0},
                                                              Decay{"reset_or_weak", -kInfinity, -0.05},
                                                              Decay{"reset", -kInfinity, -kInfinity},
                                                              Decay{"huge_or_weak", -1e4, -0.05}),
                                            ::testing::Values(DType::f32, DType::f64)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace deltatrain::gdn::testing
