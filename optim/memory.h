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

void copy_to_host(void* host, const void* source, std::size_t bytes, Device source_device, void* stream);
void copy_from_host(void* target, Device target_device, const void* host, std::size_t bytes, void* stream);
void fill_zero(void* target, Device device, std::size_t bytes, void* stream);

}  // namespace deltatrain::optim
