// Stands in for the CUDA runtime behind the preload shim in test_memsaver_preload, so that the shim's
// routing (what reaches the "real" runtime and what does not) is observable on a machine without a GPU.
#include <cuda_runtime_api.h>

#include <cstdlib>

#include "fake_cudart.h"

namespace {
FakeCudartCalls calls;
}

extern "C" {

cudaError_t cudaMalloc(void** pointer, size_t bytes) {
  ++calls.mallocs;
  *pointer = std::malloc(bytes);
  return *pointer ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFree(void* pointer) {
  ++calls.frees;
  calls.last_freed = pointer;
  std::free(pointer);
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

FakeCudartCalls fake_cudart_calls(void) { return calls; }

}  // extern "C"
