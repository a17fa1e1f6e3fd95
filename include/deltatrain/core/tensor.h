// TensorView: a non-owning description of a strided array (pointer, dtype, shape, strides, device).
// It is the one currency between bindings and the library; the library never allocates user tensors.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace deltatrain {

enum class DType : std::uint8_t { f16, bf16, f32, f64, i32, i64, u8 };

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
bool is_floating(DType dtype);

enum class DeviceType : std::uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  bool operator==(const Device&) const = default;
};

std::string device_name(Device device);

struct TensorView {
  // Fixed capacity keeps a view allocation-free: host overhead per GPU call matters.
  static constexpr int kMaxDims = 6;

  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  std::array<std::int64_t, kMaxDims> shape{};
  std::array<std::int64_t, kMaxDims> strides{};  // in elements, not bytes
  Device device{};

  // A densely packed row-major view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device = {});

  std::int64_t numel() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  std::string shape_string() const;  // "[1, 64, 16, 128]"

  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

}  // namespace deltatrain
