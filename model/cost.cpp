#include "deltatrain/model/cost.h"

#include "deltatrain/core/error.h"

namespace deltatrain::model {

namespace {

constexpr double kGdnChunk = 64;

// FlashAttention counts its backward as 2.5 forwards: it runs five products of the forward's size (S = QK^T
// recomputed, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q) against the forward's two (QK^T, PV).
constexpr double kAttentionBackwardRatio = 2.5;
// A linear layer's backward forms the input gradient and the weight gradient: two products of the forward's size.
constexpr double kMatmulBackwardRatio = 2.0;

void check_seq_len(std::int64_t seq_len) {
  if (seq_len < 1) throw InvalidArgument("seq_len", "must be at least 1; got " + std::to_string(seq_len));
}

}  // namespace

double gdn_forward_flops_per_token_head(std::int64_t key_dim, std::int64_t value_dim) {
  const double C = kGdnChunk, K = static_cast<double>(key_dim), V = static_cast<double>(value_dim);
  return 2 * (3 * C * K + 2 * C * V + 3 * K * V) + 2.0 / 3.0 * C * C;
}

double gdn_backward_flops_per_token_head(std::int64_t key_dim, std::int64_t value_dim) {
  const double C = kGdnChunk, K = static_cast<double>(key_dim), V = static_cast<double>(value_dim);
  return 18 * C * K + 10 * C * V + 16 * K * V + 4 * C * C;
}

TokenFlops forward_flops_per_token(const Config& config, std::int64_t seq_len) {
  check_seq_len(seq_len);
  validate(config);
  const double hidden = static_cast<double>(config.hidden_size);
  const double q_dim = static_cast<double>(config.num_attention_heads) * config.head_dim;
  const double kv_dim = static_cast<double>(config.num_key_value_heads) * config.head_dim;
  const double nv = config.linear_num_value_heads;
  const double gdn_weights = hidden * (static_cast<double>(config.linear_conv_dim()) +   // in_proj_qkv
                                       static_cast<double>(config.linear_value_dim()) +  // in_proj_z
                                       2 * nv) +                                         // in_proj_b, in_proj_a
                             static_cast<double>(config.linear_value_dim()) * hidden;    // out_proj
  const double attention_weights = hidden * (2 * q_dim + 2 * kv_dim) + q_dim * hidden;   // q (+gate), k, v; o
  const double mlp_weights = 3 * hidden * static_cast<double>(config.intermediate_size);
  const double context = (static_cast<double>(seq_len) + 1) / 2;  // keys a query sees, on average

  TokenFlops flops;
  for (LayerKind kind : config.layer_types) {
    if (kind == LayerKind::linear_attention) {
      flops.matmul += 2 * (gdn_weights + mlp_weights);
      flops.gdn += nv * gdn_forward_flops_per_token_head(config.linear_key_head_dim, config.linear_value_head_dim);
    } else {
      flops.matmul += 2 * (attention_weights + mlp_weights);
      flops.attention += 2 * 2 * q_dim * context;  // QK^T and PV, per query head over head_dim
    }
  }
  flops.lm_head = 2 * static_cast<double>(config.vocab_size) * hidden;
  return flops;
}

TokenFlops training_flops_per_token(const Config& config, std::int64_t seq_len) {
  TokenFlops flops = forward_flops_per_token(config, seq_len);
  flops.matmul *= 1 + kMatmulBackwardRatio;
  flops.lm_head *= 1 + kMatmulBackwardRatio;
  flops.attention *= 1 + kAttentionBackwardRatio;
  double gdn_backward = 0;
  for (LayerKind kind : config.layer_types) {
    if (kind == LayerKind::linear_attention) {
      gdn_backward += config.linear_num_value_heads *
                      gdn_backward_flops_per_token_head(config.linear_key_head_dim, config.linear_value_head_dim);
    }
  }
  flops.gdn += gdn_backward;
  return flops;
}

}  // namespace deltatrain::model
