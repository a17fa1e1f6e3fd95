// The plain parameter block every GDN kernel receives (FlashAttention-3 style): sizes, pointers to the
// caller's tensors and to the regions of the cached workspace. Built once per call on the host by
// make_params (backend.cpp) from a validated Problem; kernels never see a TensorView.
#pragma once

#include <vector_types.h>

#include <cstddef>
#include <cstdint>

#include "chunking.h"

namespace deltatrain::gdn::cuda {

struct Params {
  // Sizes.
  int tokens = 0;  // B * T
  int T = 0;       // tokens per batch row (sequences are rows when cu_seqlens is absent)
  int H = 0, HV = 0, K = 0, V = 0;
  int group = 1;       // HV / H
  int sequences = 0;   // N
  int chunks = 0;      // chunks over all sequences
  // The call's ExecutionPlan (plan.h), which every launcher obeys.
  bool wgmma = false;   // the sequential state passes run the wgmma kernels (state_hopper.cu)
  int segments = 1;     // runs of chunks per sequence those split into
  int warpgroups = 1;   // per CTA of the wgmma passes
  bool paired = false;  // the backward's two wgmma passes in one launch
  bool maps_apart = false;    // the segments' rows of M in a launch of their own, beside the ends pass
  int warp_pairs = 2;   // per CTA of the mma.sync passes (state.cu)
  bool fused_backward = false;  // the backward after the recompute pass is fused_backward_kernel
  bool fused_input_grads = false;  // which also finishes dq and dk (GVA groups of 1 or 2; no input_grad_kernel)
  bool role_split = false;  // the fused backward is role_split_backward_kernel
  // A backward whose recompute pass reads its segment starts from the forward's saved buffer
  // (backward_reuses_forward_starts): it launches no steps 1 and 2 of its own for that pass.
  bool recompute_starts_saved = false;
  float scale = 1.f;
  bool l2norm = false;

  // Sequences: cu_seqlens on the device (int32 or int64), or null for B rows of T tokens.
  const void* cu_seqlens = nullptr;
  bool cu_seqlens_int64 = false;

  // Inputs. q, k, v, o, do are the io dtype; g and beta are float32 or the io dtype (flags).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;
  const void* beta = nullptr;
  bool g_float = true;
  bool beta_float = true;
  const float* h0 = nullptr;  // [N, HV, K, V], a pool [S, HV, K, V] with state_indices, or null
  // The recurrent step with a state pool: sequence n's row of h0 and ht ([N] int32), or null for row n.
  const int* state_indices = nullptr;

  // Forward outputs.
  void* o = nullptr;
  float* ht = nullptr;  // [N, HV, K, V], a pool [S, HV, K, V] with state_indices, or null

  // Backward inputs and outputs.
  const void* d_o = nullptr;
  const float* dht = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  void* dg = nullptr;
  void* dbeta = nullptr;
  float* dh0 = nullptr;

  // Workspace (see layout.h for shapes). Element types: "io" = the io dtype.
  ChunkInfo* chunk_table = nullptr;      // [chunks]
  int* sequence_chunks = nullptr;        // [N + 1]: first chunk of each sequence
  void* q_normed = nullptr;              // io [tokens, H, K] (l2norm only)
  void* k_normed = nullptr;              // io [tokens, H, K] (l2norm only)
  float* q_rstd = nullptr;               // [tokens, H] (l2norm only)
  float* k_rstd = nullptr;               // [tokens, H] (l2norm only)
  float2* gamma = nullptr;               // [HV, tokens]: in-chunk cumulative log decay, hi + lo (chunk.cuh)
  float* gate_in = nullptr;              // [HV, tokens]: e^gamma, the decay from the chunk's start
  float* gate_out = nullptr;             // [HV, tokens]: e^(gamma_last - gamma), the decay to its end
  void* w = nullptr;                     // io [tokens, HV, K] (where prepare forms W; else null)
  void* u = nullptr;                     // io [tokens, HV, V] (the mma.sync passes; the wgmma ones form U)
  void* p = nullptr;                     // io [tokens, HV, C]: scale * tril(Q K^T) * Gamma
  void* t = nullptr;                     // io [tokens, HV, C]: (I + A)^-1 (the wgmma passes and the backward)
  float* beta_by_head = nullptr;         // [HV, tokens]: beta, for the wgmma passes' copies (they scale T by it)
  void* states = nullptr;                // io [chunks, HV, V, K]: state entering each chunk (backward)
  void* delta = nullptr;                 // io [tokens, HV, V]: the pseudo-values U - W S (backward)
  void* dstates = nullptr;               // io [chunks, HV, V, K]: gradient of the state after each chunk
  void* ddelta = nullptr;                // io [tokens, HV, V]: gradient of delta
  void* dw = nullptr;                    // io [tokens, HV, K]
  // dq and dk before the GVA group sum (fused backward: [tokens, HV, K], one row per value head) or after it
  // ([tokens, H, K]: dq before the L2 norm, only with it; chunk_grad's part of dk)
  float* dq_head = nullptr;
  float* dk_head = nullptr;
  float* dgamma_part = nullptr;          // [K / kKeySlice slices, tokens, HV]
  // A segmented pass's steps 1 and 2 (state_hopper.cu), by direction: [0] the forward-direction passes', [1] the
  // reverse passes'. The same workspace regions for both, but in a backward that reads [0] from the forward's saved
  // buffer (recompute_starts_saved), which its reverse passes must leave as they found it.
  float* segment_ends[2] = {};           // [N, segments - 1, HV, V, K]: R_s (S^T rows)
  float* segment_starts[2] = {};         // [N, segments, HV, V, K]: S^T entering each segment
  void* segment_maps = nullptr;          // io [N, segments - 1, HV, K, K]: M_s
  // [HV, chunks]: each chunk's bound on the log norm of its map (warmup.h), where the call (or, for a forward with a
  // saved buffer, its backward) is segmented; else null
  float* chunk_log_norms = nullptr;
};

// Who finishes dq and dk after the fused backward (fused_backward.cu, role_split_backward.cu): input_grad_kernel from
// float32 rows per value head (any GVA group), the CTA itself (a group of one), or the cluster of a group's two CTAs,
// rank 0 (value head 2h) summing dQ and rank 1 dK, each taking the partner's partial from its shared memory.
enum class InputGrads { per_value_head, this_cta, cluster_pair };
inline InputGrads input_grads_of(const Params& p) {
  if (!p.fused_input_grads) return InputGrads::per_value_head;
  return p.group == 1 ? InputGrads::this_cta : InputGrads::cluster_pair;  // the plan finishes them for groups of 1, 2
}

}  // namespace deltatrain::gdn::cuda
