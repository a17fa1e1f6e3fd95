// Owning flat memory on the optimizer's device (host, or one GPU), and host staging memory for the way between
// files and a device. The copies themselves are core's (deltatrain/core/device_memory.h).
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
  void release() noexcept;

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

}  // namespace deltatrain::optim
