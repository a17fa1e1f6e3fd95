// Host-side access to the caller's tensors in the backend's compute type (float or double).
// Inputs are viewed in place when their dtype already is the compute type and converted otherwise;
// outputs are written in place or through a buffer converted once at commit().
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "deltatrain/core/bfloat16.h"
#include "deltatrain/core/tensor.h"
#include "deltatrain/gdn/backend.h"
#include "host/parallel.h"

namespace deltatrain::gdn::host {

template <class T>
T load_element(const void* base, DType dtype, std::int64_t index) {
  switch (dtype) {
    case DType::f16:
      return static_cast<T>(static_cast<const _Float16*>(base)[index]);
    case DType::bf16:
      return static_cast<T>(bf16_to_float(static_cast<const std::uint16_t*>(base)[index]));
    case DType::f32:
      return static_cast<T>(static_cast<const float*>(base)[index]);
    case DType::f64:
      return static_cast<T>(static_cast<const double*>(base)[index]);
    default:
      return T(0);  // validation admits floating dtypes only
  }
}

template <class T>
void store_element(void* base, DType dtype, std::int64_t index, T value) {
  switch (dtype) {
    case DType::f16:
      static_cast<_Float16*>(base)[index] = static_cast<_Float16>(value);
      break;
    case DType::bf16:
      static_cast<std::uint16_t*>(base)[index] = float_to_bf16(static_cast<float>(value));
      break;
    case DType::f32:
      static_cast<float*>(base)[index] = static_cast<float>(value);
      break;
    case DType::f64:
      static_cast<double*>(base)[index] = static_cast<double>(value);
      break;
    default:
      break;
  }
}

template <class T>
constexpr DType dtype_of() {
  return sizeof(T) == 8 ? DType::f64 : DType::f32;
}

// The message of an allocation that failed: which tensor's copy, in which type, how large.
template <class T>
std::string copy_description(const TensorView& view, const char* name) {
  return std::string("a ") + dtype_name(dtype_of<T>()) + " copy of '" + name + "' " + view.shape_string() + " (" +
         format_bytes(static_cast<double>(view.numel()) * sizeof(T)) + ")";
}

// A read-only input in compute type T.
template <class T>
class InputArray {
 public:
  InputArray(const TensorView& view, const char* name) {
    if (view.dtype == dtype_of<T>()) {
      data_ = view.ptr<const T>();
      return;
    }
    allocating(copy_description<T>(view, name), [&] { storage_.resize(static_cast<std::size_t>(view.numel())); });
    for (std::int64_t i = 0; i < view.numel(); ++i) storage_[i] = load_element<T>(view.data, view.dtype, i);
    data_ = storage_.data();
  }
  const T* data() const { return data_; }
  const T& operator[](std::int64_t i) const { return data_[i]; }

 private:
  const T* data_ = nullptr;
  std::vector<T> storage_;
};

// An output in compute type T; commit() converts into the caller's dtype when they differ.
template <class T>
class OutputArray {
 public:
  OutputArray(const TensorView& view, const char* name) : view_(view) {
    if (view.dtype == dtype_of<T>()) {
      data_ = view.ptr<T>();
    } else {
      allocating(copy_description<T>(view, name), [&] { storage_.resize(static_cast<std::size_t>(view.numel())); });
      data_ = storage_.data();
    }
  }
  T* data() { return data_; }
  T& operator[](std::int64_t i) { return data_[i]; }
  void commit() {
    if (storage_.empty()) return;
    for (std::int64_t i = 0; i < view_.numel(); ++i) store_element<T>(view_.data, view_.dtype, i, storage_[i]);
  }

 private:
  TensorView view_;
  T* data_ = nullptr;
  std::vector<T> storage_;
};

// The operator's inputs in compute type T.
template <class T>
struct InputArrays {
  InputArray<T> q, k, v, g, beta;
  std::optional<InputArray<T>> h0;
  explicit InputArrays(const Inputs& in)
      : q(in.q, "q"), k(in.k, "k"), v(in.v, "v"), g(in.g, "g"), beta(in.beta, "beta") {
    if (in.initial_state) h0.emplace(*in.initial_state, "initial_state");
  }
  // The state sequence n's value head j starts from: its row of initial_state, or zeros.
  void initial_state(const Problem& p, std::int64_t n, std::int64_t j, T* state) const {
    if (h0) {
      std::copy_n(&(*h0)[(p.state_row(n) * p.HV + j) * p.K * p.V], p.K * p.V, state);
    } else {
      std::fill_n(state, p.K * p.V, T(0));
    }
  }
};

// The forward's outputs in compute type T; commit() once everything is written. Final states go straight into
// the caller's tensor, converted state by state: a pool's rows that no sequence ends in stay as they were.
template <class T>
struct ForwardArrays {
  OutputArray<T> o;
  std::optional<TensorView> final_state;
  explicit ForwardArrays(const ForwardOutputs& out) : o(out.o, "o"), final_state(out.final_state) {}
  // Records the state sequence n's value head j ends in (in its row), when the caller asked for final states.
  void store_final_state(const Problem& p, std::int64_t n, std::int64_t j, const T* state) {
    if (!final_state) return;
    const std::int64_t first = (p.state_row(n) * p.HV + j) * p.K * p.V;
    if (final_state->dtype == dtype_of<T>()) {
      std::copy_n(state, p.K * p.V, final_state->ptr<T>() + first);
      return;
    }
    for (std::int64_t i = 0; i < p.K * p.V; ++i) store_element<T>(final_state->data, final_state->dtype, first + i, state[i]);
  }
  void commit() { o.commit(); }
};

// The backward's incoming gradients and its outputs in compute type T.
template <class T>
struct BackwardArrays {
  InputArray<T> d_o;
  std::optional<InputArray<T>> dht;
  OutputArray<T> dq, dk, dv, dg, dbeta;
  std::optional<OutputArray<T>> dh0;
  BackwardArrays(const BackwardInputs& in, const Gradients& out)
      : d_o(in.d_o, "do"), dq(out.dq, "dq"), dk(out.dk, "dk"), dv(out.dv, "dv"), dg(out.dg, "dg"),
        dbeta(out.dbeta, "dbeta") {
    if (in.dht) dht.emplace(*in.dht, "dht");
    if (out.dh0) dh0.emplace(*out.dh0, "dh0");
  }
  // The gradient of the state sequence n's value head j ends in: dht, or zeros.
  void final_state_gradient(const Problem& p, std::int64_t n, std::int64_t j, T* d_state) const {
    if (dht) {
      std::copy_n(&(*dht)[(n * p.HV + j) * p.K * p.V], p.K * p.V, d_state);
    } else {
      std::fill_n(d_state, p.K * p.V, T(0));
    }
  }
  // Records the gradient of the state sequence n's value head j starts from, when there is an initial state.
  void store_initial_state_gradient(const Problem& p, std::int64_t n, std::int64_t j, const T* d_state) {
    if (dh0) std::copy_n(d_state, p.K * p.V, &(*dh0)[(n * p.HV + j) * p.K * p.V]);
  }
  void commit() {
    for (auto* array : {&dq, &dk, &dv, &dg, &dbeta}) array->commit();
    if (dh0) dh0->commit();
  }
};

}  // namespace deltatrain::gdn::host
