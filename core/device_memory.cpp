#include "deltatrain/core/device_memory.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#ifdef DELTATRAIN_WITH_CUDA
#include "deltatrain/core/cuda_check.h"
#endif

namespace deltatrain {
namespace {

constexpr std::size_t kAlignment = 256;

#ifdef DELTATRAIN_WITH_CUDA
cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }
#else
[[noreturn]] void unavailable(const char* what, Device device) {
  throw Unavailable(std::string(what) + " on " + device_name(device), "this build of deltatrain has no CUDA support");
}
#endif

}  // namespace

void* device_allocate(std::size_t bytes, Device device, const char* what) {
  if (device.type == DeviceType::cpu) {
    void* data = std::aligned_alloc(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
    if (data == nullptr) throw std::bad_alloc();
    return data;
  }
#ifdef DELTATRAIN_WITH_CUDA
  const CudaDeviceGuard guard(device.index);
  void* data = nullptr;
  cuda_check(cudaMalloc(&data, bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes of " + what).c_str());
  return data;
#else
  unavailable(what, device);
#endif
}

void device_free(void* data, Device device) noexcept {
  if (device.type == DeviceType::cpu) {
    std::free(data);
    return;
  }
#ifdef DELTATRAIN_WITH_CUDA
  cudaFree(data);  // callers are destructors: nothing to do about a failure
#endif
}

void copy_bytes(void* target, const void* source, std::size_t bytes, Device device, [[maybe_unused]] void* stream) {
  if (bytes == 0) return;
  if (device.type == DeviceType::cpu) {
    std::memcpy(target, source, bytes);
    return;
  }
#ifdef DELTATRAIN_WITH_CUDA
  const CudaDeviceGuard guard(device.index);
  cuda_check(cudaMemcpyAsync(target, source, bytes, cudaMemcpyDefault, as_stream(stream)),
             ("cudaMemcpyAsync of " + std::to_string(bytes) + " bytes").c_str());
#else
  unavailable("a copy", device);
#endif
}

void zero_bytes(void* target, std::size_t bytes, Device device, [[maybe_unused]] void* stream) {
  if (bytes == 0) return;
  if (device.type == DeviceType::cpu) {
    std::memset(target, 0, bytes);
    return;
  }
#ifdef DELTATRAIN_WITH_CUDA
  const CudaDeviceGuard guard(device.index);
  cuda_check(cudaMemsetAsync(target, 0, bytes, as_stream(stream)),
             ("cudaMemsetAsync of " + std::to_string(bytes) + " bytes").c_str());
#else
  unavailable("a fill", device);
#endif
}

void synchronize(Device device, [[maybe_unused]] void* stream) {
  if (device.type == DeviceType::cpu) return;
#ifdef DELTATRAIN_WITH_CUDA
  const CudaDeviceGuard guard(device.index);
  cuda_check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
#else
  unavailable("a stream", device);
#endif
}

std::size_t device_total_memory(Device device) {
  if (device.type == DeviceType::cpu) {
    const long pages = sysconf(_SC_PHYS_PAGES), page_bytes = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page_bytes > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page_bytes) : 0;
  }
  // The GPU's memory as cuda_info() read it once for the process (deltatrain info shows the same figure).
  const CudaInfo& cuda = cuda_info();
  if (!cuda.usable() || device.index < 0 || device.index >= static_cast<int>(cuda.gpus.size())) {
    throw Unavailable("the memory of " + device_name(device), cuda.usable() ? "no such GPU" : cuda.unavailable_reason);
  }
  return cuda.gpus[device.index].memory_bytes;
}

void* page_locked_allocate(std::size_t bytes) noexcept {
#ifdef DELTATRAIN_WITH_CUDA
  void* data = nullptr;
  if (cudaHostAlloc(&data, bytes, cudaHostAllocDefault) == cudaSuccess) return data;
  cudaGetLastError();  // the failure is answered by plain memory; it must not surface in a later check
#else
  (void)bytes;
#endif
  return nullptr;
}

void page_locked_free(void* data) noexcept {
#ifdef DELTATRAIN_WITH_CUDA
  if (data != nullptr) cudaFreeHost(data);
#else
  (void)data;
#endif
}

}  // namespace deltatrain
