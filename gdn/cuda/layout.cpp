#include "layout.h"

#include "chunking.h"

namespace deltatrain::gdn::cuda {

namespace {

// gamma per token and value head: a float2, hi + lo (chunk.cuh), without CUDA's vector types here.
constexpr std::size_t kGammaBytes = 2 * sizeof(float);

// Lays regions out one after another from offset 0, each at a 256-byte boundary.
struct Packer {
  std::size_t& bytes;
  void operator()(Region& region, std::size_t size) const {
    region = {bytes, size};
    bytes += (size + 255) / 256 * 256;
  }
};

// The segment ends and starts of one direction of a segmented pass (state_hopper.cu, steps 1 and 2): in float32,
// R_s for every segment but the last and, beyond two segments, the start of every segment (the second's is R_0).
std::size_t segment_ends_bytes(const Problem& problem, int segments) {
  return static_cast<std::size_t>(problem.N * (segments - 1) * problem.HV * problem.V * problem.K) * sizeof(float);
}
std::size_t segment_starts_bytes(const Problem& problem, int segments) {
  if (segments <= 2) return 0;
  return static_cast<std::size_t>(problem.N * segments * problem.HV * problem.V * problem.K) * sizeof(float);
}

}  // namespace

SavedLayout plan_saved(const Problem& problem, std::int64_t chunks, const ExecutionPlan& forward,
                       const ExecutionPlan& backward) {
  SavedLayout saved;
  const Packer take{saved.bytes};
  const auto token_heads = static_cast<std::size_t>(problem.tokens() * problem.HV);
  const std::size_t io = dtype_size(problem.io_dtype), C = kChunk;
  take(saved.chunk_table, static_cast<std::size_t>(chunks) * sizeof(ChunkInfo));
  take(saved.sequence_chunks, static_cast<std::size_t>(problem.N + 1) * sizeof(int));
  take(saved.gamma, token_heads * kGammaBytes);
  take(saved.gate_in, token_heads * sizeof(float));
  take(saved.gate_out, token_heads * sizeof(float));
  if (backward.prepare_forms_w) take(saved.w, token_heads * static_cast<std::size_t>(problem.K) * io);
  if (backward.wgmma) {
    take(saved.beta_by_head, token_heads * sizeof(float));
  } else {
    take(saved.u, token_heads * static_cast<std::size_t>(problem.V) * io);
  }
  take(saved.p, token_heads * C * io);
  take(saved.t, token_heads * C * io);
  if (problem.l2norm) {
    const auto token_key_heads = static_cast<std::size_t>(problem.tokens() * problem.H);
    take(saved.q_normed, token_key_heads * static_cast<std::size_t>(problem.K) * io);
    take(saved.k_normed, token_key_heads * static_cast<std::size_t>(problem.K) * io);
    take(saved.q_rstd, token_key_heads * sizeof(float));
    take(saved.k_rstd, token_key_heads * sizeof(float));
  }
  if (backward.segments > 1) take(saved.chunk_log_norms, static_cast<std::size_t>(problem.HV * chunks) * sizeof(float));
  if (backward_reuses_forward_starts(forward, backward)) {
    take(saved.segment_ends, segment_ends_bytes(problem, backward.segments));
    take(saved.segment_starts, segment_starts_bytes(problem, backward.segments));
  }
  return saved;
}

WorkspaceLayout plan_workspace(const Problem& problem, bool padded, std::int64_t chunks, bool upload_offsets,
                               const ExecutionPlan& plan, const SavedLayout& saved) {
  WorkspaceLayout layout;
  const Packer take{layout.bytes};
  // A region the saved buffer holds is not taken here (backend.cpp points the kernels at the saved one).
  auto take_unless_saved = [&](Region& region, const Region& kept, std::size_t bytes) {
    if (kept.bytes == 0) take(region, bytes);
  };
  const auto tokens = static_cast<std::size_t>(problem.tokens());
  const auto H = static_cast<std::size_t>(problem.H), HV = static_cast<std::size_t>(problem.HV);
  const auto K = static_cast<std::size_t>(problem.K), V = static_cast<std::size_t>(problem.V);
  const std::size_t io = dtype_size(problem.io_dtype), f32 = sizeof(float), C = kChunk;
  const auto n_chunks = static_cast<std::size_t>(chunks);

  if (upload_offsets) take(layout.offsets, (problem.N + 1) * sizeof(std::int64_t));
  if (padded) {
    const std::size_t qk_bytes = tokens * H * K * io, v_bytes = tokens * HV * V * io;
    const std::size_t state_bytes = static_cast<std::size_t>(problem.state_rows) * HV * K * V * f32;
    WorkspaceLayout::Padded& copy = layout.padded;
    take(copy.q, qk_bytes);
    take(copy.k, qk_bytes);
    take(copy.v, v_bytes);
    if (problem.has_initial_state) take(copy.h0, state_bytes);
    if (problem.op == Operation::chunk_backward) {
      take(copy.d_o, v_bytes);
      take(copy.dq, qk_bytes);
      take(copy.dk, qk_bytes);
      take(copy.dv, v_bytes);
      if (problem.has_final_state) take(copy.dht, state_bytes);
      if (problem.has_initial_state) take(copy.dh0, state_bytes);
    } else {
      take(copy.o, v_bytes);
      if (problem.has_final_state) take(copy.ht, state_bytes);
    }
  }
  if (problem.op == Operation::recurrent) return layout;
  take_unless_saved(layout.chunk_table, saved.chunk_table, n_chunks * sizeof(ChunkInfo));
  take_unless_saved(layout.sequence_chunks, saved.sequence_chunks, (problem.N + 1) * sizeof(int));
  if (problem.l2norm) {
    take_unless_saved(layout.q_normed, saved.q_normed, tokens * H * K * io);
    take_unless_saved(layout.k_normed, saved.k_normed, tokens * H * K * io);
    take_unless_saved(layout.q_rstd, saved.q_rstd, tokens * H * f32);
    take_unless_saved(layout.k_rstd, saved.k_rstd, tokens * H * f32);
  }
  take_unless_saved(layout.gamma, saved.gamma, tokens * HV * kGammaBytes);
  take_unless_saved(layout.gate_in, saved.gate_in, tokens * HV * f32);
  take_unless_saved(layout.gate_out, saved.gate_out, tokens * HV * f32);
  if (plan.prepare_forms_w) take_unless_saved(layout.w, saved.w, tokens * HV * K * io);
  if (plan.wgmma) {
    take_unless_saved(layout.beta_by_head, saved.beta_by_head, tokens * HV * f32);
  } else {
    take_unless_saved(layout.u, saved.u, tokens * HV * V * io);
  }
  take_unless_saved(layout.p, saved.p, tokens * HV * C * io);
  if (plan.segments > 1) {
    const auto N = static_cast<std::size_t>(problem.N), S = static_cast<std::size_t>(plan.segments);
    if (problem.op == Operation::chunk_backward) {  // its reverse passes' (and its recompute's, where none are saved)
      take(layout.segment_ends, segment_ends_bytes(problem, plan.segments));
      take(layout.segment_starts, segment_starts_bytes(problem, plan.segments));
    } else {
      take_unless_saved(layout.segment_ends, saved.segment_ends, segment_ends_bytes(problem, plan.segments));
      take_unless_saved(layout.segment_starts, saved.segment_starts, segment_starts_bytes(problem, plan.segments));
    }
    take(layout.segment_maps, N * (S - 1) * HV * K * K * io);
    take_unless_saved(layout.chunk_log_norms, saved.chunk_log_norms, HV * n_chunks * f32);
  }
  // T: the wgmma passes scale it by beta themselves; the backward's gradients read it.
  if (plan.wgmma || problem.op == Operation::chunk_backward) take_unless_saved(layout.t, saved.t, tokens * HV * C * io);
  if (problem.op != Operation::chunk_backward) return layout;
  take(layout.states, n_chunks * HV * V * K * io);
  take(layout.delta, tokens * HV * V * io);
  if (plan.fused_backward) {
    if (!plan.fused_input_grads) {
      take(layout.dq_head, tokens * HV * K * f32);
      take(layout.dk_head, tokens * HV * K * f32);
    }
    return layout;
  }
  const auto slices = static_cast<std::size_t>(problem.K / kKeySlice);
  take(layout.dstates, n_chunks * HV * V * K * io);
  take(layout.ddelta, tokens * HV * V * io);
  take(layout.dw, tokens * HV * K * io);
  if (problem.l2norm) take(layout.dq_head, tokens * H * K * f32);
  take(layout.dk_head, tokens * H * K * f32);
  take(layout.dgamma_part, slices * tokens * HV * f32);
  return layout;
}

}  // namespace deltatrain::gdn::cuda
