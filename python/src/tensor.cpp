#include "tensor.h"

#include <dlpack/dlpack.h>
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

// DLPack 1.3's C exchange API, which torch >= 2.10 puts on its tensor type: a C function describes a tensor
// in well under a microsecond, where the Python __dlpack__ protocol spends several microseconds of
// interpreter per tensor (tens per call of the operator). Null where the type does not offer it.
const DLPackExchangeAPI* exchange_api_of(nb::handle object) {
  PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(Py_TYPE(object.ptr())),
                                             "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  auto* api = static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
  Py_DECREF(capsule);  // the table lives as long as the process (DLPack's rule), the capsule on the type
  if (api == nullptr) PyErr_Clear();
  if (api == nullptr || api->header.version.major != DLPACK_MAJOR_VERSION ||
      api->dltensor_from_py_object_no_sync == nullptr) {
    return nullptr;
  }
  return api;
}

}  // namespace

// What a tensor says of itself, whichever way it was asked.
struct TensorArgs::Description {
  nb::dlpack::dtype dtype;
  bool bfloat16_as_uint16 = false;  // a NumPy bfloat16 array, read through a uint16 view
  int ndim = 0, device_type = 0, device_id = 0;
  const std::int64_t* shape = nullptr;
  const std::int64_t* strides = nullptr;  // null: compact row-major (DLPack before 1.2)
  void* data = nullptr;
};

// Anything nanobind reads as an ndarray: NumPy through the buffer protocol, others through __dlpack__.
// The arrays are kept, so that what they describe stays valid until this TensorArgs goes.
void TensorArgs::describe_through_nanobind(nb::handle object, const char* name, bool writable, Description& d) {
  if (is_numpy_bfloat16(object)) {
    derived_.push_back(object.attr("view")("uint16"));
    object = derived_.back();
    d.bfloat16_as_uint16 = true;
  }
  const auto not_an_array = [&] {
    return InvalidArgument(name, "expected a NumPy array or a DLPack tensor (torch, ...), got " + type_name_of(object));
  };
  const auto read = [&](const auto& array) {
    d.dtype = array.dtype();
    d.ndim = static_cast<int>(array.ndim());
    d.shape = array.shape_ptr();
    d.strides = array.stride_ptr();
    d.device_type = array.device_type();
    d.device_id = array.device_id();
    d.data = const_cast<void*>(static_cast<const void*>(array.data()));
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
}

TensorView TensorArgs::view(nb::handle object, const char* name, bool writable) {
  if (object.is_none()) throw InvalidArgument(name, "is required, got None");
  Description d;
  if (const DLPackExchangeAPI* api = exchange_api_of(object)) {
    DLTensor exchanged;  // its shape and strides belong to the tensor, valid while it lives
    if (api->dltensor_from_py_object_no_sync(object.ptr(), &exchanged) != 0) {
      // The exporter should have set a Python error; one that did not still gets a clear error, not a crash.
      std::string reason = "its type's DLPack exchange API reported a failure";
      if (PyErr_Occurred() != nullptr) reason += std::string(": ") + nb::python_error().what();
      throw InvalidArgument(name, "could not be read: " + reason);
    }
    d.dtype = {exchanged.dtype.code, exchanged.dtype.bits, exchanged.dtype.lanes};
    d.ndim = exchanged.ndim;
    d.device_type = exchanged.device.device_type;
    d.device_id = exchanged.device.device_id;
    d.shape = exchanged.shape;
    d.strides = exchanged.strides;
    d.data = static_cast<char*>(exchanged.data) + exchanged.byte_offset;
  } else {
    describe_through_nanobind(object, name, writable, d);
  }
  if (d.ndim > TensorView::kMaxDims) {
    throw InvalidArgument(name, "has " + std::to_string(d.ndim) + " dimensions; at most " +
                                    std::to_string(TensorView::kMaxDims) + " are supported");
  }
  TensorView view;
  view.data = d.data;
  view.dtype = d.bfloat16_as_uint16 ? DType::bf16 : dtype_of(d.dtype, name);
  view.device = device_of(d.device_type, d.device_id, name);
  view.ndim = d.ndim;
  std::int64_t compact_stride = 1;
  for (int dim = d.ndim - 1; dim >= 0; --dim) {
    view.shape[dim] = d.shape[dim];
    view.strides[dim] = d.strides != nullptr ? d.strides[dim] : compact_stride;
    compact_stride *= d.shape[dim];
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
      } catch (const OutOfMemory& e) {
        PyErr_SetString(PyExc_MemoryError, e.what());
      } catch (const Error& e) {  // Unavailable, Failure, StateError
        PyErr_SetString(PyExc_RuntimeError, e.what());
      }
    });
    return true;
  }();
  (void)registered;
}

}  // namespace deltatrain::python
