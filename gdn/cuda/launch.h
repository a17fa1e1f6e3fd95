// Host entry points of the CUDA kernels, one per stage of the chunked algorithm (see backend.cpp for the
// order). Each dispatches on the io dtype and head dim and records its kernel in `kernels`, which the
// backend then runs on the caller's stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "deltatrain/core/tensor.h"
#include "deltatrain/gdn/backend.h"
#include "kernel_sequence.h"
#include "params.h"

namespace deltatrain::gdn::cuda {

// Whether kernels for the io dtype and head dim K are compiled in (float32 needs K <= 128).
bool have_kernels(DType io, int K);

// The head dims the kernels are compiled for: K padded to 64, 128 or 256 and V to a multiple of 64 (the same
// dims for those). The backend runs a call of other dims on copies of its tensors zero-padded to these
// (copy_padded) and crops the results: zeros change nothing, since the state's padded key rows stay zero and
// its padded value columns, independent of the others, get zero cotangents.
inline std::int64_t kernel_key_dim(std::int64_t K) { return K <= 64 ? 64 : K <= 128 ? 128 : K <= 256 ? 256 : K; }
inline std::int64_t kernel_value_dim(std::int64_t V) { return (V + 63) / 64 * 64; }

// `blocks` row-major matrices of rows x cols, one after another.
struct MatrixBatch {
  std::int64_t blocks, rows, cols;
};
// dst (to) = src (from) where both have an element, 0 where only dst has: pads (dst larger) or crops (src
// larger) each matrix, on `stream`. Elements of 2 or 4 bytes.
void copy_padded(const void* src, MatrixBatch from, void* dst, MatrixBatch to, std::size_t element_bytes,
                 cudaStream_t stream);

// The chunk schedule and, when `normalise`, the L2 norm of q and k into p.q_normed and p.k_normed (one launch; a
// backward that reads them from the forward's saved buffer does not normalise again).
void launch_start(const Params& p, DType io, bool normalise, KernelSequence& kernels);
// gamma, P, W where p.w is set, U where p.u is set, T and beta by head where p.t and p.beta_by_head are set (the wgmma
// passes, the backward), for every chunk.
void launch_prepare(const Params& p, DType io, KernelSequence& kernels);
// The sequential pass over chunks: o and the final state (forward), or the states entering each chunk
// and delta (recompute for the backward).
void launch_state_forward(const Params& p, DType io, bool recompute, KernelSequence& kernels);
// Whether the calling thread's device runs the wgmma kernels: an sm_90 device and this build's sm_90a image
// (another build would fall back to its sm_80 image, whose body of these kernels is empty). Asked once per
// device; an input of plan_execution (plan.h).
bool wgmma_device_ready();
// The same pass with wgmma (state_hopper.cu) where the call's plan chose it (p.wgmma); false where not,
// recording nothing.
bool launch_state_forward_hopper(const Params& p, DType io, bool recompute, KernelSequence& kernels);
// The reverse sequential pass: the state gradient after each chunk, ddelta and dh0.
void launch_state_backward(const Params& p, DType io, KernelSequence& kernels);
// The same pass with wgmma, as launch_state_forward_hopper.
bool launch_state_backward_hopper(const Params& p, DType io, KernelSequence& kernels);
// Both sequential passes of the backward: the recompute, then the reverse pass, or the two in one launch
// where the plan paired them (p.paired).
void launch_backward_state_passes(const Params& p, DType io, KernelSequence& kernels);
// The paired launch with wgmma where p.paired; false otherwise, recording nothing.
bool launch_state_passes_paired_hopper(const Params& p, DType io, KernelSequence& kernels);
// Per chunk: dq, dk (state and intra-chunk parts), dv, dW, the U-part of dT, partial dgamma and dbeta.
void launch_chunk_grad(const Params& p, DType io, KernelSequence& kernels);
// Per chunk: the WY/UT-transform backward, then dg (reverse cumsum), dbeta and dk.
void launch_wy_grad(const Params& p, DType io, KernelSequence& kernels);
// Where the call has segments (wgmma): the true state gradient at each segment's start of the reverse walk, the
// start of each CTA of the fused backward (steps 1 and 2 of the backward's segmented pass, without the pass).
void launch_backward_segment_starts(const Params& p, DType io, KernelSequence& kernels);
// After the recompute pass (fused_backward_kernel, where p.fused_backward): per sequence, segment and value head,
// the chunks in reverse with the state gradient held: dv, dg, dbeta, dh0, and dq and dk (finished where
// p.fused_input_grads, else per value head).
void launch_fused_backward(const Params& p, DType io, KernelSequence& kernels);
// The same work by role_split_backward_kernel (where p.role_split), dq and dk always per value head.
void launch_role_split_backward(const Params& p, DType io, KernelSequence& kernels);
// dq and dk from dq_head and dk_head: the GVA group summed (fused backward) and through the L2-norm backward;
// without the fused backward only dq with the L2 norm (wy_grad writes dk, chunk_grad dq otherwise); nothing where
// the fused backward finished them (p.fused_input_grads).
void launch_input_grads(const Params& p, DType io, KernelSequence& kernels);
// The token-by-token recurrence (rollout step).
void launch_recurrent(const Params& p, DType io, KernelSequence& kernels);

// Kernel image check for a device: the error a trivial kernel's attributes query returns there.
cudaError_t probe_kernel_image();

}  // namespace deltatrain::gdn::cuda
