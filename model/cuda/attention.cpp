// Per sequence [s, s + L) and kv head, the group's G = Hq / Hkv query heads are gathered into one
// contiguous [G * L, D] block, so each product is a single cuBLASLt call over the whole group:
//   forward   S = scale Q K^T [G L, L] (float32);  P, lse = causal softmax(S);  O = P V
//   backward  S again;  P = exp(S - lse);  dV = P^T dO;  dP = dO V^T;  dS = P (dP - delta)
//             (delta = rowsum(dO * O));  dK = scale dS^T Q;  dQ = scale dS K
// dK and dV sum the group's heads inside one product (the heads are its inner dimension), so they are
// deterministic. P and dS are rounded to bfloat16 for the products, as fused kernels do.
#include "attention.h"

#include <algorithm>

namespace deltatrain::model::cuda {
namespace {

// A view of rows [s, s + L) and columns from `column` (bfloat16 elements) of m.
Matrix block(const Matrix& m, Index s, Index L, Index column, Index cols) {
  return {static_cast<std::byte*>(m.data) + (s * m.ld + column) * 2, L, cols, m.ld};
}

ScoreRows score_rows(const Matrix& lse, Index s, Index L, int first_head, int groups) {
  return {L, groups, static_cast<float*>(lse.data) + first_head * lse.ld + s, lse.ld};
}

}  // namespace

Index longest_sequence(std::span<const std::int32_t> cu) {
  Index length = 0;
  for (std::size_t n = 0; n + 1 < cu.size(); ++n) length = std::max<Index>(length, cu[n + 1] - cu[n]);
  return length;
}

void unfused_attention_forward(Gemm& gemm, Workspace& workspace, Matrix o, Matrix lse, Matrix q, Matrix k,
                               Matrix v, AttentionShape shape, std::span<const std::int32_t> cu,
                               cudaStream_t stream) {
  const int G = shape.q_heads / shape.kv_heads, D = shape.head_dim;
  const Index max_length = longest_sequence(cu);
  Carver plan;
  plan.add<float>(G * max_length * max_length);
  plan.add<std::uint16_t>(G * max_length * max_length);
  plan.add<std::uint16_t>(G * max_length * D);
  Carver carve(workspace.reserve(plan.bytes()));
  auto* scores = carve.take<float>(G * max_length * max_length);
  auto* probabilities = carve.take<std::uint16_t>(G * max_length * max_length);
  auto* heads = carve.take<std::uint16_t>(G * max_length * D);  // the group's queries, then its outputs

  for (std::size_t n = 0; n + 1 < cu.size(); ++n) {
    const Index s = cu[n], L = cu[n + 1] - s;
    if (L == 0) continue;
    for (int kv = 0; kv < shape.kv_heads; ++kv) {
      const Matrix ks = block(k, s, L, Index{kv} * D, D), vs = block(v, s, L, Index{kv} * D, D);
      gather_heads(heads, block(q, s, L, Index{kv} * G * D, Index{G} * D), G, D, stream);
      gemm.run(false, true, G * L, L, D, shape.scale, heads, D, ks.data, ks.ld, 0.f, scores, L, DType::f32);
      causal_softmax(probabilities, scores, score_rows(lse, s, L, kv * G, G), stream);
      gemm.run(false, false, G * L, D, L, 1.f, probabilities, L, vs.data, vs.ld, 0.f, heads, D, DType::bf16);
      scatter_heads(block(o, s, L, Index{kv} * G * D, Index{G} * D), heads, G, D, stream);
    }
  }
}

void unfused_attention_backward(Gemm& gemm, Workspace& workspace, Matrix dq, Matrix dk, Matrix dv, Matrix dout,
                                Matrix q, Matrix k, Matrix v, Matrix o, Matrix lse, AttentionShape shape,
                                std::span<const std::int32_t> cu, cudaStream_t stream) {
  const int G = shape.q_heads / shape.kv_heads, D = shape.head_dim;
  const Index max_length = longest_sequence(cu);
  Carver plan;
  plan.add<float>(G * max_length * max_length);
  plan.add<std::uint16_t>(G * max_length * max_length);
  plan.add<std::uint16_t>(G * max_length * D);
  plan.add<std::uint16_t>(G * max_length * D);
  plan.add<float>(G * max_length);
  Carver carve(workspace.reserve(plan.bytes()));
  auto* scores = carve.take<float>(G * max_length * max_length);        // S, then dP
  auto* probabilities = carve.take<std::uint16_t>(G * max_length * max_length);  // P, then dS
  auto* queries = carve.take<std::uint16_t>(G * max_length * D);
  auto* grads = carve.take<std::uint16_t>(G * max_length * D);  // the group's dO, then its dQ
  auto* delta = carve.take<float>(G * max_length);

  for (std::size_t n = 0; n + 1 < cu.size(); ++n) {
    const Index s = cu[n], L = cu[n + 1] - s;
    if (L == 0) continue;
    for (int kv = 0; kv < shape.kv_heads; ++kv) {
      const Index q_column = Index{kv} * G * D, kv_column = Index{kv} * D;
      const Matrix ks = block(k, s, L, kv_column, D), vs = block(v, s, L, kv_column, D);
      const Matrix dks = block(dk, s, L, kv_column, D), dvs = block(dv, s, L, kv_column, D);
      const ScoreRows rows = score_rows(lse, s, L, kv * G, G);
      gather_heads(queries, block(q, s, L, q_column, Index{G} * D), G, D, stream);
      gather_heads(grads, block(dout, s, L, q_column, Index{G} * D), G, D, stream);
      attention_delta(delta, block(dout, s, L, q_column, Index{G} * D), block(o, s, L, q_column, Index{G} * D), G,
                      D, stream);
      gemm.run(false, true, G * L, L, D, shape.scale, queries, D, ks.data, ks.ld, 0.f, scores, L, DType::f32);
      causal_probabilities(probabilities, scores, rows, stream);
      gemm.run(true, false, L, D, G * L, 1.f, probabilities, L, grads, D, 0.f, dvs.data, dvs.ld, DType::bf16);
      gemm.run(false, true, G * L, L, D, 1.f, grads, D, vs.data, vs.ld, 0.f, scores, L, DType::f32);
      softmax_backward(probabilities, scores, delta, rows, stream);
      gemm.run(true, false, L, D, G * L, shape.scale, probabilities, L, queries, D, 0.f, dks.data, dks.ld,
               DType::bf16);
      gemm.run(false, false, G * L, D, L, shape.scale, probabilities, L, ks.data, ks.ld, 0.f, grads, D,
               DType::bf16);
      scatter_heads(block(dq, s, L, q_column, Index{G} * D), grads, G, D, stream);
    }
  }
}

}  // namespace deltatrain::model::cuda
