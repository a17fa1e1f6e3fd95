// Many threads, each with its own tags, allocating, writing, pausing, resuming, checking and freeing at
// once, while others read stats and probe addresses: every cpu copy must come back bitwise and the saver
// must end with nothing held.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "deltatrain/memsaver/saver.h"
#include "memsaver_testing.h"

namespace deltatrain::memsaver {
namespace {

using testing::holds;
using testing::Random;
using testing::write;

TEST(SaverStress, ThreadsCyclingTheirOwnTagsNeverSeeEachOthersState) {
  Saver saver(make_host_pages(), SaverOptions{3 * 4096 + 17});
  const std::size_t page = saver.memory().granularity();
  constexpr int workers = 6, rounds = 40;
  std::atomic<int> failures{0};
  std::atomic<bool> done{false};

  auto worker = [&](int index) {
    Random random;
    const std::string optimizer = "optimizer" + std::to_string(index), grads = "grads" + std::to_string(index);
    for (int round = 0; round < rounds; ++round) {
      const std::size_t bytes = random.between(1, 6 * page);
      auto* kept = saver.allocate({optimizer, Backup::CpuCopy}, bytes);
      auto* scratch = saver.allocate({grads, Backup::None}, bytes);
      const auto data = random.bytes(bytes);
      write(kept, data);
      write(scratch, random.bytes(bytes));
      saver.pause(optimizer);
      saver.pause(grads);
      try {
        saver.allocate({optimizer, Backup::CpuCopy}, bytes);
        ++failures;
      } catch (const StateError&) {
      }
      saver.resume(grads);
      saver.resume(optimizer);
      if (!holds(kept, data)) ++failures;
      saver.free(scratch);
      saver.free(kept);
    }
  };
  std::thread observer([&] {
    while (!done) {
      for (const TagStats& stats : saver.stats()) {
        if (stats.state == TagState::Active && stats.mapped_bytes != stats.reserved_bytes) ++failures;
      }
      saver.contains(&done);
    }
  });
  std::vector<std::thread> threads;
  for (int index = 0; index < workers; ++index) threads.emplace_back(worker, index);
  for (std::thread& thread : threads) thread.join();
  done = true;
  observer.join();

  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(saver.stats().size(), 2u * workers);
  for (const TagStats& stats : saver.stats()) {
    EXPECT_EQ(stats.allocations, 0u) << stats.tag;
    EXPECT_EQ(stats.host_bytes_held, 0u) << stats.tag;
  }
  EXPECT_EQ(saver.memory().device_bytes_in_use(), 0u);
}

TEST(SaverStress, PauseAllRacingWithAllocationAndFreeLeavesNothingBehind) {
  // The workers never touch their memory: a paused range is not theirs to touch, and pause() may take any
  // tag at any moment. What is checked is the bookkeeping: allocation under a paused tag fails cleanly,
  // free succeeds in either state, and nothing leaks.
  Saver saver(make_host_pages());
  const std::size_t page = saver.memory().granularity();
  constexpr int workers = 4, rounds = 80;
  std::atomic<int> refused{0};
  auto worker = [&](int index) {
    Random random;
    const std::string tag = "state" + std::to_string(index);
    std::vector<void*> live;
    for (int round = 0; round < rounds; ++round) {
      try {
        live.push_back(saver.allocate({tag, Backup::CpuCopy}, random.between(1, 2 * page)));
      } catch (const StateError&) {
        ++refused;
      }
      if (live.size() > 3) {
        saver.free(live.front());
        live.erase(live.begin());
      }
    }
    for (void* address : live) saver.free(address);
  };
  std::atomic<bool> done{false};
  std::thread controller([&] {
    while (!done) {
      try {
        saver.pause();
        saver.resume();
      } catch (const StateError&) {  // every tag was already in the target state
      }
    }
  });
  std::vector<std::thread> threads;
  for (int index = 0; index < workers; ++index) threads.emplace_back(worker, index);
  for (std::thread& thread : threads) thread.join();
  done = true;
  controller.join();
  for (const TagStats& stats : saver.stats()) {
    EXPECT_EQ(stats.allocations, 0u) << stats.tag;
    EXPECT_EQ(stats.host_bytes_held, 0u) << stats.tag;
  }
  EXPECT_EQ(saver.memory().device_bytes_in_use(), 0u);
  ::testing::Test::RecordProperty("allocations_refused_under_a_paused_tag", refused.load());
}

}  // namespace
}  // namespace deltatrain::memsaver
