#include <string>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "kernels.h"

namespace deltatrain::model::cuda {

Workspace::~Workspace() {
  // Stream-ordered, like every use: work still queued on the stream finishes first. A destructor cannot
  // throw, and a failure here can only mean the context is already gone with the memory.
  if (data_ != nullptr) cudaFreeAsync(data_, stream_);
}

std::byte* Workspace::reserve(std::size_t bytes) {
  if (bytes <= bytes_) return data_;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(stream_, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) {
    throw StateError("the GPU model's kernels need " + std::to_string(bytes) + " bytes of workspace but hold " +
                     std::to_string(bytes_) + ", and the stream is being captured; run the same step once before capturing it");
  }
  // The old buffer is released after the work already queued on the stream has used it.
  if (data_ != nullptr) cuda_check(cudaFreeAsync(data_, stream_), "cudaFreeAsync (model workspace)");
  data_ = nullptr;
  bytes_ = 0;
  const std::size_t grown = bytes + bytes / 4;  // fewer regrowths while shapes creep up
  void* data = nullptr;
  cuda_check(cudaMallocAsync(&data, grown, stream_), "cudaMallocAsync (model workspace)");
  data_ = static_cast<std::byte*>(data);
  bytes_ = grown;
  return data_;
}

void check_launch(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw Failure(std::string("launching ") + kernel + " failed: " + cudaGetErrorString(status) + " (" +
                  cudaGetErrorName(status) + ")");
  }
}

int shared_memory_per_block() {
  int device = 0, most = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
  return most;
}

void require_shared_memory(const char* kernel, std::size_t bytes, const std::string& what) {
  const int most = shared_memory_per_block();
  if (bytes > static_cast<std::size_t>(most)) {
    throw Unavailable(kernel, what + " need " + std::to_string(bytes) + " bytes of shared memory a CTA; the GPU has " +
                                  std::to_string(most));
  }
}

}  // namespace deltatrain::model::cuda
