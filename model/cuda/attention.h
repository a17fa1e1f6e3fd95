// Causal GQA attention over packed sequences, unfused: for each sequence and kv head, cuBLASLt products
// for the scores and the outputs around row kernels for the softmax (attention_kernels.cu). Its memory is
// quadratic in the longest sequence (its [group * L, L] scores in float32 and probabilities in bfloat16, in
// the workspace). cuDNN's fused attention (cudnn_attention.h) runs instead wherever attention_plan.h allows;
// this path covers the rest: builds without cuDNN (the portable wheel), head dims it does not take, and
// DELTATRAIN_CUDNN_ATTENTION=0.
#pragma once

#include <cstdint>
#include <span>

#include "gemm.h"
#include "kernels.h"

namespace deltatrain::model::cuda {

struct AttentionShape {
  int q_heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 0.f;
};

// The longest sequence of packed cu_seqlens (host values).
Index longest_sequence(std::span<const std::int32_t> cu_seqlens);

// q, o [T, Hq * D]; k, v [T, Hkv * D]; lse [Hq, T] float32; cu_seqlens on the host (the launches' plan).
// The shape is shared with cudnn_attention.h.
void unfused_attention_forward(Gemm& gemm, Workspace& workspace, Matrix o, Matrix lse, Matrix q, Matrix k,
                               Matrix v, AttentionShape shape, std::span<const std::int32_t> cu_seqlens,
                               cudaStream_t stream);
void unfused_attention_backward(Gemm& gemm, Workspace& workspace, Matrix dq, Matrix dk, Matrix dv, Matrix dout,
                                Matrix q, Matrix k, Matrix v, Matrix o, Matrix lse, AttentionShape shape,
                                std::span<const std::int32_t> cu_seqlens, cudaStream_t stream);

}  // namespace deltatrain::model::cuda
