// The memory of one call of the cuda backend, planned on the host as a pure function of the problem and its plans
// (plan.h): the regions of the cached workspace, and those a call keeps in the caller's saved buffer between
// chunk_forward and chunk_backward. Built without nvcc too, for its CPU tests (tests/gdn/test_cuda_plan.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "deltatrain/gdn/backend.h"
#include "plan.h"

namespace deltatrain::gdn::cuda {

// A region of a buffer: its byte offset and size; 0 bytes: unused.
struct Region {
  std::size_t offset = 0, bytes = 0;
};

// What the backward's start_kernel and prepare write, kept between a call's chunk_forward and its chunk_backward in
// the caller's ForwardOutputs::saved (gdn.h) instead of the workspace: the forward's start_kernel and prepare fill it,
// and the backward launches neither (the chunk schedule depends on cu_seqlens alone, which both operations share).
// Where the recompute is segmented as the forward (backward_reuses_forward_starts), also the forward-direction
// segment ends and starts, which the forward's passes write there and the backward's recompute reads instead of
// making its own. Laid out from the call's two plans, so that both operations of a call agree on it: the forward's
// prepare writes every region whose pointer is set, W included, whatever its own plan.
struct SavedLayout {
  Region chunk_table, sequence_chunks;  // start_kernel's schedule
  Region gamma, gate_in, gate_out, beta_by_head, w, u, p, t;
  Region q_normed, k_normed, q_rstd, k_rstd;  // the L2 norm's rows and reciprocal norms, where the call takes it
  Region chunk_log_norms;                     // where the backward is segmented (warmup.h)
  Region segment_ends, segment_starts;        // the forward's, where the backward reuses them (starts: > 2 segments)
  std::size_t bytes = 0;
};

// problem: the call in the kernels' head dims (either operation); chunks: over all sequences; forward, backward: the
// plans of the call's chunk_forward and chunk_backward.
SavedLayout plan_saved(const Problem& problem, std::int64_t chunks, const ExecutionPlan& forward,
                       const ExecutionPlan& backward);

// Byte offsets of the regions of one call's workspace (see Params for their shapes).
struct WorkspaceLayout {
  Region offsets;  // int64 [N + 1]: cu_seqlens uploaded when the caller's copy is on the CPU
  Region chunk_table, sequence_chunks;
  Region q_normed, k_normed, q_rstd, k_rstd;
  Region gamma, gate_in, gate_out, beta_by_head, w, u, p, t;
  Region states, delta, dstates, ddelta, dw, dq_head, dk_head, dgamma_part;
  Region segment_ends, segment_maps, segment_starts;
  Region chunk_log_norms;  // a segmented call's (its segment ends passes warm up where they allow: warmup.h)
  // Zero-padded copies of the caller's tensors, in the kernels' shapes, for a call whose head dims the kernels
  // are not compiled for (kernel_key_dim); the outputs are cropped from them into the caller's.
  struct Padded {
    Region q, k, v, o, h0, ht, d_o, dht, dq, dk, dv, dh0;
  } padded;
  std::size_t bytes = 0;
};

// problem: the call in the kernels' head dims (kernel_key_dim); padded: whether those differ from the caller's,
// so that its tensors are copied; chunks: the number of chunks over all sequences; upload_offsets: cu_seqlens must
// be copied to the GPU; plan: how the sequential state passes run (plan_execution); saved: the regions the call keeps
// in the caller's saved buffer (none: an empty layout), which the workspace then leaves out (but a backward's segment
// ends and starts: its reverse passes make their own).
WorkspaceLayout plan_workspace(const Problem& problem, bool padded, std::int64_t chunks, bool upload_offsets,
                               const ExecutionPlan& plan, const SavedLayout& saved = {});

}  // namespace deltatrain::gdn::cuda
