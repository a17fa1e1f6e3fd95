// The host-pages backend on its own: the resident size measured by the kernel (VmRSS) falls when a range is
// unmapped and the addresses stay reserved; a paused range faults like unmapped device memory.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "memsaver_testing.h"

namespace deltatrain::memsaver {
namespace {

using testing::holds;
using testing::Random;
using testing::write;

// The kernel's own count, independent of the backend's mincore bookkeeping.
std::uint64_t resident_set_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  std::uint64_t kilobytes = 0;
  while (status >> key) {
    if (key == "VmRSS:") {
      status >> kilobytes;
      return kilobytes * 1024;
    }
    status.ignore(1 << 20, '\n');
  }
  return 0;
}

TEST(HostPages, UnmapReturnsThePagesAndMapBringsFreshOnesAtTheSameAddress) {
  Random random;
  auto memory = make_host_pages();
  const std::size_t bytes = (random.between(32, 64) << 20) / memory->granularity() * memory->granularity();
  void* address = memory->reserve(bytes);
  EXPECT_EQ(memory->device_bytes_in_use(), 0u);
  memory->map(address, bytes);
  EXPECT_EQ(memory->device_bytes_in_use(), bytes);
  write(address, random.bytes(bytes));

  const std::uint64_t mapped_rss = resident_set_bytes();
  memory->unmap(address, bytes);
  const std::uint64_t unmapped_rss = resident_set_bytes();
  EXPECT_EQ(memory->device_bytes_in_use(), 0u);
  EXPECT_GE(mapped_rss - unmapped_rss, bytes - bytes / 16) << "VmRSS " << mapped_rss << " -> " << unmapped_rss;

  memory->map(address, bytes);
  const auto data = random.bytes(bytes);
  write(address, data);
  EXPECT_TRUE(holds(address, data));
  memory->unmap(address, bytes);
  memory->release(address, bytes);
}

TEST(HostPages, CopiesMoveBytesBothWays) {
  Random random;
  auto memory = make_host_pages();
  const std::size_t bytes = random.between(1, 1 << 20);
  const std::size_t reserved = (bytes + memory->granularity() - 1) / memory->granularity() * memory->granularity();
  void* mapped = memory->reserve(reserved);
  memory->map(mapped, reserved);
  void* host = memory->allocate_host(bytes);
  const auto data = random.bytes(bytes);
  write(host, data);
  memory->copy_to_device(mapped, host, bytes, 0);
  memory->wait_for_copies();
  EXPECT_TRUE(holds(mapped, data));
  std::memset(host, 0, bytes);
  memory->copy_to_host(host, mapped, bytes, 0);
  memory->wait_for_copies();
  EXPECT_TRUE(holds(host, data));
  memory->free_host(host, bytes);
  memory->unmap(mapped, reserved);
  memory->release(mapped, reserved);
}

TEST(HostPages, SizesMustBeWholePages) {
  auto memory = make_host_pages();
  EXPECT_THROW(memory->reserve(memory->granularity() + 1), InvalidArgument);
  EXPECT_THROW(memory->reserve(0), InvalidArgument);
}

TEST(HostPagesDeathTest, TouchingAnUnmappedRangeFaults) {
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  auto memory = make_host_pages();
  const std::size_t bytes = memory->granularity();
  auto* address = static_cast<volatile char*>(memory->reserve(bytes));
  memory->map(const_cast<char*>(address), bytes);
  memory->unmap(const_cast<char*>(address), bytes);
  EXPECT_DEATH(address[0] = 1, "");
  memory->release(const_cast<char*>(address), bytes);
}

TEST(PhysicalMemory, BackendsAreChosenByName) {
  EXPECT_EQ(make_physical_memory("host")->name(), "host");
  EXPECT_THROW(make_physical_memory("disk"), InvalidArgument);
}

}  // namespace
}  // namespace deltatrain::memsaver
