// The defaults of the inference operations (ops.h): a device whose kernels do not have them yet says so.
#include "ops.h"

#include <string>

#include "deltatrain/core/error.h"

namespace deltatrain::model {
namespace {

[[noreturn]] void not_on_this_device(const char* operation) {
  throw Unavailable(std::string(operation) + " on this device", "decode kernels are not implemented on the GPU yet");
}

}  // namespace

void Ops::copy_rows(const TensorView&, const IndexArray&, const TensorView&, const IndexArray&) {
  not_on_this_device("copy_rows");
}

void Ops::conv1d_silu_step(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                           const IndexArray&) {
  not_on_this_device("conv1d_silu_step");
}

void Ops::rope_at_positions(const TensorView&, int, int, int, double, const IndexArray&) {
  not_on_this_device("rope_at_positions");
}

void Ops::cached_attention(const TensorView&, const TensorView&, const TensorView&, const TensorView&, int, int, int,
                           double, const IndexArray&, const IndexArray&, const IndexArray&) {
  not_on_this_device("cached_attention");
}

}  // namespace deltatrain::model
