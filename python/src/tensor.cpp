#include "tensor.h"

#include <nanobind/stl/string.h>

#include <string>

#include "deltatrain/core/error.h"

namespace nb = nanobind;

namespace deltatrain::python {
namespace {

// DLPack device types (dlpack.h): what the library can address.
constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3;

DType dtype_of(nb::dlpack::dtype dt, const char* name) {
  using Code = nb::dlpack::dtype_code;
  if (dt.lanes == 1) {
    switch (static_cast<Code>(dt.code)) {
      case Code::Float:
        if (dt.bits == 16) return DType::f16;
        if (dt.bits == 32) return DType::f32;
        if (dt.bits == 64) return DType::f64;
        break;
      case Code::Bfloat:
        if (dt.bits == 16) return DType::bf16;
        break;
      case Code::Int:
        if (dt.bits == 32) return DType::i32;
        if (dt.bits == 64) return DType::i64;
        break;
      case Code::UInt:
        if (dt.bits == 8) return DType::u8;
        break;
      default:
        break;
    }
  }
  throw InvalidArgument(name, "unsupported dtype (DLPack code " + std::to_string(dt.code) + ", " +
                                  std::to_string(dt.bits) + " bits, " + std::to_string(dt.lanes) +
                                  " lanes); expected float16, bfloat16, float32, float64, int32 or int64");
}

Device device_of(int type, int index, const char* name) {
  if (type == kDLCPU || type == kDLCUDAHost) return Device{DeviceType::cpu, 0};
  if (type == kDLCUDA) return Device{DeviceType::cuda, index};
  throw InvalidArgument(name, "lives on DLPack device type " + std::to_string(type) +
                                  "; only CPU and CUDA memory are supported");
}

std::string type_name_of(nb::handle object) { return nb::type_name(object.type()).c_str(); }

bool is_numpy_bfloat16(nb::handle object) {
  const auto text = [](nb::handle value) { return nb::cast<std::string>(nb::str(value)); };
  return type_name_of(object) == "ndarray" && text(object.type().attr("__module__")) == "numpy" &&
         text(object.attr("dtype")) == "bfloat16";
}

}  // namespace

TensorView TensorArgs::view(nb::handle object, const char* name, bool writable) {
  if (object.is_none()) throw InvalidArgument(name, "is required, got None");
  bool bfloat16 = false;
  if (is_numpy_bfloat16(object)) {
    derived_.push_back(object.attr("view")("uint16"));
    object = derived_.back();
    bfloat16 = true;
  }
  const auto not_an_array = [&] {
    return InvalidArgument(name, "expected a NumPy array or a DLPack tensor (torch, ...), got " + type_name_of(object));
  };
  nb::dlpack::dtype dt;
  int ndim = 0, device_type = 0, device_id = 0;
  const std::int64_t *shape = nullptr, *strides = nullptr;
  void* data = nullptr;
  const auto read = [&](const auto& array) {
    dt = array.dtype();
    ndim = static_cast<int>(array.ndim());
    shape = array.shape_ptr();
    strides = array.stride_ptr();
    device_type = array.device_type();
    device_id = array.device_id();
    data = const_cast<void*>(static_cast<const void*>(array.data()));
  };
  if (writable) {
    nb::ndarray<> array;
    if (!nb::try_cast(object, array, false)) {
      nb::ndarray<nb::ro> readable;
      if (nb::try_cast(object, readable, false)) throw InvalidArgument(name, "is read-only; outputs must be writable");
      throw not_an_array();
    }
    read(array);
    writable_.push_back(std::move(array));
  } else {
    nb::ndarray<nb::ro> array;
    if (!nb::try_cast(object, array, false)) throw not_an_array();
    read(array);
    read_only_.push_back(std::move(array));
  }
  if (ndim > TensorView::kMaxDims) {
    throw InvalidArgument(name, "has " + std::to_string(ndim) + " dimensions; at most " +
                                    std::to_string(TensorView::kMaxDims) + " are supported");
  }
  TensorView view;
  view.data = data;
  view.dtype = bfloat16 ? DType::bf16 : dtype_of(dt, name);
  view.device = device_of(device_type, device_id, name);
  view.ndim = ndim;
  for (int d = 0; d < ndim; ++d) {
    view.shape[d] = shape[d];
    view.strides[d] = strides[d];
  }
  return view;
}

TensorView TensorArgs::input(nb::handle object, const char* name) { return view(object, name, false); }
TensorView TensorArgs::output(nb::handle object, const char* name) { return view(object, name, true); }

std::optional<TensorView> TensorArgs::optional_input(nb::handle object, const char* name) {
  if (object.is_none()) return std::nullopt;
  return input(object, name);
}

std::optional<TensorView> TensorArgs::optional_output(nb::handle object, const char* name) {
  if (object.is_none()) return std::nullopt;
  return output(object, name);
}

void register_error_translators() {
  static const bool registered = [] {
    nb::register_exception_translator([](const std::exception_ptr& error, void*) {
      try {
        std::rethrow_exception(error);
      } catch (const InvalidArgument& e) {
        PyErr_SetString(PyExc_ValueError, e.what());
      } catch (const Error& e) {  // Unavailable, Failure, StateError
        PyErr_SetString(PyExc_RuntimeError, e.what());
      }
    });
    return true;
  }();
  (void)registered;
}

}  // namespace deltatrain::python
