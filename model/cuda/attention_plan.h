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
  bool cudnn_allowed = true;     // DELTATRAIN_CUDNN_ATTENTION is not 0 (cudnn_attention_allowed_by)
  int head_dim = 0;
  bool rows_aligned = false;     // every matrix's base and row stride are 16-byte aligned (8 bfloat16)
};

AttentionKernels plan_attention(const AttentionPlanInputs& in);

// What DELTATRAIN_CUDNN_ATTENTION's value allows: unset (null), empty or "1" lets cuDNN run where it applies;
// "0" keeps the unfused kernels (to compare the two, or where the installed cuDNN refuses the graphs).
// Anything else is an InvalidArgument naming the variable.
bool cudnn_attention_allowed_by(const char* value);

}  // namespace deltatrain::model::cuda
