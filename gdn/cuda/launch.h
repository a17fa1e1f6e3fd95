// Host entry points of the CUDA kernels, one per stage of the chunked algorithm (see backend.cpp for the
// order). Each dispatches on the io dtype and head dim, launches on `stream` and throws Failure when the
// launch fails; none synchronises.
#pragma once

#include <cuda_runtime_api.h>

#include "deltatrain/core/tensor.h"
#include "params.h"

namespace deltatrain::gdn::cuda {

// Whether kernels for the io dtype and head dim K are compiled in (float32 needs K <= 128).
bool have_kernels(DType io, int K);
// Shared-memory columns of one key slice in the chunk-gradient kernel (the workspace sizes slices by it).
int key_slice_width(DType io, int K);

// The chunk schedule and, when p.l2norm, the L2 norm of q and k (one launch).
void launch_start(const Params& p, DType io, cudaStream_t stream);
// gamma, W, U, P, and T when p.t is set (the backward).
void launch_prepare(const Params& p, DType io, cudaStream_t stream);
// The sequential pass over chunks: o and the final state (forward), or the states entering each chunk
// and delta (recompute for the backward).
void launch_state_forward(const Params& p, DType io, bool recompute, cudaStream_t stream);
// The reverse sequential pass: the state gradient after each chunk, ddelta and dh0.
void launch_state_backward(const Params& p, DType io, cudaStream_t stream);
// Per chunk: dq, dk (state and intra-chunk parts), dv, dW, the U-part of dT, partial dgamma and dbeta.
void launch_chunk_grad(const Params& p, DType io, cudaStream_t stream);
// Per chunk: the WY/UT-transform backward, then dg (reverse cumsum) and dbeta.
void launch_wy_grad(const Params& p, DType io, cudaStream_t stream);
// dq, dk: sums over each GVA group in a fixed order, then the L2-norm backward.
void launch_qk_grad(const Params& p, DType io, cudaStream_t stream);
// The token-by-token recurrence (rollout step).
void launch_recurrent(const Params& p, DType io, cudaStream_t stream);

// Kernel image check for a device: the error a trivial kernel's attributes query returns there.
cudaError_t probe_kernel_image();

}  // namespace deltatrain::gdn::cuda
