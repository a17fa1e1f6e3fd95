// The Gated DeltaNet operator: the one public contract every backend implements.
//
// Semantics and layout follow fla's chunk_gated_delta_rule, so callers switch without reshaping.
// Per (sequence, value head) the state h is a K x V matrix; for each token t:
//   h  = exp(g_t) * h                       g is a log-space decay (<= 0 in practice)
//   v' = beta_t * (v_t - h^T k_t)           the delta-rule correction
//   h  = h + k_t v'^T
//   o_t = h^T (scale * q_t)
// with q_t, k_t first L2-normalised (x / sqrt(sum x^2 + 1e-6)) when use_qk_l2norm_in_kernel is on.
//
// Shapes ("seq-first", as fla):
//   q, k           [B, T, H, K]
//   v              [B, T, HV, V]     HV a multiple of H; value head j uses q/k head j / (HV / H) (GVA)
//   g, beta        [B, T, HV]
//   initial_state  [N, HV, K, V]     optional; N = B, or the number of packed sequences
//   cu_seqlens     [N + 1]           optional, int32 or int64; packed variable-length sequences, B must be 1:
//                                    sequence n is tokens [cu_seqlens[n], cu_seqlens[n+1]) of the T tokens
//   o              [B, T, HV, V]     same dtype as v
//   final_state    [N, HV, K, V]     float32 (float64 when the inputs are float64)
//   state_indices  [N]               optional, int32, recurrent step only (fla's ssm_state_indices): the states are
//                                    then pools [S, HV, K, V] of any S >= 1; sequence n starts from
//                                    initial_state[state_indices[n]] (required) and ends in
//                                    final_state[state_indices[n]]; rows no index names are left as they are, and
//                                    final_state may be initial_state itself (the pool updated in place). Indices
//                                    lie in [0, S) and, when final_state is written, are distinct.
//
// Head dims: the CPU backends take any K and V; the cuda backend K, V <= 256 (float32: K <= 128), running dims
// other than K = 64, 128, 256 and V a multiple of 64 on zero-padded copies of the tensors.
//
// Dtypes: q, k, v share one of float16, bfloat16, float32, float64. g and beta are float32 or q's dtype.
// A float64 call is float64 throughout (g, beta and the states too). Half-precision inputs are computed
// in float32 on the CPU. Tensors are contiguous; all live on one device.
//
// Outputs are allocated by the caller and passed in; the operator validates their shapes and dtypes too.
// Every argument is checked once, here, before any backend runs: bad input throws InvalidArgument naming
// the argument; a backend that cannot serve the call throws Unavailable naming the backend and the reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "deltatrain/core/tensor.h"

namespace deltatrain::gdn {

inline constexpr double kL2NormEps = 1e-6;

struct Options {
  std::optional<double> scale;  // default K^-0.5
  bool use_qk_l2norm_in_kernel = false;
  std::string backend = "auto";  // "auto" or a registered backend's name
  void* stream = nullptr;        // cudaStream_t for GPU backends; nullptr is the default stream
  int cpu_threads = 0;           // CPU backends: threads to use, 0 = all available
};

struct Inputs {
  TensorView q, k, v, g, beta;
  std::optional<TensorView> initial_state;
  std::optional<TensorView> cu_seqlens;
  // When cu_seqlens lives on a GPU, a host copy of it, so that neither validation nor scheduling
  // has to synchronise with the device to read the sequence boundaries.
  std::optional<TensorView> cu_seqlens_host;
  // The recurrent step only: the row of the state pools each sequence reads and writes, on the tensors' device
  // (see the layout above). The kernels read it there, so a step stays free of host synchronisation (CUDA
  // graphs); when it lives on a GPU, validation reads the host copy state_indices_host instead.
  std::optional<TensorView> state_indices = std::nullopt;
  std::optional<TensorView> state_indices_host = std::nullopt;
};

struct ForwardOutputs {
  TensorView o;
  std::optional<TensorView> final_state;  // written when present (output_final_state)
  // chunk_forward only: where present, a contiguous uint8 tensor of [forward_saved_bytes(...)] on the tensors'
  // device (16-byte aligned), which the backend fills with what its backward would otherwise compute again from
  // the inputs (the cuda backend: the gates' in-chunk decays and each chunk's inverse and Q K^T product, about
  // 400 bytes a token and value head at bfloat16). Pass it to chunk_backward with the same inputs and options.
  std::optional<TensorView> saved = std::nullopt;
};

struct BackwardInputs {
  TensorView d_o;                 // gradient of o, [B, T, HV, V], dtype of v
  std::optional<TensorView> dht;  // gradient of final_state, [N, HV, K, V]
  // ForwardOutputs::saved as chunk_forward filled it for these inputs and options, or absent: the gradients are
  // the same bit for bit either way, and the backward skips the work it holds. Its size is checked; its contents
  // cannot be, so a buffer from a forward on other inputs of the same shapes gives wrong gradients.
  std::optional<TensorView> saved = std::nullopt;
};

// Gradients w.r.t. the forward's inputs; each has its input's shape and dtype.
struct Gradients {
  TensorView dq, dk, dv, dg, dbeta;
  std::optional<TensorView> dh0;  // required exactly when initial_state is given
};

// The chunked forward (training and prefill).
void chunk_forward(const Inputs& inputs, const ForwardOutputs& outputs, const Options& options = {});

// The backward of chunk_forward: gradients given d_o and (optionally) the final-state gradient dht.
void chunk_backward(const Inputs& inputs, const BackwardInputs& grads_in, const Gradients& grads_out,
                    const Options& options = {});

// The same function computed token by token: the rollout (decode) step, one or a few tokens a sequence.
void recurrent_forward(const Inputs& inputs, const ForwardOutputs& outputs, const Options& options = {});

// The size of ForwardOutputs::saved for a chunk_forward (and its chunk_backward) on these inputs and options: 0
// where the backend that serves the call keeps nothing (the CPU backends) or its plan gains nothing from it, and then
// a saved buffer passed must be empty.
std::size_t forward_saved_bytes(const Inputs& inputs, const Options& options = {});

// The name of the backend `options.backend` resolves to for this call (what "auto" would pick).
std::string resolve_backend(const Inputs& inputs, const Options& options, bool backward = false);

// The address of the cuda backend's scratch memory on (GPU `device`, `stream`), null before its first call
// there (and in builds without CUDA). A CUDA graph that captured calls binds it, and a larger call on the same
// stream moves it, so a caller that replays graphs re-records them when this changes.
const void* cuda_scratch_address(int device, void* stream);

}  // namespace deltatrain::gdn
