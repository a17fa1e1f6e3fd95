// CUDA runtime errors as Failure, naming the call, the runtime's message and the code. For code built
// with CUDA only (it includes the runtime's header).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "deltatrain/core/error.h"

namespace deltatrain {

inline void cuda_check(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  throw Failure(std::string(call) + " failed: " + cudaGetErrorString(status) + " (" + cudaGetErrorName(status) + ")");
}

}  // namespace deltatrain
