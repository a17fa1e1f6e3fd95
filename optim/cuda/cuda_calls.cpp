#include "cuda_calls.h"

#include <cuda_runtime_api.h>

#include "deltatrain/core/cuda_check.h"

namespace deltatrain::optim {

void* cuda_alloc(int device, std::size_t bytes) {
  void* pointer = nullptr;
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  cuda_check(cudaMalloc(&pointer, bytes), "cudaMalloc");
  cuda_check(cudaMemset(pointer, 0, bytes), "cudaMemset");
  return pointer;
}

void cuda_free(void* pointer) noexcept { cudaFree(pointer); }

void cuda_copy(void* target, const void* source, std::size_t bytes, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  cuda_check(cudaMemcpyAsync(target, source, bytes, cudaMemcpyDefault, s), "cudaMemcpyAsync");
  cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

void cuda_copy_async(void* target, const void* source, std::size_t bytes, void* stream) {
  cuda_check(cudaMemcpyAsync(target, source, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
             "cudaMemcpyAsync");
}

void cuda_zero(void* target, std::size_t bytes, void* stream) {
  cuda_check(cudaMemsetAsync(target, 0, bytes, static_cast<cudaStream_t>(stream)), "cudaMemsetAsync");
}

void cuda_synchronize(void* stream) {
  cuda_check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

void* cuda_host_alloc(std::size_t bytes) noexcept {
  void* pointer = nullptr;
  if (cudaHostAlloc(&pointer, bytes, cudaHostAllocDefault) != cudaSuccess) {
    cudaGetLastError();  // the failure is answered by plain memory; it must not surface in a later check
    return nullptr;
  }
  return pointer;
}

void cuda_host_free(void* pointer) noexcept { cudaFreeHost(pointer); }

}  // namespace deltatrain::optim
