// The LD_PRELOAD shim's routing and C interface, with host pages behind the saver and a stand-in CUDA
// runtime after it (fake_cudart.cpp): this binary links the shim before the stand-in, as LD_PRELOAD would
// put it before the real runtime. The saver is process-wide, so every test uses tags of its own.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "deltatrain/memsaver/preload.h"
#include "fake_cudart.h"
#include "memsaver_testing.h"

namespace {

using deltatrain::memsaver::testing::holds;
using deltatrain::memsaver::testing::Random;
using deltatrain::memsaver::testing::write;

// Read when the shim first needs its saver, which is after this.
const bool host_backend = ::setenv("DELTATRAIN_MEMSAVER_BACKEND", "host", 1) == 0;

std::vector<deltatrain_memsaver_tag_stats> all_stats() {
  int count = 0;
  EXPECT_EQ(deltatrain_memsaver_stats(nullptr, 0, &count), DELTATRAIN_MEMSAVER_OK);
  std::vector<deltatrain_memsaver_tag_stats> stats(static_cast<std::size_t>(count));
  EXPECT_EQ(deltatrain_memsaver_stats(stats.data(), count, &count), DELTATRAIN_MEMSAVER_OK);
  return stats;
}

deltatrain_memsaver_tag_stats stats_of(const std::string& tag) {
  for (const auto& entry : all_stats()) {
    if (tag == entry.tag) return entry;
  }
  ADD_FAILURE() << "no tag " << tag;
  return {};
}

std::uint64_t resident() {
  std::uint64_t bytes = 0;
  EXPECT_EQ(deltatrain_memsaver_device_bytes_in_use(&bytes), DELTATRAIN_MEMSAVER_OK);
  return bytes;
}

TEST(PreloadShim, UsesTheHostBackendAndTheAbiItDeclares) {
  ASSERT_TRUE(host_backend);
  EXPECT_EQ(deltatrain_memsaver_abi_version(), DELTATRAIN_MEMSAVER_ABI_VERSION);
}

TEST(PreloadShim, OutsideARegionAllocationsReachTheRuntime) {
  const FakeCudartCalls before = fake_cudart_calls();
  void* pointer = nullptr;
  ASSERT_EQ(cudaMalloc(&pointer, 1000), cudaSuccess);
  EXPECT_EQ(fake_cudart_calls().mallocs, before.mallocs + 1);
  ASSERT_EQ(cudaFree(pointer), cudaSuccess);
  EXPECT_EQ(fake_cudart_calls().frees, before.frees + 1);
  EXPECT_EQ(fake_cudart_calls().last_freed, pointer);
}

TEST(PreloadShim, InsideARegionAllocationsAreParkedAndRestored) {
  Random random;
  const FakeCudartCalls before = fake_cudart_calls();
  ASSERT_EQ(deltatrain_memsaver_region_enter("shim-optimizer", DELTATRAIN_MEMSAVER_CPU), DELTATRAIN_MEMSAVER_OK);
  const std::size_t bytes = random.between(1, 1 << 20);
  void* pointer = nullptr;
  ASSERT_EQ(cudaMalloc(&pointer, bytes), cudaSuccess);
  ASSERT_EQ(deltatrain_memsaver_region_exit(), DELTATRAIN_MEMSAVER_OK);
  EXPECT_EQ(fake_cudart_calls().mallocs, before.mallocs);
  const auto data = random.bytes(bytes);
  write(pointer, data);
  EXPECT_EQ(stats_of("shim-optimizer").bytes, bytes);

  const std::uint64_t active = resident();
  ASSERT_EQ(deltatrain_memsaver_pause("shim-optimizer"), DELTATRAIN_MEMSAVER_OK);
  EXPECT_EQ(active - resident(), stats_of("shim-optimizer").reserved_bytes);
  EXPECT_EQ(stats_of("shim-optimizer").paused, 1);
  EXPECT_EQ(stats_of("shim-optimizer").host_bytes_held, bytes);
  ASSERT_EQ(deltatrain_memsaver_resume("shim-optimizer"), DELTATRAIN_MEMSAVER_OK);
  EXPECT_TRUE(holds(pointer, data));

  ASSERT_EQ(cudaFree(pointer), cudaSuccess);
  EXPECT_EQ(fake_cudart_calls().frees, before.frees);
  EXPECT_EQ(stats_of("shim-optimizer").allocations, 0u);
}

TEST(PreloadShim, ANullTagScopeAndOtherThreadsBypassTheSaver) {
  const FakeCudartCalls before = fake_cudart_calls();
  ASSERT_EQ(deltatrain_memsaver_region_enter("shim-scratch", DELTATRAIN_MEMSAVER_NONE), DELTATRAIN_MEMSAVER_OK);
  void* elsewhere = nullptr;
  std::thread([&] { EXPECT_EQ(cudaMalloc(&elsewhere, 64), cudaSuccess); }).join();
  EXPECT_EQ(fake_cudart_calls().mallocs, before.mallocs + 1);
  ASSERT_EQ(deltatrain_memsaver_region_enter(nullptr, 0), DELTATRAIN_MEMSAVER_OK);
  void* outside = nullptr;
  ASSERT_EQ(cudaMalloc(&outside, 64), cudaSuccess);
  EXPECT_EQ(fake_cudart_calls().mallocs, before.mallocs + 2);
  ASSERT_EQ(deltatrain_memsaver_region_exit(), DELTATRAIN_MEMSAVER_OK);
  void* inside = nullptr;
  ASSERT_EQ(cudaMalloc(&inside, 64), cudaSuccess);
  EXPECT_EQ(fake_cudart_calls().mallocs, before.mallocs + 2);
  ASSERT_EQ(deltatrain_memsaver_region_exit(), DELTATRAIN_MEMSAVER_OK);
  for (void* pointer : {elsewhere, outside, inside}) EXPECT_EQ(cudaFree(pointer), cudaSuccess);
  EXPECT_EQ(fake_cudart_calls().frees, before.frees + 2);
}

TEST(PreloadShim, WrongCallsReturnTheirStatusAndAMessage) {
  EXPECT_EQ(deltatrain_memsaver_region_exit(), DELTATRAIN_MEMSAVER_STATE_ERROR);
  EXPECT_NE(std::string(deltatrain_memsaver_last_error()).find("no region"), std::string::npos);
  EXPECT_EQ(deltatrain_memsaver_region_enter("shim-errors", 7), DELTATRAIN_MEMSAVER_INVALID_ARGUMENT);
  EXPECT_EQ(deltatrain_memsaver_region_enter(std::string(200, 'x').c_str(), 0), DELTATRAIN_MEMSAVER_INVALID_ARGUMENT);
  EXPECT_EQ(deltatrain_memsaver_region_enter("", 0), DELTATRAIN_MEMSAVER_INVALID_ARGUMENT);
  EXPECT_EQ(deltatrain_memsaver_pause("shim-never-used"), DELTATRAIN_MEMSAVER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(deltatrain_memsaver_last_error()).find("shim-never-used"), std::string::npos);

  ASSERT_EQ(deltatrain_memsaver_region_enter("shim-errors", DELTATRAIN_MEMSAVER_NONE), DELTATRAIN_MEMSAVER_OK);
  void* pointer = nullptr;
  ASSERT_EQ(cudaMalloc(&pointer, 4096), cudaSuccess);
  ASSERT_EQ(deltatrain_memsaver_pause("shim-errors"), DELTATRAIN_MEMSAVER_OK);
  EXPECT_EQ(deltatrain_memsaver_pause("shim-errors"), DELTATRAIN_MEMSAVER_STATE_ERROR);
  void* refused = nullptr;
  EXPECT_EQ(cudaMalloc(&refused, 4096), cudaErrorNotPermitted);
  EXPECT_NE(std::string(deltatrain_memsaver_last_error()).find("paused"), std::string::npos);
  ASSERT_EQ(deltatrain_memsaver_region_exit(), DELTATRAIN_MEMSAVER_OK);
  const FakeCudartCalls before = fake_cudart_calls();
  EXPECT_EQ(cudaFree(pointer), cudaSuccess);  // freeing a paused allocation is allowed
  EXPECT_EQ(fake_cudart_calls().frees, before.frees);
  EXPECT_EQ(deltatrain_memsaver_resume("shim-errors"), DELTATRAIN_MEMSAVER_OK);
  EXPECT_EQ(deltatrain_memsaver_resume("shim-errors"), DELTATRAIN_MEMSAVER_STATE_ERROR);
}

TEST(PreloadShim, RegisteredBackupRestoresThroughTheCInterface) {
  Random random;
  ASSERT_EQ(deltatrain_memsaver_region_enter("shim-params", DELTATRAIN_MEMSAVER_RESTORE_FROM), DELTATRAIN_MEMSAVER_OK);
  const std::size_t bytes = random.between(1, 1 << 16);
  void* pointer = nullptr;
  ASSERT_EQ(cudaMalloc(&pointer, bytes), cudaSuccess);
  ASSERT_EQ(deltatrain_memsaver_region_exit(), DELTATRAIN_MEMSAVER_OK);
  EXPECT_EQ(deltatrain_memsaver_pause("shim-params"), DELTATRAIN_MEMSAVER_STATE_ERROR);  // nothing registered yet

  std::vector<std::byte> weights = random.bytes(bytes);
  const std::uint64_t device = reinterpret_cast<std::uint64_t>(pointer);
  const std::uint64_t host = reinterpret_cast<std::uint64_t>(weights.data());
  const std::uint64_t size = bytes;
  ASSERT_EQ(deltatrain_memsaver_register_backup("shim-params", &device, &host, &size, 1), DELTATRAIN_MEMSAVER_OK);
  ASSERT_EQ(deltatrain_memsaver_pause("shim-params"), DELTATRAIN_MEMSAVER_OK);
  const auto updated = random.bytes(bytes);
  std::memcpy(weights.data(), updated.data(), bytes);
  ASSERT_EQ(deltatrain_memsaver_resume("shim-params"), DELTATRAIN_MEMSAVER_OK);
  EXPECT_TRUE(holds(pointer, updated));
  EXPECT_EQ(stats_of("shim-params").host_bytes_held, 0u);
  EXPECT_EQ(deltatrain_memsaver_unregister_backup("shim-params"), DELTATRAIN_MEMSAVER_OK);
  EXPECT_EQ(cudaFree(pointer), cudaSuccess);
}

// Run by ctest a second time with DELTATRAIN_MEMSAVER_REGION set (memsaver_preload_process_region).
TEST(PreloadShimProcessRegion, ThreadsWithoutARegionUseTheProcessRegion) {
  const char* region = std::getenv("DELTATRAIN_MEMSAVER_REGION");
  if (!region) GTEST_SKIP() << "needs DELTATRAIN_MEMSAVER_REGION; ctest runs it as memsaver_preload_process_region";
  const std::string tag = std::string(region).substr(0, std::string(region).find(':'));
  const FakeCudartCalls before = fake_cudart_calls();
  void* pointer = nullptr;
  std::thread([&] { EXPECT_EQ(cudaMalloc(&pointer, 4096), cudaSuccess); }).join();
  EXPECT_EQ(fake_cudart_calls().mallocs, before.mallocs);
  EXPECT_EQ(stats_of(tag).allocations, 1u);
  EXPECT_EQ(cudaFree(pointer), cudaSuccess);
  EXPECT_EQ(stats_of(tag).allocations, 0u);
}

}  // namespace
