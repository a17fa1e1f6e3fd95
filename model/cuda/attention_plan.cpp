#include "attention_plan.h"

#include <initializer_list>

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

int cached_attention_heads(int group, int head_dim) {
  const int chunks = (head_dim + 255) / 256;
  for (const int heads : {4, 2}) {
    if (group % heads == 0 && heads * chunks <= 4) return heads;
  }
  return 1;
}

}  // namespace deltatrain::model::cuda
