// The model's correctness checks on the CPU, against independent references, on random weights and tokens:
// what `deltatrain model check` runs for a user and what the test suite asserts.
//
//   forward_float64    the loss and every logit against an independent float64 evaluation (the GDN layer by
//                      its token recurrence, attention by a direct softmax per query, plain dot products)
//   forward_float32    the same in float32, each token's error against its float32-roundoff sensitivity
//   gradients          d loss / d parameter against central finite differences (Richardson-extrapolated),
//                      a few elements of every tensor, in float64
//   packing            a packed batch gives each sequence what it gives alone
//   determinism        bitwise the same loss and gradients with 1 and 2 threads and with recomputation
//   save_load          HF safetensors save and load round-trips every parameter bitwise
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "deltatrain/core/tensor.h"
#include "deltatrain/model/config.h"

namespace deltatrain::model {

struct CheckResult {
  std::string name;
  double error = 0;      // the largest relative error seen (0 for a bitwise check that holds)
  double tolerance = 0;  // what passes
  std::string detail;    // where the largest error was, or what differed
  bool pass() const { return error <= tolerance; }
};

struct CheckOptions {
  std::uint64_t seed = 0;
  std::vector<std::int32_t> sequence_lengths = {70, 1, 13};  // one longer than a GDN chunk, one of one token
  int gradient_samples = 3;  // elements per parameter tensor for finite differences
};

// Every check above, in order. Weights are random (norms included), drawn from `seed`.
std::vector<CheckResult> run_model_checks(const Config& config, const CheckOptions& options = {});

namespace detail {
// The forward check (float64 or float32) with the reference evaluating `reference_config` (same shapes) while the
// model runs `model_config`: how the tests show that the check fails for a model computing another function.
CheckResult forward_check_with_reference_config(const Config& model_config, const Config& reference_config,
                                                std::uint64_t seed, DType dtype = DType::f64);
}  // namespace detail

}  // namespace deltatrain::model
