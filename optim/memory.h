// Owning flat memory on the optimizer's device (host, or one GPU), and copies to and from the host.
// Device copies are enqueued on the caller's stream and waited for: their callers need the bytes now.
#pragma once

#include <cstddef>

#include "deltatrain/core/allocator.h"
#include "deltatrain/core/tensor.h"

namespace deltatrain::optim {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Zero-filled; from `allocator` when given (its device must be `device`), else plain device memory.
  DeviceBuffer(Device device, std::size_t bytes, Allocator* allocator = nullptr);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  Device device_{};
  Allocator* allocator_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Host memory for chunks on their way between files and a device, never zero-filled (every byte is written
// before it is read). `page_locked`: pinned where CUDA can pin it, so that copies to and from a GPU run at full
// rate and without a bounce buffer; plain host memory otherwise (a build without CUDA, host-only callers).
class StagingBuffer {
 public:
  StagingBuffer(std::size_t bytes, bool page_locked);
  ~StagingBuffer();
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  char* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  char* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool page_locked_ = false;
};

void copy_to_host(void* host, const void* source, std::size_t bytes, Device source_device, void* stream);
void copy_from_host(void* target, Device target_device, const void* host, std::size_t bytes, void* stream);
// Enqueued on `stream` for a GPU target and not waited for: call wait_for_copies before `host` is reused
// (a host target is copied at once).
void copy_from_host_async(void* target, Device target_device, const void* host, std::size_t bytes, void* stream);
void wait_for_copies(Device device, void* stream);
// Both buffers on `device`.
void copy_on_device(void* target, const void* source, std::size_t bytes, Device device, void* stream);
void fill_zero(void* target, Device device, std::size_t bytes, void* stream);

}  // namespace deltatrain::optim
