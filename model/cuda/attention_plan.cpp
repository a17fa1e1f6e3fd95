#include "attention_plan.h"

#include <string>

#include "deltatrain/core/error.h"

namespace deltatrain::model::cuda {

AttentionKernels plan_attention(const AttentionPlanInputs& in) {
  // The backward needs no batch invariance (only log-probabilities are compared with the rollout's), so it
  // takes the fastest kernels whatever the forward ran; both read and write lse in ops.h's [Hq, T] layout.
  if (in.batch_invariant && !in.backward) return AttentionKernels::rows;
  // cuDNN's Hopper and Ampere flash kernels take head dims that are multiples of 8 up to 256, with
  // 16-byte aligned rows.
  const bool cudnn_applies = in.head_dim > 0 && in.head_dim <= 256 && in.head_dim % 8 == 0 && in.rows_aligned;
  if (in.cudnn_built && in.cudnn_allowed && cudnn_applies) return AttentionKernels::cudnn;
  return AttentionKernels::unfused;
}

bool cudnn_attention_allowed_by(const char* value) {
  if (value == nullptr) return true;
  const std::string setting(value);
  if (setting.empty() || setting == "1") return true;
  if (setting == "0") return false;
  throw InvalidArgument("DELTATRAIN_CUDNN_ATTENTION", "must be 0 or 1 (or unset), got '" + setting + "'");
}

}  // namespace deltatrain::model::cuda
