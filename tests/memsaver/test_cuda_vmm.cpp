// The CUDA VMM backend and the Saver on a GPU: skipped where no GPU is usable. The device's own free-memory
// count (cuMemGetInfo) is the independent witness that pause gives memory back.
#include <gtest/gtest.h>

#include "deltatrain/core/system.h"
#include "deltatrain/memsaver/cycle_bench.h"
#include "deltatrain/memsaver/saver.h"
#include "memsaver_testing.h"

namespace deltatrain::memsaver {
namespace {

using testing::Random;

#define SKIP_WITHOUT_GPU()                                                        \
  if (!cuda_info().usable()) GTEST_SKIP() << cuda_info().unavailable_reason; \
  static_assert(true)

std::vector<std::byte> read_back(PhysicalMemory& memory, const void* mapped, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  memory.copy_to_host(out.data(), mapped, bytes, 0);
  memory.wait_for_copies();
  return out;
}

TEST(CudaVmm, MappedMemoryRoundTripsAndUnmapGivesItBack) {
  SKIP_WITHOUT_GPU();
  Random random;
  auto memory = make_cuda_vmm(0);
  const std::size_t granularity = memory->granularity();
  ASSERT_GT(granularity, 0u);
  const std::size_t bytes = random.between(64, 128) * granularity;
  void* address = memory->reserve(bytes);
  const std::uint64_t before = memory->device_bytes_in_use();
  memory->map(address, bytes);
  EXPECT_GE(memory->device_bytes_in_use() - before, bytes);
  const auto data = random.bytes(bytes);
  memory->copy_to_device(address, data.data(), bytes, 1);
  memory->wait_for_copies();
  EXPECT_EQ(read_back(*memory, address, bytes), data);
  memory->unmap(address, bytes);
  EXPECT_LE(memory->device_bytes_in_use(), before + granularity);
  memory->map(address, bytes);  // the same addresses take fresh memory again
  memory->copy_to_device(address, data.data(), bytes, 0);
  memory->wait_for_copies();
  EXPECT_EQ(read_back(*memory, address, bytes), data);
  memory->unmap(address, bytes);
  memory->release(address, bytes);
}

TEST(CudaVmm, SaverRestoresCpuCopiesAndRegisteredBackupsBitwise) {
  SKIP_WITHOUT_GPU();
  Random random;
  Saver saver(make_cuda_vmm(0), SaverOptions{random.between(1, 8) << 20});
  PhysicalMemory& memory = saver.memory();
  const std::size_t bytes = random.between(32, 96) << 20;
  void* optimizer = saver.allocate({"optimizer", Backup::CpuCopy}, bytes);
  void* params = saver.allocate({"params", Backup::RestoreFrom}, bytes);
  saver.allocate({"grads", Backup::None}, bytes);
  const auto state = random.bytes(bytes);
  std::vector<std::byte> weights = random.bytes(bytes);  // pageable: register_backup pins it
  memory.copy_to_device(optimizer, state.data(), bytes, 0);
  memory.copy_to_device(params, weights.data(), bytes, 1);
  memory.wait_for_copies();
  saver.register_backup("params", {{reinterpret_cast<std::uintptr_t>(params), weights.data(), bytes}});

  const std::uint64_t before = memory.device_bytes_in_use();
  saver.pause();
  std::uint64_t reserved = 0;
  for (const TagStats& stats : saver.stats()) reserved += stats.reserved_bytes;
  EXPECT_GE(before - memory.device_bytes_in_use(), reserved - reserved / 50);
  const auto updated = random.bytes(bytes);  // new values in the same buffer: resume reads the backup then
  std::memcpy(weights.data(), updated.data(), bytes);
  saver.resume();
  EXPECT_EQ(read_back(memory, optimizer, bytes), state);
  EXPECT_EQ(read_back(memory, params, bytes), weights);
  EXPECT_EQ(saver.stats("params").host_bytes_held, 0u);
  EXPECT_EQ(saver.stats("optimizer").host_bytes_held, bytes);
  saver.unregister_backup("params");
}

TEST(CudaVmm, CycleBenchRestoresThePatternAndReleasesTheDeviceMemory) {
  SKIP_WITHOUT_GPU();
  for (Backup backup : {Backup::CpuCopy, Backup::RestoreFrom}) {
    CycleBenchOptions options;
    options.backend = "cuda";
    options.bytes = (std::size_t{256} << 20) + 4096 + 8;  // not a multiple of the granularity or the chunk
    options.backup = backup;
    options.cycles = 2;
    const CycleBenchReport report = run_cycle_bench(options);
    EXPECT_TRUE(report.contents_restored) << to_string(backup);
    EXPECT_GE(report.resident_before - report.resident_paused, options.bytes) << to_string(backup);
  }
}

TEST(CudaVmm, DeviceOutOfRangeIsAnInvalidArgument) {
  SKIP_WITHOUT_GPU();
  EXPECT_THROW(make_cuda_vmm(static_cast<int>(cuda_info().gpus.size())), InvalidArgument);
}

TEST(CudaVmm, WithoutAUsableGpuTheBackendIsUnavailable) {
  if (cuda_info().usable()) GTEST_SKIP() << "a GPU is usable here";
  EXPECT_THROW(make_cuda_vmm(0), Error);
}

}  // namespace
}  // namespace deltatrain::memsaver
