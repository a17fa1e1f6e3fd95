// Which kernels run the model's causal attention over packed sequences (training forward and backward, prefill):
// the one decision, made here from the call's shape and settings, so cuda_ops.cpp only dispatches on it.
// Plain C++ (no CUDA types), so it is tested on machines without a GPU.
#pragma once

namespace deltatrain::model::cuda {

enum class AttentionKernels {
  rows,     // decode's kernel over the batch's own keys, one query row at a time (batch-invariant forward)
  cudnn,    // cuDNN's fused flash attention (cudnn_attention.h): memory linear in the sequence length
  unfused,  // cuBLASLt products around softmax kernels (attention.h): any head dim, T^2 scratch
};

struct AttentionPlanInputs {
  bool backward = false;
  bool batch_invariant = false;  // ModelOptions::batch_invariant: the forward must not depend on the batch
  bool cudnn_built = false;      // this build has cuDNN and its frontend (DELTATRAIN_WITH_CUDNN)
  bool cudnn_allowed = true;     // DELTATRAIN_CUDNN_ATTENTION is not 0 (core/system.h's switch_setting)
  int head_dim = 0;
  bool rows_aligned = false;     // every matrix's base and row stride are 16-byte aligned (8 bfloat16)
};

AttentionKernels plan_attention(const AttentionPlanInputs& in);

// Which kernel runs decode's cached attention (and the `rows` kernels), and how many query heads one CTA of it
// serves: they share a key/value head, so the CTA reads each cached row once for all of them.
// - tensor_cores (head dims 64, 128 and 256 with 16-byte aligned rows): mma m16n8k16 with the heads as its N of 8,
//   so up to 8 heads a CTA: the largest of 8, 4, 2, 1 dividing the GQA group (q heads / kv heads).
// - otherwise the warp kernel (one key a warp step, any head dim up to kMaxCachedHeadDim): the largest of 4, 2, 1
//   dividing the group, with at most 4 heads x 256-element chunks of the head held per lane (the registers of
//   512 threads, one CTA an SM).
// A row's result depends on this choice (the order of its sums), so it depends only on the model's shape and
// its tensors' alignment, never on the batch.
struct CachedAttentionPlan {
  bool tensor_cores = false;
  int heads = 1;
};
CachedAttentionPlan plan_cached_attention(int group, int head_dim, bool rows_aligned);

// Whether decode's attention inputs (ops.h's attention_inputs_step) run as one kernel: a warp a head, 8 elements a
// lane in 16-byte accesses (head dims up to 256, a multiple of 8, rows 16-byte aligned), RoPE's pairs a whole
// number of lanes apart (rotary_dim a multiple of 16), every head of a row in one CTA (q_heads + kv_heads <= 32).
// Otherwise the operations run one by one (Ops' default): the same bits either way.
bool fuse_attention_inputs(int q_heads, int kv_heads, int head_dim, int rotary_dim, bool rows_aligned);

}  // namespace deltatrain::model::cuda
