#include "norm_plan.h"

namespace deltatrain::model::cuda {

NormRowPlan plan_norm_row(std::int64_t cols) {
  const int lanes = cols <= 16 * kNormVector ? 16 : 32;
  for (int steps = 1; steps <= kNormMaxHeldSteps; steps *= 2)
    if (cols <= std::int64_t{steps} * lanes * kNormVector) return {lanes, steps};
  return {lanes, 0};
}

}  // namespace deltatrain::model::cuda
