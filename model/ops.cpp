// What every implementation of Ops shares: the check of a matrix view, and the defaults of the inference
// operations (a device whose kernels do not have them yet says so).
#include "ops.h"

#include <algorithm>
#include <string>

#include "deltatrain/core/error.h"

namespace deltatrain::model {
namespace {

[[noreturn]] void not_on_this_device(const char* operation) {
  throw Unavailable(std::string(operation) + " on this device", "decode kernels are not implemented on the GPU yet");
}

std::string extent(std::int64_t n) { return n == kAnyExtent ? "?" : std::to_string(n); }

}  // namespace

MatrixLayout matrix_layout(const TensorView& v, const char* name, std::int64_t rows, std::int64_t cols) {
  if (v.ndim != 2 || (rows != kAnyExtent && v.shape[0] != rows) || (cols != kAnyExtent && v.shape[1] != cols))
    throw InvalidArgument(name, "must have shape [" + extent(rows) + ", " + extent(cols) + "], got " + v.shape_string());
  const std::int64_t r = v.shape[0], c = v.shape[1];
  // Strides matter only where there is more than one row or column to step over.
  if ((c > 1 && v.strides[1] != 1) || (r > 1 && v.strides[0] < c))
    throw InvalidArgument(name, "must have unit column stride and a row stride >= its columns, got strides [" +
                                    std::to_string(v.strides[0]) + ", " + std::to_string(v.strides[1]) + "]");
  if (v.data == nullptr && r * c > 0) throw InvalidArgument(name, "has no data");
  return {r, c, r > 1 ? v.strides[0] : std::max<std::int64_t>(c, 1)};
}

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
