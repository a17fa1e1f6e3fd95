#include "memory.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "deltatrain/core/device_memory.h"
#include "deltatrain/core/error.h"

namespace deltatrain::optim {

namespace {

// Host buffers are aligned for the widest vector loads of the CPU loops.
constexpr std::size_t kHostAlignment = 64;

}  // namespace

DeviceBuffer::DeviceBuffer(Device device, std::size_t bytes, Allocator* allocator)
    : device_(device), allocator_(allocator), bytes_(bytes) {
  if (bytes == 0) return;
  if (allocator != nullptr && allocator->device() != device) {
    throw InvalidArgument("allocator", "allocates on " + device_name(allocator->device()) + ", the buffer belongs on " +
                                           device_name(device));
  }
  data_ = allocator != nullptr ? allocator->allocate(bytes, "optimizer buffer")
                               : device_allocate(bytes, device, "optimizer buffer");
  try {
    zero_bytes(data_, bytes, device, nullptr);  // the legacy stream: ordered before the optimizer's (blocking) stream
  } catch (...) {
    release();  // a constructor that throws runs no destructor
    throw;
  }
}

DeviceBuffer::~DeviceBuffer() { release(); }

void DeviceBuffer::release() noexcept {
  if (data_ == nullptr) return;
  if (allocator_ != nullptr) {
    allocator_->deallocate(data_);
  } else {
    device_free(data_, device_);
  }
  data_ = nullptr;
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
  if (page_locked) data_ = static_cast<char*>(page_locked_allocate(bytes));
  page_locked_ = data_ != nullptr;
  if (data_ == nullptr) {
    const std::size_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
    data_ = static_cast<char*>(std::aligned_alloc(kHostAlignment, rounded));
    if (data_ == nullptr) throw std::bad_alloc();
  }
}

StagingBuffer::~StagingBuffer() {
  if (page_locked_) {
    page_locked_free(data_);
  } else {
    std::free(data_);
  }
}

}  // namespace deltatrain::optim
