// The Saver's states, policies and errors on the host-pages backend, with residency measured by mincore.
#include <gtest/gtest.h>

#include "deltatrain/memsaver/saver.h"
#include "memsaver_testing.h"

namespace deltatrain::memsaver {
namespace {

using testing::holds;
using testing::Random;
using testing::RecordingMemory;
using testing::write;

std::uintptr_t as_address(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer); }

class SaverTest : public ::testing::Test {
 protected:
  Saver saver{make_host_pages()};
  std::size_t page = saver.memory().granularity();
  Random random;
};

TEST_F(SaverTest, AllocationIsWritableAndRoundedToTheGranularity) {
  const std::size_t bytes = random.between(1, 5 * page);
  void* address = saver.allocate({"state", Backup::None}, bytes);
  const auto data = random.bytes(bytes);
  write(address, data);
  EXPECT_TRUE(holds(address, data));
  const TagStats stats = saver.stats("state");
  EXPECT_EQ(stats.allocations, 1u);
  EXPECT_EQ(stats.bytes, bytes);
  EXPECT_EQ(stats.reserved_bytes % page, 0u);
  EXPECT_GE(stats.reserved_bytes, bytes);
  EXPECT_LT(stats.reserved_bytes, bytes + page);
  EXPECT_EQ(stats.mapped_bytes, stats.reserved_bytes);
  EXPECT_EQ(saver.memory().device_bytes_in_use(), stats.reserved_bytes);
  EXPECT_TRUE(saver.contains(address));
  EXPECT_FALSE(saver.contains(static_cast<std::byte*>(address) + 1));
}

TEST_F(SaverTest, CpuCopyComesBackBitwiseAtTheSameAddressAndThePagesReallyGo) {
  const std::size_t bytes = random.between(page, 64 * page);
  auto* address = saver.allocate({"optimizer", Backup::CpuCopy}, bytes);
  const auto data = random.bytes(bytes);
  write(address, data);
  const std::uint64_t resident = saver.memory().device_bytes_in_use();

  saver.pause("optimizer");
  EXPECT_EQ(saver.memory().device_bytes_in_use(), resident - saver.stats("optimizer").reserved_bytes);
  TagStats paused = saver.stats("optimizer");
  EXPECT_EQ(paused.state, TagState::Paused);
  EXPECT_EQ(paused.mapped_bytes, 0u);
  EXPECT_EQ(paused.backup_bytes, bytes);
  EXPECT_EQ(paused.host_bytes_held, bytes);

  saver.resume("optimizer");
  EXPECT_EQ(saver.memory().device_bytes_in_use(), resident);
  EXPECT_TRUE(holds(address, data));
  EXPECT_EQ(saver.stats("optimizer").state, TagState::Active);
  // The pinned copy is kept for the next cycle.
  EXPECT_EQ(saver.stats("optimizer").host_bytes_held, bytes);

  const auto changed = random.bytes(bytes);
  write(address, changed);
  saver.pause("optimizer");
  saver.resume("optimizer");
  EXPECT_TRUE(holds(address, changed));
}

TEST_F(SaverTest, NoBackupReleasesMemoryAndKeepsNoHostCopy) {
  const std::size_t bytes = random.between(page, 16 * page);
  auto* address = saver.allocate({"grads", Backup::None}, bytes);
  write(address, random.bytes(bytes));
  saver.pause("grads");
  EXPECT_EQ(saver.memory().device_bytes_in_use(), 0u);
  EXPECT_EQ(saver.stats("grads").host_bytes_held, 0u);
  EXPECT_EQ(saver.stats("grads").backup_bytes, 0u);
  saver.resume("grads");
  // Contents are undefined by contract; the range must be mapped and writable at the same address.
  const auto data = random.bytes(bytes);
  write(address, data);
  EXPECT_TRUE(holds(address, data));
}

TEST_F(SaverTest, RestoreFromTheRegisteredBackupReadsItAtResumeAndHoldsNoCopy) {
  // The trainer's one host copy of the weights, laid out differently from the device buffer: two
  // parameters stored in the opposite order.
  const std::size_t first = random.between(1, 8 * page), second = random.between(1, 8 * page);
  auto* params = static_cast<std::byte*>(saver.allocate({"params", Backup::RestoreFrom}, first + second));
  std::vector<std::byte> weights = random.bytes(first + second);
  saver.register_backup("params", {{as_address(params), weights.data() + second, first},
                                   {as_address(params + first), weights.data(), second}});
  std::memcpy(params, weights.data() + second, first);
  std::memcpy(params + first, weights.data(), second);

  saver.pause("params");
  EXPECT_EQ(saver.stats("params").host_bytes_held, 0u);
  EXPECT_EQ(saver.stats("params").backup_bytes, first + second);
  // The trainer updates its copy while the device memory is parked: resume must read it then.
  const auto updated = random.bytes(first + second);
  std::memcpy(weights.data(), updated.data(), updated.size());  // in place: the registration points here
  saver.resume("params");
  EXPECT_EQ(std::memcmp(params, weights.data() + second, first), 0);
  EXPECT_EQ(std::memcmp(params + first, weights.data(), second), 0);
}

TEST_F(SaverTest, RestoreFromCoversOnlyTheRegisteredBytes) {
  const std::size_t bytes = 4 * page;
  auto* params = static_cast<std::byte*>(saver.allocate({"params", Backup::RestoreFrom}, bytes));
  const auto weights = random.bytes(page);
  saver.register_backup("params", {{as_address(params + page), weights.data(), page}});
  saver.pause("params");
  saver.resume("params");
  EXPECT_EQ(std::memcmp(params + page, weights.data(), page), 0);
}

TEST_F(SaverTest, PauseAllAndResumeAllActOnTheTagsInTheOtherState) {
  const std::size_t bytes = random.between(page, 8 * page);
  auto* optimizer = saver.allocate({"optimizer", Backup::CpuCopy}, bytes);
  auto* params = saver.allocate({"params", Backup::RestoreFrom}, bytes);
  saver.allocate({"grads", Backup::None}, bytes);
  const auto state = random.bytes(bytes), weights = random.bytes(bytes);
  write(optimizer, state);
  saver.register_backup("params", {{as_address(params), weights.data(), bytes}});

  saver.pause("grads");
  saver.pause();  // the two still active
  for (const TagStats& stats : saver.stats()) EXPECT_EQ(stats.state, TagState::Paused) << stats.tag;
  EXPECT_EQ(saver.memory().device_bytes_in_use(), 0u);
  EXPECT_THROW(saver.pause(), StateError);

  saver.resume("params");  // staged wake-up: weights first
  EXPECT_TRUE(holds(params, weights));
  EXPECT_EQ(saver.stats("optimizer").state, TagState::Paused);
  saver.resume();
  for (const TagStats& stats : saver.stats()) EXPECT_EQ(stats.state, TagState::Active) << stats.tag;
  EXPECT_TRUE(holds(optimizer, state));
  EXPECT_THROW(saver.resume(), StateError);
}

TEST_F(SaverTest, PauseAllOnAnEmptySaverDoesNothing) {
  EXPECT_NO_THROW(saver.pause());
  EXPECT_NO_THROW(saver.resume());
  EXPECT_TRUE(saver.stats().empty());
}

TEST_F(SaverTest, WrongStateCallsThrowStateErrorAndChangeNothing) {
  auto* address = saver.allocate({"optimizer", Backup::CpuCopy}, page);
  const auto data = random.bytes(page);
  write(address, data);
  EXPECT_THROW(saver.resume("optimizer"), StateError);
  EXPECT_TRUE(holds(address, data));
  saver.pause("optimizer");
  EXPECT_THROW(saver.pause("optimizer"), StateError);
  EXPECT_THROW(saver.allocate({"optimizer", Backup::CpuCopy}, page), StateError);
  EXPECT_EQ(saver.stats("optimizer").allocations, 1u);
  saver.resume("optimizer");
  EXPECT_TRUE(holds(address, data));
}

TEST_F(SaverTest, RestoreFromWithoutARegisteredBackupCannotBePaused) {
  auto* address = saver.allocate({"params", Backup::RestoreFrom}, page);
  const auto data = random.bytes(page);
  write(address, data);
  EXPECT_THROW(saver.pause("params"), StateError);
  EXPECT_THROW(saver.pause(), StateError);
  EXPECT_EQ(saver.stats("params").state, TagState::Active);
  EXPECT_TRUE(holds(address, data));

  saver.register_backup("params", {{as_address(address), data.data(), page}});
  saver.pause("params");
  EXPECT_THROW(saver.unregister_backup("params"), StateError);
  saver.resume("params");
  EXPECT_TRUE(holds(address, data));
  saver.unregister_backup("params");
  EXPECT_EQ(saver.stats("params").backup_bytes, 0u);
  EXPECT_THROW(saver.pause("params"), StateError);
}

TEST_F(SaverTest, InvalidArgumentsNameTheArgument) {
  auto expect_invalid = [](auto call, const std::string& argument) {
    try {
      call();
      ADD_FAILURE() << "no InvalidArgument for " << argument;
    } catch (const InvalidArgument& error) {
      EXPECT_EQ(error.argument(), argument) << error.what();
    }
  };
  auto* address = saver.allocate({"optimizer", Backup::CpuCopy}, page);
  auto* params = static_cast<std::byte*>(saver.allocate({"params", Backup::RestoreFrom}, 2 * page));
  const auto host = random.bytes(2 * page);

  expect_invalid([&] { saver.allocate({"optimizer", Backup::CpuCopy}, 0); }, "bytes");
  expect_invalid([&] { saver.allocate({"", Backup::None}, page); }, "tag");
  expect_invalid([&] { saver.allocate({"optimizer", Backup::None}, page); }, "backup");
  expect_invalid([&] { saver.pause("unknown"); }, "tag");
  expect_invalid([&] { saver.resume("unknown"); }, "tag");
  expect_invalid([&] { saver.stats("unknown"); }, "tag");
  expect_invalid([&] { saver.free(static_cast<std::byte*>(address) + 8); }, "address");
  expect_invalid([&] { saver.register_backup("optimizer", {}); }, "tag");
  expect_invalid([&] { saver.unregister_backup("optimizer"); }, "tag");
  expect_invalid([&] { saver.register_backup("params", {{as_address(params), host.data(), 0}}); }, "segments[0].bytes");
  expect_invalid([&] { saver.register_backup("params", {{as_address(params), nullptr, page}}); }, "segments[0].host");
  expect_invalid([&] { saver.register_backup("params", {{as_address(params) + page, host.data(), page + 1}}); },
                 "segments[0].device");
  expect_invalid([&] { saver.register_backup("params", {{as_address(address), host.data(), page}}); },
                 "segments[0].device");
  expect_invalid([&] {
    saver.register_backup("params", {{as_address(params) + page, host.data(), page},
                                     {as_address(params), host.data(), page + 1}});
  }, "segments[0].device");
  expect_invalid([] { parse_backup("disk"); }, "backup");
  expect_invalid([] { Saver(make_host_pages(), SaverOptions{0}); }, "chunk_bytes");
  EXPECT_EQ(saver.stats("params").backup_bytes, 0u);
}

TEST_F(SaverTest, FreeingAPausedAllocationReleasesItAndItsCopy) {
  const std::size_t bytes = random.between(page, 8 * page);
  auto* kept = saver.allocate({"optimizer", Backup::CpuCopy}, bytes);
  auto* dropped = saver.allocate({"optimizer", Backup::CpuCopy}, bytes);
  const auto data = random.bytes(bytes);
  write(kept, data);
  saver.pause("optimizer");
  saver.free(dropped);
  EXPECT_FALSE(saver.contains(dropped));
  EXPECT_EQ(saver.stats("optimizer").allocations, 1u);
  EXPECT_EQ(saver.stats("optimizer").host_bytes_held, bytes);
  saver.resume("optimizer");
  EXPECT_TRUE(holds(kept, data));
  saver.free(kept);
  EXPECT_EQ(saver.stats("optimizer").host_bytes_held, 0u);
  EXPECT_EQ(saver.memory().device_bytes_in_use(), 0u);
}

TEST_F(SaverTest, FreeingDropsTheRegisteredSegmentsInside) {
  auto* params = saver.allocate({"params", Backup::RestoreFrom}, page);
  const auto weights = random.bytes(page);
  saver.register_backup("params", {{as_address(params), weights.data(), page}});
  saver.free(params);
  EXPECT_EQ(saver.stats("params").backup_bytes, 0u);
  EXPECT_NO_THROW(saver.pause("params"));  // no allocation left: nothing to restore
  EXPECT_NO_THROW(saver.resume("params"));
}

TEST(SaverCopies, SplitIntoChunksOverEveryLaneWithOneWaitPerTransition) {
  Random random;
  auto record = std::make_shared<RecordingMemory::Record>();
  const std::size_t chunk = random.between(1, 3 * 4096);
  Saver saver(std::make_unique<RecordingMemory>(record, 3), SaverOptions{chunk});
  const std::size_t first = random.between(1, 40000), second = random.between(1, 40000);
  auto* a = saver.allocate({"optimizer", Backup::CpuCopy}, first);
  auto* b = saver.allocate({"optimizer", Backup::CpuCopy}, second);
  const auto data_a = random.bytes(first), data_b = random.bytes(second);
  write(a, data_a);
  write(b, data_b);

  saver.pause();
  const int expected_copies = static_cast<int>((first + chunk - 1) / chunk + (second + chunk - 1) / chunk);
  EXPECT_EQ(record->copies, expected_copies);
  EXPECT_LE(record->largest_copy, chunk);
  EXPECT_EQ(record->waits, 1);
  EXPECT_EQ(record->device_syncs, 1);
  for (std::size_t i = 0; i < record->lanes.size(); ++i) EXPECT_EQ(record->lanes[i], static_cast<int>(i % 3));

  saver.resume();
  EXPECT_EQ(record->copies, 2 * expected_copies);
  EXPECT_EQ(record->waits, 2);
  EXPECT_EQ(record->allocate_hosts, 2);
  EXPECT_TRUE(holds(a, data_a));
  EXPECT_TRUE(holds(b, data_b));

  saver.pause();  // the pinned copies are reused, never allocated per cycle
  saver.resume();
  EXPECT_EQ(record->allocate_hosts, 2);
}

// A failure part-way leaves every tag as it was and a later call succeeds.
class SaverFailures : public ::testing::Test {
 protected:
  // Two cpu-copy allocations of the same random size, filled with random bytes.
  void allocate_two() {
    bytes = random.between(1, 30000);
    for (int i = 0; i < 2; ++i) {
      addresses[i] = saver.allocate({"optimizer", Backup::CpuCopy}, bytes);
      data[i] = random.bytes(bytes);
      write(addresses[i], data[i]);
    }
  }
  bool both_hold_their_data() const { return holds(addresses[0], data[0]) && holds(addresses[1], data[1]); }
  void fail_at(RecordingMemory::Call call, int count) {
    record->fail_call = call;
    record->fail_at = count;
  }

  Random random;
  std::shared_ptr<RecordingMemory::Record> record = std::make_shared<RecordingMemory::Record>();
  Saver saver{std::make_unique<RecordingMemory>(record)};
  std::size_t bytes = 0;
  void* addresses[2] = {};
  std::vector<std::byte> data[2];
};

TEST_F(SaverFailures, PauseThatCannotGetHostMemoryLeavesTheTagActive) {
  fail_at(RecordingMemory::Call::AllocateHost, 2);
  allocate_two();
  EXPECT_THROW(saver.pause("optimizer"), OutOfMemory);
  const TagStats stats = saver.stats("optimizer");
  EXPECT_EQ(stats.state, TagState::Active);
  EXPECT_EQ(stats.host_bytes_held, 0u);
  EXPECT_EQ(stats.mapped_bytes, stats.reserved_bytes);
  EXPECT_TRUE(both_hold_their_data());
  saver.pause("optimizer");
  saver.resume("optimizer");
  EXPECT_TRUE(both_hold_their_data());
}

TEST_F(SaverFailures, ResumeThatCannotMapEverythingGivesBackWhatItMappedAndCanBeRetried) {
  allocate_two();
  saver.pause("optimizer");
  fail_at(RecordingMemory::Call::Map, record->maps + 2);  // the second allocation of the resume
  EXPECT_THROW(saver.resume("optimizer"), OutOfMemory);
  EXPECT_EQ(saver.stats("optimizer").state, TagState::Paused);
  EXPECT_EQ(saver.stats("optimizer").mapped_bytes, 0u);
  EXPECT_EQ(saver.memory().device_bytes_in_use(), 0u);
  saver.resume("optimizer");
  EXPECT_TRUE(both_hold_their_data());
}

TEST_F(SaverFailures, ResumeWhoseCopyFailsStaysPausedAndCopiesAgainOnRetry) {
  allocate_two();
  saver.pause("optimizer");
  fail_at(RecordingMemory::Call::CopyToDevice, record->copies + 1);
  EXPECT_THROW(saver.resume("optimizer"), OutOfMemory);
  EXPECT_EQ(saver.stats("optimizer").state, TagState::Paused);
  saver.resume("optimizer");
  EXPECT_TRUE(both_hold_their_data());
}

}  // namespace
}  // namespace deltatrain::memsaver
