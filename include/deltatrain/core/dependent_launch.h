// Programmatic dependent launch (compute capability 9.0 and newer). A decode step is ~300 kernels of 2-8 us, and
// each one's launch and ramp-up would otherwise wait for the previous one to drain. A kernel launched with
// launch_dependent may be scheduled while the previous kernel on its stream is still running; its threads then
// block in wait_for_previous_grid() until that kernel has completed and its writes are visible.
//
// The contract for a kernel launched this way: it calls wait_for_previous_grid() before its first access to global
// memory (a read of an input, or a write to a buffer the previous kernel may still read), and it may call
// allow_next_grid() to let the kernel after it be scheduled early (which counts once every CTA has called it or
// exited, so it never takes an SM from this kernel's own CTAs). Launched the ordinary way, or on an older device, the
// two calls do nothing. For code built with CUDA only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace deltatrain {

#ifdef __CUDACC__
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#endif

// The launch configuration with the programmatic-serialization attribute; `attribute` must outlive the launch call.
inline cudaLaunchConfig_t dependent_launch_config(dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
                                                  cudaLaunchAttribute& attribute) {
  attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return config;
}

// cudaLaunchKernel's arguments (a kernel's address and its argument pointers), launched as a dependent.
inline cudaError_t launch_dependent(const void* kernel, dim3 grid, dim3 block, std::size_t shared_bytes,
                                    cudaStream_t stream, void** args) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = dependent_launch_config(grid, block, shared_bytes, stream, attribute);
  return cudaLaunchKernelExC(&config, kernel, args);
}

// A typed kernel and its arguments, launched as a dependent.
template <class... Params, class... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes,
                             cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = dependent_launch_config(grid, block, shared_bytes, stream, attribute);
  return cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
}

}  // namespace deltatrain
