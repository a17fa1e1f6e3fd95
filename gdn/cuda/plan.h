// How the cuda backend runs one call: which kernels take the sequential state passes (wgmma on sm_90a
// devices, mma.sync elsewhere) and how those split the work over the GPU. One pure function of the call's
// shape and the device's facts, computed once per call (backend.cpp), carried to every launcher in Params
// and obeyed there; unit-tested on the CPU (tests/gdn/test_cuda_plan.cpp). It is compiled into every build,
// with or without nvcc.
#pragma once

#include <cstdint>
#include <optional>

#include "deltatrain/core/tensor.h"
#include "deltatrain/gdn/backend.h"

namespace deltatrain::gdn::cuda {

// Columns of V one warpgroup of the wgmma state passes owns (the wgmma row count); a call takes those passes
// only when V is a multiple of it.
inline constexpr int kWgmmaColumns = 64;

// Whether a wgmma forward-direction pass of K keys and `warpgroups` warpgroups per CTA forms W = T diag(beta e^gamma) K
// itself, a chunk ahead, rather than reading prepare's: where each warpgroup forms 64 key columns (32 float32
// accumulators beside the state's); all 128 keys in one warpgroup spill. The kernels and the plan both ask this.
constexpr bool wgmma_pass_forms_w(std::int64_t K, int warpgroups) { return K / warpgroups == kWgmmaColumns; }
// Whether a wgmma state pass reads prepare's W: wherever it does not form W, and the unfused backward's reverse pass
// proper, which forms none (each of its steps already stores dS and D beside its products). The segment ends passes
// of either direction form it as the forward passes do: with warm-ups they walk a few chunks a segment, and a
// backward whose only reader of W they are (the fused one) then needs none from prepare, nor a training forward's
// saved buffer. The kernels and the plan's prepare_forms_w both ask this.
constexpr bool wgmma_pass_reads_w(bool reverse_pass_proper, std::int64_t K, int warpgroups) {
  return reverse_pass_proper || !wgmma_pass_forms_w(K, warpgroups);
}

struct PlanInputs {
  Operation op = Operation::chunk_forward;
  DType io = DType::bf16;
  std::int64_t sequences = 1, value_heads = 1;
  std::int64_t group = 1;         // value heads per q/k head (GVA)
  std::int64_t K = 128, V = 128;  // the kernels' head dims (kernel_key_dim, kernel_value_dim)
  std::int64_t chunks = 1;        // over all sequences
  int multiprocessors = 1;        // of the device
  bool wgmma_device = false;      // the device is sm_90 and this build carries the sm_90a kernels
  bool wgmma_allowed = true;      // DELTATRAIN_CUDA_WGMMA is not 0 (core/system.h's switch_setting)
  // DELTATRAIN_CUDA_FUSED_BACKWARD (optional_switch_setting): true, the fused backward wherever it applies;
  // unset, the plan's rule (where its CTAs fill their waves); false, never.
  std::optional<bool> fused_backward_setting;
  // DELTATRAIN_CUDA_ROLE_SPLIT_BACKWARD=1: where the backward is fused, its kernel split by role (not yet measured, so
  // never chosen unasked).
  bool role_split_requested = false;
};

struct ExecutionPlan {
  bool wgmma = false;   // the wgmma state passes run (they form U from V, beta and T; the others read U)
  int segments = 1;     // wgmma: runs of chunks each sequence's passes split into (1: none)
  int warpgroups = 1;   // wgmma: warpgroups per CTA, each on its own 64 columns of V
  bool paired = false;  // wgmma, backward: the recompute and the reverse pass side by side in one launch
  // wgmma, more than two segments: the rows of M (the segments' chunk maps) launched beside the segment ends pass
  // instead of as more row blocks of its launch (state_hopper.cu, step 1), where segments are long enough to pay for it
  bool maps_apart = false;
  // wgmma: the passes form W themselves (wgmma_pass_forms_w) from T and beta (the forward-direction ones read them for
  // U), all but the unfused backward's reverse pass proper
  bool passes_form_w = false;
  // prepare forms W and writes it for the passes that read it: the mma.sync passes, the wgmma passes where they do
  // not form it, and the unfused backward's reverse pass proper
  bool prepare_forms_w = true;
  int warp_pairs = 2;   // mma.sync: warp pairs per CTA, each on 16 columns of V
  // wgmma, backward, K = V = 128: the recompute pass (two warpgroups a CTA, on the fused kernel's segments) then one
  // kernel per (sequence, segment, value head) for everything else (fused_backward.cu), instead of the reverse pass,
  // chunk_grad and wy_grad
  bool fused_backward = false;
  // fused backward, GVA groups of one or two value heads: the fused kernel finishes dq and dk itself (the group's
  // sum, a pair of CTAs in a cluster, the L2 norm's backward and the cast) instead of input_grad_kernel after it
  bool fused_input_grads = false;
  // fused backward: the kernel whose three warpgroups split each chunk's work by role (role_split_backward.cu) in
  // place of fused_backward.cu's (which finishes dq and dk as fused_input_grads says, as they do)
  bool role_split = false;
  friend bool operator==(const ExecutionPlan&, const ExecutionPlan&) = default;
};

ExecutionPlan plan_execution(const PlanInputs& in);

// Whether a call's backward takes its recompute pass's segment starts (state_hopper.cu, steps 1 and 2: the segment
// ends R_s and the composed starts) from the forward's saved buffer instead of walking steps 1 and 2 again: where the
// forward's passes and the recompute are segmented alike (the same segments, warpgroups and maps launch), so that the
// same segment ends launch on the same inputs wrote them, bit for bit.
bool backward_reuses_forward_starts(const ExecutionPlan& forward, const ExecutionPlan& backward);

}  // namespace deltatrain::gdn::cuda
