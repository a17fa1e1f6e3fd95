// CUDA runtime errors as Failure, naming the call, the runtime's message and the code, and the guard that makes
// a device current for a scope. For code built with CUDA only (it includes the runtime's header).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "deltatrain/core/error.h"

namespace deltatrain {

inline void cuda_check(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  throw Failure(std::string(call) + " failed: " + cudaGetErrorString(status) + " (" + cudaGetErrorName(status) + ")");
}

// Makes `device` current for the scope and restores the caller's device afterwards (when it was another).
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ == device) {
      previous_ = -1;
    } else {
      cuda_check(cudaSetDevice(device), "cudaSetDevice");
    }
  }
  ~CudaDeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace deltatrain
