// Helpers shared by the tests that run under mpirun, for both engines: a seed every rank agrees on,
// groups by engine name (skipping where the engine cannot run), and buffers on a group's device.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "deltatrain/comm/group.h"
#include "deltatrain/core/tensor.h"

namespace deltatrain::testing_support {

// Drawn from std::random_device on rank 0 of `comm`, the same on every rank.
std::uint64_t shared_seed(MPI_Comm comm = MPI_COMM_WORLD);

// A fresh directory that every rank of `comm` sees (made by rank 0), removed by the destructor
// (collective).
class SharedTempDir {
 public:
  explicit SharedTempDir(MPI_Comm comm = MPI_COMM_WORLD);
  ~SharedTempDir();
  const std::filesystem::path& path() const { return path_; }

 private:
  MPI_Comm comm_;
  std::filesystem::path path_;
};

// "mpi" or "nccl" (one GPU per rank). Empty `skip_reason` unless the engine cannot run here.
std::unique_ptr<comm::Group> make_group(const std::string& engine, MPI_Comm members, std::string* skip_reason);

// Copies between host memory and a (contiguous) view on any device, waiting for the device first.
void copy_into(const TensorView& view, const void* host);
void copy_from(const TensorView& view, void* host);

// Memory on a device, filled and read from host vectors; device work is waited for first.
class DeviceMemory {
 public:
  DeviceMemory(Device device, std::size_t bytes);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  void* data() const { return data_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  void upload(const void* host, std::size_t bytes, std::size_t offset = 0);
  void download(void* host, std::size_t bytes, std::size_t offset = 0) const;

  template <class T>
  std::vector<T> read(std::size_t count) const {
    std::vector<T> out(count);
    download(out.data(), count * sizeof(T));
    return out;
  }

 private:
  Device device_;
  void* data_ = nullptr;
};

}  // namespace deltatrain::testing_support
