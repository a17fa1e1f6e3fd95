// Test support for the cuda GDN backend: samples (tests/gdn/gdn_testing.h) uploaded to the GPU, outputs
// poisoned with NaN before each call and read back, and the relative Frobenius error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gdn_testing.h"

namespace deltatrain::gdn::testing {

// Why GPU tests cannot run here, or empty when the cuda backend is usable.
std::string cuda_backend_unusable();

// A device copy of a host tensor (or an output of a host tensor's shape and dtype, NaN-filled).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& host, bool poisoned = false);
  DeviceTensor(DeviceTensor&& other) noexcept;
  DeviceTensor& operator=(DeviceTensor&& other) noexcept;
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor();

  TensorView view() const;
  HostTensor download() const;
  void poison();  // all bits set: NaN in every float format

 private:
  HostTensor shape_of_;
  void* data_ = nullptr;
};

struct DeviceCallOptions {
  bool cu_seqlens_on_device = true;  // with its host copy; false: cu_seqlens on the CPU
  bool final_state = true;
  cudaStream_t stream = nullptr;
};

// A sample's inputs on the GPU, alive while the object is.
class DeviceSample {
 public:
  DeviceSample(const Sample& sample, const DeviceCallOptions& options);
  const Inputs& inputs() const { return inputs_; }
  Options options(const DeviceCallOptions& call) const;

 private:
  Sample sample_;
  DeviceTensor q_, k_, v_, g_, beta_, h0_, cu_seqlens_;
  HostTensor cu_seqlens_host_;
  Inputs inputs_;
};

// The forward (chunked or recurrent) and the backward on the cuda backend, outputs poisoned first.
ForwardResult cuda_forward(const Sample& sample, const DeviceCallOptions& options, bool recurrent = false);
BackwardResult cuda_backward(const Sample& sample, const Cotangents& cotangents, const DeviceCallOptions& options);
// The chunked forward filling a saved buffer (ForwardOutputs::saved, poisoned first, of forward_saved_bytes) and the
// backward reading it, on one upload of the sample: what an autograd caller does.
struct SavedRun {
  ForwardResult forward;
  BackwardResult backward;
  std::size_t saved_bytes = 0;
};
SavedRun cuda_forward_backward_saved(const Sample& sample, const Cotangents& cotangents,
                                     const DeviceCallOptions& options);
// The recurrent step on a pool of states (state_indices on the GPU with their host copy; sample.h0 is not used),
// o poisoned first: o, and in ht the final pool (when options.final_state).
ForwardResult cuda_recurrent_on_pool(const Sample& sample, const StatePool& pool, const DeviceCallOptions& options);

// ||actual - expected||_F / ||expected||_F; infinite when anything is not finite.
double frobenius_error(const std::vector<double>& actual, const std::vector<double>& expected);
::testing::AssertionResult frobenius_close(const std::string& what, const std::vector<double>& actual,
                                           const std::vector<double>& expected, double tolerance);

// The accuracy the cuda backend owes the fp64 reference (relative Frobenius error) for inputs of this dtype.
double cuda_tolerance(DType io);

}  // namespace deltatrain::gdn::testing
