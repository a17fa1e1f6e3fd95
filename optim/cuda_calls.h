// The few CUDA runtime calls the optimizer needs, behind plain functions so that the host code
// compiles without CUDA (then each raises Unavailable). Named so as not to shadow CUDA's
// cuda_runtime.h, which nvcc includes by name.
#pragma once

#include <cstddef>

namespace deltatrain::optim {

void* cuda_alloc(int device, std::size_t bytes);  // zero-filled
void cuda_free(void* pointer) noexcept;
// cudaMemcpyDefault on `stream`, then waits for the stream.
void cuda_copy(void* target, const void* source, std::size_t bytes, void* stream);
// cudaMemcpyDefault on `stream`, not waited for: cuda_synchronize(stream) before the bytes are used or reused.
void cuda_copy_async(void* target, const void* source, std::size_t bytes, void* stream);
void cuda_zero(void* target, std::size_t bytes, void* stream);
void cuda_synchronize(void* stream);
// Page-locked host memory (cudaHostAlloc), which copies to and from a GPU read at full rate and asynchronously;
// nullptr where it cannot be had (a build without CUDA, a machine without a GPU, too little lockable memory),
// and the caller then uses plain host memory, which every copy also accepts.
void* cuda_host_alloc(std::size_t bytes) noexcept;
void cuda_host_free(void* pointer) noexcept;

}  // namespace deltatrain::optim
