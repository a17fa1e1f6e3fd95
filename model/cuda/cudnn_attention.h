// Causal GQA attention over packed sequences by cuDNN's fused flash attention (SDPA graphs built with
// cudnn-frontend), forward and backward: the packed rows [T, H * D] are cuDNN's ragged THD layout, each
// sequence's start an element offset (ragged_offsets in attention_kernels.cu makes them on the device from
// cu_seqlens), its length a padding mask. Memory is linear in the sequence length, unlike attention.h's
// unfused products. The backward runs cuDNN's deterministic algorithm (the model's gradients are bitwise
// reproducible) unless constructed otherwise (bench/gpu/attention_benchmark.cpp measures what it costs). lse
// keeps ops.h's [Hq, T] layout; cuDNN's own [batch, Hq, length] statistics are moved to and from it.
//
// Graphs are built once per shape and kept: batches padded to a power of two sequences (the extra ones
// empty) and lengths to a power of two of at least 64, so the shapes a run sees reuse a few graphs.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "attention.h"
#include "kernels.h"

namespace deltatrain::model::cuda {

// cuDNN's two backward algorithms: deterministic (the same bits every run; on Hopper dP through a workspace and dQ
// by a separate product) and atomic (dQ accumulated by atomics, faster, its bits varying from run to run).
enum class AttentionBackward { deterministic, atomic };

class CudnnAttention {
 public:
  // Whether this build has cuDNN and its frontend (DELTATRAIN_WITH_CUDNN); without them the constructor
  // throws Unavailable (cudnn_attention_not_built.cpp).
  static bool built();
  // The cuDNN handle (on the current device); Unavailable if cuDNN cannot be loaded.
  explicit CudnnAttention(AttentionBackward backward = AttentionBackward::deterministic);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // As attention.h's attention_forward and attention_backward; `sequences` is cu_seqlens on the device.
  void forward(Workspace& workspace, Matrix o, Matrix lse, Matrix q, Matrix k, Matrix v, AttentionShape shape,
               std::span<const std::int32_t> cu_seqlens, Sequences sequences, cudaStream_t stream);
  void backward(Workspace& workspace, Matrix dq, Matrix dk, Matrix dv, Matrix dout, Matrix q, Matrix k, Matrix v,
                Matrix o, Matrix lse, AttentionShape shape, std::span<const std::int32_t> cu_seqlens,
                Sequences sequences, cudaStream_t stream);

 private:
  struct Graphs;
  std::unique_ptr<Graphs> graphs_;
};

}  // namespace deltatrain::model::cuda
