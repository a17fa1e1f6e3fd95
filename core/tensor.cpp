#include "deltatrain/core/tensor.h"

#include "deltatrain/core/error.h"

namespace deltatrain {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f16:
      return "float16";
    case DType::bf16:
      return "bfloat16";
    case DType::f32:
      return "float32";
    case DType::f64:
      return "float64";
    case DType::i32:
      return "int32";
    case DType::i64:
      return "int64";
    case DType::u8:
      return "uint8";
  }
  return "unknown";
}

bool is_floating(DType dtype) {
  return dtype == DType::f16 || dtype == DType::bf16 || dtype == DType::f32 || dtype == DType::f64;
}

std::string device_name(Device device) {
  return device.type == DeviceType::cpu ? "cpu" : "cuda:" + std::to_string(device.index);
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                  Device device) {
  if (shape.size() > kMaxDims) {
    throw InvalidArgument("shape", "at most " + std::to_string(kMaxDims) + " dimensions are supported");
  }
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.device = device;
  view.ndim = static_cast<int>(shape.size());
  int d = 0;
  for (std::int64_t extent : shape) view.shape[d++] = extent;
  std::int64_t stride = 1;
  for (d = view.ndim - 1; d >= 0; --d) {
    view.strides[d] = stride;
    stride *= view.shape[d];
  }
  return view;
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  // An empty tensor addresses no element, so any strides describe it (NumPy gives some all-zero strides).
  if (numel() == 0) return true;
  std::int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    // A dimension of extent 1 may carry any stride: it is never stepped over.
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::string text = "[";
  for (int d = 0; d < ndim; ++d) {
    if (d) text += ", ";
    text += std::to_string(shape[d]);
  }
  return text + "]";
}

}  // namespace deltatrain
