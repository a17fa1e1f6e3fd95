// core/device_memory: alignment, zero fills and copies between host memory and a device, checked on fresh random
// bytes against the bytes themselves: on the CPU, on every GPU (with device 0 current, so that the calls' own device
// guard is what places them on a second GPU), and through page-locked staging. The GPU cases skip (not pass) without
// a usable GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "deltatrain/core/device_memory.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"

namespace deltatrain {
namespace {

std::vector<std::uint8_t> random_bytes(std::size_t n) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<std::uint8_t> bytes(n);
  for (std::uint8_t& b : bytes) b = static_cast<std::uint8_t>(rng());
  return bytes;
}

// Host bytes through device memory and back: `device` memory filled from `source`, a middle stretch zeroed, the
// whole copied to a second allocation on the device, then back to the host.
std::vector<std::uint8_t> round_trip(const std::vector<std::uint8_t>& source, std::size_t zero_from,
                                     std::size_t zero_bytes_count, Device device) {
  void* first = device_allocate(source.size(), device, "test bytes");
  void* second = device_allocate(source.size(), device, "test bytes");
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first) % 256, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(second) % 256, 0u);
  std::vector<std::uint8_t> back(source.size());
  copy_bytes(first, source.data(), source.size(), device, nullptr);
  zero_bytes(static_cast<std::uint8_t*>(first) + zero_from, zero_bytes_count, device, nullptr);
  copy_bytes(second, first, source.size(), device, nullptr);
  copy_bytes(back.data(), second, source.size(), device, nullptr);
  synchronize(device, nullptr);
  device_free(first, device);
  device_free(second, device);
  return back;
}

void expect_round_trip(Device device, std::size_t n) {
  const std::vector<std::uint8_t> source = random_bytes(n);
  const std::size_t zero_from = n / 3, zeroed = n / 4;
  std::vector<std::uint8_t> expected = source;
  std::fill(expected.begin() + zero_from, expected.begin() + zero_from + zeroed, 0);
  EXPECT_EQ(round_trip(source, zero_from, zeroed, device), expected) << n << " bytes on " << device_name(device);
}

TEST(DeviceMemory, HostRoundTripZeroFillAndAlignment) {
  for (std::size_t n : {1u, 255u, 4096u, 1000003u}) expect_round_trip(Device{}, n);
  device_free(nullptr, Device{});  // a no-op, as free(nullptr)
  copy_bytes(nullptr, nullptr, 0, Device{}, nullptr);  // nothing to copy: the pointers are not touched
}

TEST(DeviceMemory, GpuRoundTripOnEveryGpu) {
  const CudaInfo& cuda = cuda_info();
  if (!cuda.usable()) GTEST_SKIP() << cuda.unavailable_reason;
  for (std::size_t gpu = 0; gpu < cuda.gpus.size(); ++gpu) {
    for (std::size_t n : {1u, 4096u, 1000003u}) expect_round_trip(Device{DeviceType::cuda, static_cast<int>(gpu)}, n);
  }
}

TEST(DeviceMemory, PageLockedStagingReachesTheGpu) {
  const CudaInfo& cuda = cuda_info();
  if (!cuda.usable()) GTEST_SKIP() << cuda.unavailable_reason;
  const std::vector<std::uint8_t> source = random_bytes(1 << 20);
  auto* staging = static_cast<std::uint8_t*>(page_locked_allocate(source.size()));
  ASSERT_NE(staging, nullptr) << "a machine with a usable GPU can pin a megabyte";
  std::copy(source.begin(), source.end(), staging);
  const Device gpu{DeviceType::cuda, 0};
  void* on_gpu = device_allocate(source.size(), gpu, "test bytes");
  std::vector<std::uint8_t> back(source.size());
  copy_bytes(on_gpu, staging, source.size(), gpu, nullptr);
  copy_bytes(back.data(), on_gpu, source.size(), gpu, nullptr);
  synchronize(gpu, nullptr);
  EXPECT_EQ(back, source);
  device_free(on_gpu, gpu);
  page_locked_free(staging);
}

}  // namespace
}  // namespace deltatrain
