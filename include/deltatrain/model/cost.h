// The model's arithmetic per token, for MFU: floating-point operations (FLOP = 2 x multiply-accumulate) of
// one token in a sequence of seq_len tokens, by part.
//
//   matmul     the projections of every layer (GDN in/out projections, attention q/k/v/o, MLP): 2 FLOP per
//              weight element in the forward, twice that in the backward (input and weight gradients).
//              Not counted: the embedding lookup, norms, the depthwise conv1d, gates, RoPE, activations.
//   lm_head    2 * vocab * hidden forward (tied or not), x3 for training.
//   attention  QK^T and PV of causal softmax attention over the average causal context (seq_len + 1) / 2,
//              per full-attention layer; the backward counts 2.5x the forward (FlashAttention's count).
//   gdn        the GDN operator per linear-attention layer and value head, FLOP model of docs/gdn-algorithm.md §6
//              (chunk C = 64, dense as fla executes it).
#pragma once

#include <cstdint>

#include "deltatrain/model/config.h"

namespace deltatrain::model {

struct TokenFlops {
  double matmul = 0;
  double attention = 0;
  double gdn = 0;
  double lm_head = 0;
  double total() const { return matmul + attention + gdn + lm_head; }
};

// One forward. InvalidArgument for seq_len < 1 or an invalid config.
TokenFlops forward_flops_per_token(const Config& config, std::int64_t seq_len);
// Forward + backward (a training step without recomputation).
TokenFlops training_flops_per_token(const Config& config, std::int64_t seq_len);

// The GDN operator's FLOPs per token and value head (docs/gdn-algorithm.md §6, chunk 64): forward
// 2(3CK + 2CV + 3KV) + (2/3)C^2, backward 18CK + 10CV + 16KV + 4C^2 (182,955 and 507,904 at K = V = 128).
double gdn_forward_flops_per_token_head(std::int64_t key_dim, std::int64_t value_dim);
double gdn_backward_flops_per_token_head(std::int64_t key_dim, std::int64_t value_dim);

}  // namespace deltatrain::model
