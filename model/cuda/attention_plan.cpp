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

CachedAttentionPlan plan_cached_attention(int group, int head_dim, bool rows_aligned) {
  const auto largest_dividing = [&](std::initializer_list<int> choices, int most) {
    for (const int heads : choices) {
      if (group % heads == 0 && heads <= most) return heads;
    }
    return 1;
  };
  if (rows_aligned && (head_dim == 64 || head_dim == 128 || head_dim == 256))
    return {true, largest_dividing({8, 4, 2}, 8)};
  const int chunks = (head_dim + 255) / 256;
  return {false, largest_dividing({4, 2}, 4 / chunks)};
}

bool fuse_attention_inputs(int q_heads, int kv_heads, int head_dim, int rotary_dim, bool rows_aligned) {
  return rows_aligned && head_dim % 8 == 0 && head_dim <= 256 && rotary_dim % 16 == 0 && q_heads + kv_heads <= 32;
}

}  // namespace deltatrain::model::cuda
