// Python tensors as TensorViews, and the library's errors as Python exceptions.
//
// Any object nanobind can read as an ndarray is accepted: NumPy arrays, and anything with __dlpack__
// (torch, JAX, CuPy, ...); types offering DLPack's C exchange API (torch >= 2.10) are read through it.
// NumPy has no bfloat16 of its own; arrays of ml_dtypes.bfloat16 are read through a uint16 view of the same
// memory. Bad tensors raise ValueError naming the argument.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>
#include <vector>

#include "deltatrain/core/tensor.h"

namespace deltatrain::python {

// Views into Python objects, and the references that keep those objects alive while the views are used.
// Release the GIL only while the views are in use, never while this is being built or destroyed.
class TensorArgs {
 public:
  TensorView input(nanobind::handle object, const char* name);
  TensorView output(nanobind::handle object, const char* name);  // must be writable
  std::optional<TensorView> optional_input(nanobind::handle object, const char* name);
  std::optional<TensorView> optional_output(nanobind::handle object, const char* name);

 private:
  struct Description;
  TensorView view(nanobind::handle object, const char* name, bool writable);
  void describe_through_nanobind(nanobind::handle object, const char* name, bool writable, Description& d);

  std::vector<nanobind::ndarray<nanobind::ro>> read_only_;
  std::vector<nanobind::ndarray<>> writable_;
  std::vector<nanobind::object> derived_;  // uint16 views of bfloat16 NumPy arrays
};

// InvalidArgument -> ValueError, Unavailable / Failure / StateError -> RuntimeError. Idempotent, so that
// every component's bind function may call it.
void register_error_translators();

}  // namespace deltatrain::python
