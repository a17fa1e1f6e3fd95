// Shared helpers of the memsaver tests: fresh random data with a printed seed, and a PhysicalMemory that
// records what the Saver asks of the real backend and can be told to fail one call.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "deltatrain/memsaver/physical_memory.h"

namespace deltatrain::memsaver::testing {

// A generator seeded from std::random_device; the seed is in every failure message of the test.
class Random {
 public:
  Random() : seed_(std::random_device{}()), engine_(seed_), trace_(__FILE__, __LINE__, "seed " + std::to_string(seed_)) {}
  std::vector<std::byte> bytes(std::size_t count) {
    std::vector<std::byte> out(count);
    for (std::byte& value : out) value = static_cast<std::byte>(engine_() & 0xFF);
    return out;
  }
  std::size_t between(std::size_t low, std::size_t high) {
    return std::uniform_int_distribution<std::size_t>(low, high)(engine_);
  }
  std::uint32_t seed() const { return seed_; }

 private:
  std::uint32_t seed_;
  std::mt19937_64 engine_;
  ::testing::ScopedTrace trace_;
};

inline void write(void* address, const std::vector<std::byte>& data) { std::memcpy(address, data.data(), data.size()); }

inline bool holds(const void* address, const std::vector<std::byte>& data) {
  return std::memcmp(address, data.data(), data.size()) == 0;
}

// Forwards to host pages; counts calls, records copy lanes, and throws OutOfMemory at the n-th call of one kind.
class RecordingMemory final : public PhysicalMemory {
 public:
  enum class Call { Map, AllocateHost, CopyToHost, CopyToDevice };

  struct Record {
    int maps = 0, unmaps = 0, allocate_hosts = 0, copies = 0, waits = 0, device_syncs = 0;
    std::vector<int> lanes;
    std::size_t largest_copy = 0;
    // Fail the `fail_at`-th (1-based) call of `fail_call`; 0 never fails.
    Call fail_call = Call::Map;
    int fail_at = 0;
  };

  explicit RecordingMemory(std::shared_ptr<Record> record, int lanes = 3)
      : inner_(make_host_pages()), record_(std::move(record)), lanes_(lanes) {}

  std::string name() const override { return inner_->name(); }
  std::size_t granularity() const override { return inner_->granularity(); }
  int lanes() const override { return lanes_; }
  void* reserve(std::size_t bytes) override { return inner_->reserve(bytes); }
  void map(void* address, std::size_t bytes) override {
    maybe_fail(Call::Map, ++record_->maps);
    inner_->map(address, bytes);
  }
  void unmap(void* address, std::size_t bytes) override {
    ++record_->unmaps;
    inner_->unmap(address, bytes);
  }
  void release(void* address, std::size_t bytes) override { inner_->release(address, bytes); }
  void synchronize_device() override { ++record_->device_syncs; }
  void copy_to_host(void* host, const void* mapped, std::size_t bytes, int lane) override {
    maybe_fail(Call::CopyToHost, record_copy(bytes, lane));
    inner_->copy_to_host(host, mapped, bytes, lane);
  }
  void copy_to_device(void* mapped, const void* host, std::size_t bytes, int lane) override {
    maybe_fail(Call::CopyToDevice, record_copy(bytes, lane));
    inner_->copy_to_device(mapped, host, bytes, lane);
  }
  void wait_for_copies() override { ++record_->waits; }
  void* allocate_host(std::size_t bytes) override {
    maybe_fail(Call::AllocateHost, ++record_->allocate_hosts);
    return inner_->allocate_host(bytes);
  }
  void free_host(void* host, std::size_t bytes) override { inner_->free_host(host, bytes); }
  bool pin_host(void* host, std::size_t bytes) override { return inner_->pin_host(host, bytes); }
  void unpin_host(void* host) override { inner_->unpin_host(host); }
  std::uint64_t device_bytes_in_use() const override { return inner_->device_bytes_in_use(); }

 private:
  int record_copy(std::size_t bytes, int lane) {
    record_->lanes.push_back(lane);
    record_->largest_copy = std::max(record_->largest_copy, bytes);
    return ++record_->copies;
  }
  void maybe_fail(Call call, int count) const {
    if (record_->fail_call == call && record_->fail_at == count) throw OutOfMemory("injected failure");
  }

  std::unique_ptr<PhysicalMemory> inner_;
  std::shared_ptr<Record> record_;
  int lanes_;
};

}  // namespace deltatrain::memsaver::testing
