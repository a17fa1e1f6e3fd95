// Plain memory on a Device and the byte copies between it and the host: the one place where the components' host
// code (the model's arena and parameters, the optimizer's buffers and checkpoints) meets the CUDA runtime for memory.
// On the CPU each call is its host counterpart; in a build without CUDA a GPU device raises Unavailable.
// Copies and fills are queued on `stream` (a cudaStream_t, or null for the legacy default stream) and return before
// they complete: synchronize() before the host reads what a copy wrote or reuses what it read. Each call makes
// `device` current for its duration, so a thread whose current device is another (a checkpoint's writer) may use it.
#pragma once

#include <cstddef>

#include "deltatrain/core/tensor.h"

namespace deltatrain {

// At least `bytes`, 256-byte aligned (cuBLASLt and vectorised kernels want aligned operands), uninitialised. A
// failure is a Failure naming the bytes and `what` (std::bad_alloc on the CPU).
void* device_allocate(std::size_t bytes, Device device, const char* what);
void device_free(void* data, Device device) noexcept;  // of device_allocate; null is ignored

// `bytes` from `source` to `target`, either of them host or device memory (the direction comes from the addresses,
// unified addressing; host memory may be pageable or page-locked).
void copy_bytes(void* target, const void* source, std::size_t bytes, Device device, void* stream);
void zero_bytes(void* target, std::size_t bytes, Device device, void* stream);
void synchronize(Device device, void* stream);  // waits for the stream's work; nothing on the CPU

// The memory a device has in all, in bytes: the host's physical memory (sysconf) for the CPU, 0 where it cannot be
// read; for a GPU, its global memory as cuda_info() reports it (Unavailable where that GPU cannot be used). For
// refusing up front, naming the flag, a size that the device that will hold it cannot hold, rather than failing later
// as an allocation naming nothing.
std::size_t device_total_memory(Device device);

// Page-locked host memory (cudaHostAlloc), which copies to and from a GPU read at full rate and asynchronously;
// null where it cannot be had (a build without CUDA, a machine without a GPU, too little lockable memory), and the
// caller then uses plain host memory, which every copy also accepts.
void* page_locked_allocate(std::size_t bytes) noexcept;
void page_locked_free(void* data) noexcept;  // waits for the device's work, so that no copy still reads it

}  // namespace deltatrain
