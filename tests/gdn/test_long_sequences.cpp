// A sequence longer than the cpu backward's replay cache (64 MiB of chunk intermediates per thread):
// the chunks past the cache are recomputed in the reverse pass, and must give the same gradients.
// float64 with K = V = 256 has the largest chunks (about 1.2 MB), so 3700 tokens overflow the cache.
#include "gdn_testing.h"

namespace deltatrain::gdn::testing {
namespace {

class LongSequence : public SeededTest {};

TEST_F(LongSequence, BackwardPastTheReplayCacheMatchesReference) {
  const Layout layout = packed({3700, 5}, 1, 1, 256, 256);
  const Sample sample = random_sample(layout, DType::f64, DType::f64, true, true, rng_);
  const Cotangents cotangents = random_cotangents(sample, true, rng_);
  const RunOptions cpu{"cpu", false, true, 0}, reference{"reference", false, true, 0};
  const BackwardResult got = run_backward(sample, cotangents, cpu);
  const BackwardResult want = run_backward(sample, cotangents, reference);
  const double tol = tolerance(DType::f64);
  EXPECT_TRUE(close("dq", got.dq.values(), want.dq.values(), tol));
  EXPECT_TRUE(close("dk", got.dk.values(), want.dk.values(), tol));
  EXPECT_TRUE(close("dv", got.dv.values(), want.dv.values(), tol));
  EXPECT_TRUE(close("dg", got.dg.values(), want.dg.values(), tol));
  EXPECT_TRUE(close("dbeta", got.dbeta.values(), want.dbeta.values(), tol));
  EXPECT_TRUE(close("dh0", got.dh0.values(), want.dh0.values(), tol));
}

}  // namespace
}  // namespace deltatrain::gdn::testing
