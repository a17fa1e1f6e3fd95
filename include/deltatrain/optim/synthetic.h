// The built-in synthetic problem of `deltatrain optim demo` and of the optimizer's tests: a two-layer
// tanh MLP regressing fixed targets from fixed inputs (one seed), trained full-batch. Each rank takes
// a fixed slice of the fixed global batch and the optimizer averages the slices' gradients, so runs
// at different rank counts differ only by the order of floating-point sums.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

#include "deltatrain/comm/group.h"
#include "deltatrain/optim/adamw.h"
#include "deltatrain/optim/digest.h"
#include "deltatrain/optim/layout.h"

namespace deltatrain::optim {

struct SyntheticConfig {
  int inputs = 16;
  int hidden = 32;
  int outputs = 4;
  int batch = 96;  // divisible by 1, 2, 3, 4, 6, 8, ... ranks
  std::uint64_t seed = 20261130;
  DType dtype = DType::f32;  // of the model parameters
};

class SyntheticRegression {
 public:
  explicit SyntheticRegression(const SyntheticConfig& config = {});

  std::vector<ParamSpec> params() const;
  // Writes the seeded initial weights (the same on every rank) and makes them the optimizer's start.
  void initialize(DistributedAdamW& optimizer) const;
  // Mean loss over this rank's slice; writes the slice's mean gradient into the optimizer's gradients.
  double forward_backward(DistributedAdamW& optimizer) const;
  // Mean loss over the whole batch at the current parameters. Collective.
  double loss(const DistributedAdamW& optimizer) const;

 private:
  struct Weights;
  Weights read_weights(const DistributedAdamW& optimizer) const;
  std::pair<int, int> slice(const comm::Group& group) const;
  double evaluate(const Weights& w, int first, int last, Weights* grad) const;

  SyntheticConfig config_;
  std::vector<float> inputs_;   // [batch, inputs]
  std::vector<float> targets_;  // [batch, outputs]
};

struct DemoOptions {
  std::int64_t steps = 0;
  std::int64_t save_at = -1;  // save when the optimizer's step reaches this; -1: never
  std::filesystem::path checkpoint_root;
  std::filesystem::path resume_from;  // empty: start from the seeded weights
  SyntheticConfig problem;
  AdamWConfig adamw{1e-2, 0.9, 0.999, 1e-8, 0.01, 1.0};
  LayoutOptions layout{64, 512};  // small buckets, so that the demo has several
};

struct DemoResult {
  std::int64_t step = 0;
  double loss = 0;  // at the final parameters
  StateDigest digest;
  std::filesystem::path saved;  // the checkpoint written, if any
};

// Builds the optimizer on `group`, starts (or resumes), trains `steps` steps, saving at `save_at`.
// InvalidArgument naming save-at when the run does not reach that step (it would never save). Collective.
DemoResult run_demo(comm::Group& group, const DemoOptions& options, void* stream = nullptr);

}  // namespace deltatrain::optim
