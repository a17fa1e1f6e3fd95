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
void cuda_zero(void* target, std::size_t bytes, void* stream);
void cuda_synchronize(void* stream);

}  // namespace deltatrain::optim
