// The kernels of one GDN operation, recorded in order and then run on the caller's stream. Every kernel
// takes the call's Params. Host time per call is mostly kernel launches (about 3.5 us each on the H200
// machine), so a sequence of several kernels is replayed as a CUDA graph cached per (device, stream,
// kernels): updating each node's launch configuration and parameters, then one graph launch, costs the host
// less than launching the kernels one by one. While the stream is being captured (the caller is building
// a graph of its own) the kernels are launched directly, so that they land in the caller's graph.
#pragma once

#include <cuda_runtime_api.h>

#include <array>

#include "params.h"

namespace deltatrain::gdn::cuda {

class KernelSequence {
 public:
  static constexpr int kMaxKernels = 12;

  // Appends a kernel `void function(Params)`; `name` names it in errors.
  void add(const void* function, const char* name, dim3 grid, dim3 block, int smem);
  // Runs the kernels in order on `stream` with parameters p; throws Failure when a launch fails.
  void run(const Params& p, cudaStream_t stream) const;

 private:
  struct Kernel {
    const void* function;
    const char* name;
    dim3 grid, block;
    int smem;
  };
  std::array<Kernel, kMaxKernels> kernels_{};
  int count_ = 0;
};

}  // namespace deltatrain::gdn::cuda
