// The kernels of one GDN operation, recorded in order and then run on the caller's stream. Every kernel
// takes the call's Params. Host time per call is mostly kernel launches (about 3.5 us each on the H200
// machine), so a sequence of several kernels is replayed as a CUDA graph cached per (device, stream,
// kernels): updating each node's launch configuration and parameters, then one graph launch, costs the host
// less than launching the kernels one by one. While the stream is being captured (the caller is building
// a graph of its own) the kernels are launched directly, so that they land in the caller's graph.
// A kernel runs after the one recorded before it unless it names another; a kernel may also wait for a
// second one (a join). Independent branches then run side by side in the graph; launched directly, in the
// order recorded (which every dependency follows).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>

#include "params.h"

namespace deltatrain::gdn::cuda {

class KernelSequence {
 public:
  static constexpr int kMaxKernels = 16;
  static constexpr int kPrevious = -1;

  // Appends a kernel `void function(Params)` that runs after kernel `after` (an index returned before; by
  // default the kernel recorded last) and returns its index; `name` names it in errors.
  int add(const void* function, const char* name, dim3 grid, dim3 block, int smem, int after = kPrevious);
  // Kernel `kernel` also waits for the earlier kernel `earlier`.
  void join(int kernel, int earlier);
  // The index of the kernel recorded last (-1 before any).
  int last() const { return count_ - 1; }
  // Runs the kernels in order on `stream` with parameters p; throws Failure when a launch fails.
  void run(const Params& p, cudaStream_t stream) const;

 private:
  struct Kernel {
    const void* function;
    const char* name;
    dim3 grid, block;
    int smem;
    std::uint32_t after;  // a bit per earlier kernel it waits for
  };
  std::array<Kernel, kMaxKernels> kernels_{};
  int count_ = 0;
};

}  // namespace deltatrain::gdn::cuda
