// core/device_memory: alignment, zero fills and copies between host memory and a device, checked on fresh random
// bytes against the bytes themselves: on the CPU, on every GPU (with device 0 current, so that the calls' own device
// guard is what places them on a second GPU), and through page-locked staging; each device's total memory. The GPU
// cases skip (not pass) without a usable GPU.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
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

// The host's total is its physical memory: sysconf's pages times the page size, and (read another way) the kernel's
// MemTotal within a page of it.
TEST(DeviceMemory, HostTotalIsThePhysicalMemory) {
  const long pages = sysconf(_SC_PHYS_PAGES), page_bytes = sysconf(_SC_PAGE_SIZE);
  ASSERT_GT(pages, 0);
  ASSERT_GT(page_bytes, 0);
  const std::size_t total = device_total_memory(Device{});
  EXPECT_EQ(total, static_cast<std::size_t>(pages) * static_cast<std::size_t>(page_bytes));
  EXPECT_GE(total, std::size_t{256} << 20) << "a machine that runs this suite has more than 256 MiB";
  EXPECT_LE(total, std::size_t{1} << 50) << "and less than a PiB";
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t kib = 0;
  while (meminfo >> key >> kib && key != "MemTotal:") meminfo.ignore(256, '\n');
  if (key != "MemTotal:") GTEST_SKIP() << "no MemTotal in /proc/meminfo to compare with";
  EXPECT_LT(static_cast<double>(total > kib * 1024 ? total - kib * 1024 : kib * 1024 - total),
            static_cast<double>(page_bytes))
      << "MemTotal " << kib << " KiB, sysconf " << total << " bytes";
}

// A GPU's total, asked with device 0 current, is that GPU's own: more than 1 GiB, at most the memory its device
// properties report, and the same asked twice. Without CUDA in the build, a GPU's total is
// Unavailable, as every other call of this file on a GPU is.
TEST(DeviceMemory, GpuTotalOnEveryGpu) {
  const CudaInfo& cuda = cuda_info();
  if (!cuda.built) EXPECT_THROW(device_total_memory(Device{DeviceType::cuda, 0}), Unavailable);
  if (!cuda.usable()) GTEST_SKIP() << cuda.unavailable_reason;
  for (std::size_t gpu = 0; gpu < cuda.gpus.size(); ++gpu) {
    const Device device{DeviceType::cuda, static_cast<int>(gpu)};
    const std::size_t total = device_total_memory(device);
    EXPECT_GT(total, std::size_t{1} << 30) << device_name(device);
    EXPECT_LE(total, cuda.gpus[gpu].memory_bytes) << device_name(device);
    EXPECT_EQ(device_total_memory(device), total) << device_name(device);
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
