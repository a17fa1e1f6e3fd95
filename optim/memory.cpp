#include "memory.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "cuda_calls.h"
#include "deltatrain/core/error.h"

namespace deltatrain::optim {

namespace {

// Host buffers are aligned for the widest vector loads of the CPU loops.
constexpr std::size_t kHostAlignment = 64;

}  // namespace

DeviceBuffer::DeviceBuffer(Device device, std::size_t bytes, Allocator* allocator)
    : device_(device), allocator_(allocator), bytes_(bytes) {
  if (bytes == 0) return;
  if (allocator != nullptr) {
    if (allocator->device() != device) {
      throw InvalidArgument("allocator", "allocates on " + device_name(allocator->device()) + ", the buffer belongs on " +
                                             device_name(device));
    }
    data_ = allocator->allocate(bytes, "optimizer buffer");
    fill_zero(data_, device, bytes, nullptr);
    return;
  }
  if (device.type == DeviceType::cpu) {
    data_ = std::aligned_alloc(kHostAlignment, (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment);
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(data_, 0, bytes);
    return;
  }
  data_ = cuda_alloc(device.index, bytes);
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ == nullptr) return;
  if (allocator_ != nullptr) {
    allocator_->deallocate(data_);
  } else if (device_.type == DeviceType::cpu) {
    std::free(data_);
  } else {
    cuda_free(data_);
  }
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(other.device_),
      allocator_(other.allocator_),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    DeviceBuffer old(std::move(*this));
    device_ = other.device_;
    allocator_ = other.allocator_;
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

StagingBuffer::StagingBuffer(std::size_t bytes, bool page_locked) : bytes_(bytes) {
  if (bytes == 0) return;
  if (page_locked) data_ = static_cast<char*>(cuda_host_alloc(bytes));
  page_locked_ = data_ != nullptr;
  if (data_ == nullptr) {
    const std::size_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
    data_ = static_cast<char*>(std::aligned_alloc(kHostAlignment, rounded));
    if (data_ == nullptr) throw std::bad_alloc();
  }
}

StagingBuffer::~StagingBuffer() {
  if (page_locked_) {
    cuda_host_free(data_);  // waits for the device, so no copy still reads it
  } else {
    std::free(data_);
  }
}

void copy_to_host(void* host, const void* source, std::size_t bytes, Device source_device, void* stream) {
  if (source_device.type == DeviceType::cpu) {
    std::memcpy(host, source, bytes);
    return;
  }
  cuda_copy(host, source, bytes, stream);
}

void copy_from_host(void* target, Device target_device, const void* host, std::size_t bytes, void* stream) {
  if (target_device.type == DeviceType::cpu) {
    std::memcpy(target, host, bytes);
    return;
  }
  cuda_copy(target, host, bytes, stream);
}

void copy_from_host_async(void* target, Device target_device, const void* host, std::size_t bytes, void* stream) {
  if (target_device.type == DeviceType::cpu) {
    std::memcpy(target, host, bytes);
    return;
  }
  cuda_copy_async(target, host, bytes, stream);
}

void wait_for_copies(Device device, void* stream) {
  if (device.type != DeviceType::cpu) cuda_synchronize(stream);
}

void copy_on_device(void* target, const void* source, std::size_t bytes, Device device, void* stream) {
  if (device.type == DeviceType::cpu) {
    std::memcpy(target, source, bytes);
    return;
  }
  cuda_copy(target, source, bytes, stream);
}

void fill_zero(void* target, Device device, std::size_t bytes, void* stream) {
  if (device.type == DeviceType::cpu) {
    std::memset(target, 0, bytes);
    return;
  }
  cuda_zero(target, bytes, stream);
}

}  // namespace deltatrain::optim
