// The cuda backend's scratch memory: a cache of device buffers, one per (device, stream), grown rarely and never freed
// while the process runs, so that calls in steady state allocate nothing and can be captured in a CUDA graph. What
// one call needs is planned in layout.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace deltatrain::gdn::cuda {

// The calling thread's device's workspace for `stream`, at least `bytes` long. Growing it while the
// stream is being captured would bake a soon-freed buffer into the graph, so that throws StateError.
void* workspace(int device, cudaStream_t stream, std::size_t bytes);

}  // namespace deltatrain::gdn::cuda
