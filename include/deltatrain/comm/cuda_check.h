// CUDA runtime errors as Failure, naming the call and the code. Shared by the CUDA code of comm and
// optim (it belongs in core once core grows CUDA helpers).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "deltatrain/core/error.h"

namespace deltatrain {

inline void cuda_check(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  throw Failure(std::string(call) + " failed: " + cudaGetErrorString(status) + " (code " +
                std::to_string(static_cast<int>(status)) + ")");
}

}  // namespace deltatrain
