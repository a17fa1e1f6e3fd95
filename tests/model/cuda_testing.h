// What the GPU tests of the model and the rollout share.
#pragma once

#include <cuda_runtime_api.h>

#include "deltatrain/core/cuda_check.h"

namespace deltatrain::model::testing {

// A stream of the test's own (CUDA graphs cannot be recorded from the legacy default stream), destroyed at scope
// exit: declare it before the models that run on it.
class Stream {
 public:
  Stream() { cuda_check(cudaStreamCreate(&stream_), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace deltatrain::model::testing
