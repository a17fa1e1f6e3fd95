#include "test_support.h"

#include <cstdlib>
#include <cstring>
#include <random>

#include "deltatrain/comm/mpi_group.h"
#include "deltatrain/comm/nccl_group.h"
#include "deltatrain/core/system.h"

#ifdef DELTATRAIN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "deltatrain/core/cuda_check.h"
#endif

namespace deltatrain::testing_support {

std::uint64_t shared_seed(MPI_Comm comm) {
  std::uint64_t seed = (static_cast<std::uint64_t>(std::random_device{}()) << 32) | std::random_device{}();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, comm);
  return seed;
}

SharedTempDir::SharedTempDir(MPI_Comm comm) : comm_(comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  char name[4096] = {};
  if (rank == 0) {
    const std::string pattern = (std::filesystem::temp_directory_path() / "deltatrain-test-XXXXXX").string();
    std::strncpy(name, pattern.c_str(), sizeof name - 1);
    if (mkdtemp(name) == nullptr) name[0] = '\0';
  }
  MPI_Bcast(name, sizeof name, MPI_CHAR, 0, comm);
  path_ = name;
}

SharedTempDir::~SharedTempDir() {
  MPI_Barrier(comm_);
  int rank = 0;
  MPI_Comm_rank(comm_, &rank);
  std::error_code ignored;
  if (rank == 0 && !path_.empty()) std::filesystem::remove_all(path_, ignored);
}

std::unique_ptr<comm::Group> make_group(const std::string& engine, MPI_Comm members, std::string* skip_reason) {
  if (engine == "mpi") return comm::make_mpi_group(members);
  std::string reason;
  if (!comm::nccl_available(&reason)) {
    *skip_reason = "NCCL is unavailable: " + reason;
    return nullptr;
  }
  int world_rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int gpus = static_cast<int>(cuda_info().gpus.size());
  if (gpus < size) {
    *skip_reason = "NCCL needs one GPU per rank: " + std::to_string(size) + " ranks, " + std::to_string(gpus) + " GPUs";
    return nullptr;
  }
  return comm::make_nccl_group(members, world_rank);
}

namespace {

// Host <-> device bytes; `device` is where the non-host side lives.
void transfer(void* target, const void* source, std::size_t bytes, Device device, bool to_device) {
  if (device.type == DeviceType::cpu) {
    std::memcpy(target, source, bytes);
    return;
  }
#ifdef DELTATRAIN_WITH_CUDA
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  cuda_check(cudaMemcpy(target, source, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost),
             "cudaMemcpy");
#endif
}

}  // namespace

void copy_into(const TensorView& view, const void* host) { transfer(view.data, host, view.nbytes(), view.device, true); }

void copy_from(const TensorView& view, void* host) { transfer(host, view.data, view.nbytes(), view.device, false); }

DeviceMemory::DeviceMemory(Device device, std::size_t bytes) : device_(device) {
  if (device.type == DeviceType::cpu) {
    data_ = std::calloc(bytes == 0 ? 1 : bytes, 1);
    return;
  }
#ifdef DELTATRAIN_WITH_CUDA
  cuda_check(cudaSetDevice(device.index), "cudaSetDevice");
  cuda_check(cudaMalloc(&data_, bytes == 0 ? 1 : bytes), "cudaMalloc");
  cuda_check(cudaMemset(data_, 0, bytes), "cudaMemset");
#endif
}

DeviceMemory::~DeviceMemory() {
  if (device_.type == DeviceType::cpu) {
    std::free(data_);
    return;
  }
#ifdef DELTATRAIN_WITH_CUDA
  cudaFree(data_);
#endif
}

void DeviceMemory::upload(const void* host, std::size_t bytes, std::size_t offset) {
  transfer(static_cast<char*>(data_) + offset, host, bytes, device_, true);
}

void DeviceMemory::download(void* host, std::size_t bytes, std::size_t offset) const {
  transfer(host, static_cast<const char*>(data_) + offset, bytes, device_, false);
}

}  // namespace deltatrain::testing_support
