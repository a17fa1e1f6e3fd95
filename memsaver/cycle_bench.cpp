#include "deltatrain/memsaver/cycle_bench.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "deltatrain/core/clock.h"

namespace deltatrain::memsaver {
namespace {

// Byte p of the pattern is byte p % 8 of splitmix64(seed + p / 8): position-dependent, so a shifted,
// truncated or zeroed copy never matches.
std::uint64_t pattern_word(std::uint64_t seed, std::uint64_t index) {
  std::uint64_t z = seed + index * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Runs work(begin, end) over [0, bytes) in 8-byte-aligned slices on the machine's cores.
template <typename Work>
void in_parallel(std::size_t bytes, Work work) {
  const std::size_t threads = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 32);
  const std::size_t slice = ((bytes / threads) + 7) / 8 * 8;
  std::vector<std::thread> pool;
  for (std::size_t begin = 0; begin < bytes; begin += std::max<std::size_t>(slice, 8)) {
    pool.emplace_back(work, begin, std::min(bytes, begin + std::max<std::size_t>(slice, 8)));
  }
  for (std::thread& thread : pool) thread.join();
}

// Writes the pattern for positions [offset, offset + bytes) into `out`; offset is a multiple of 8.
void fill_pattern(std::byte* out, std::size_t bytes, std::uint64_t offset, std::uint64_t seed) {
  in_parallel(bytes, [=](std::size_t begin, std::size_t end) {
    for (std::size_t p = begin; p < end; p += 8) {
      const std::uint64_t word = pattern_word(seed, (offset + p) / 8);
      std::memcpy(out + p, &word, std::min<std::size_t>(8, end - p));
    }
  });
}

bool matches_pattern(const std::byte* in, std::size_t bytes, std::uint64_t offset, std::uint64_t seed) {
  std::atomic<bool> same{true};
  in_parallel(bytes, [&](std::size_t begin, std::size_t end) {
    for (std::size_t p = begin; p < end && same.load(std::memory_order_relaxed); p += 8) {
      const std::uint64_t word = pattern_word(seed, (offset + p) / 8);
      if (std::memcmp(in + p, &word, std::min<std::size_t>(8, end - p)) != 0) same = false;
    }
  });
  return same;
}

template <typename Copy>
double better_of_two(PhysicalMemory& memory, Copy copy) {
  double best = 0;
  for (int attempt = 0; attempt < 2; ++attempt) {
    const auto start = Clock::now();
    copy();
    memory.wait_for_copies();
    const double elapsed = seconds_since(start);
    best = attempt == 0 ? elapsed : std::min(best, elapsed);
  }
  return best;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

// Host memory from the backend, given back however the benchmark ends.
class HostBuffer {
 public:
  HostBuffer(PhysicalMemory& memory, std::size_t bytes)
      : memory_(memory), bytes_(bytes), data_(static_cast<std::byte*>(memory.allocate_host(bytes))) {}
  ~HostBuffer() { reset(); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  std::byte* data() const { return data_; }
  void reset() {
    if (!data_) return;
    try {
      memory_.free_host(data_, bytes_);
    } catch (const Error&) {
    }
    data_ = nullptr;
  }

 private:
  PhysicalMemory& memory_;
  std::size_t bytes_;
  std::byte* data_;
};

}  // namespace

double gib_per_s(std::size_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / double(1ull << 30) : 0.0;
}

CycleBenchReport run_cycle_bench(const CycleBenchOptions& options) {
  if (options.bytes == 0) throw InvalidArgument("bytes", "must be positive, got 0");
  if (options.cycles < 1) throw InvalidArgument("cycles", "must be at least 1, got " + std::to_string(options.cycles));

  Saver saver(make_physical_memory(options.backend, options.device), SaverOptions{options.chunk_bytes});
  PhysicalMemory& memory = saver.memory();
  CycleBenchReport report;
  report.backend = memory.name();
  report.bytes = options.bytes;
  report.backup = options.backup;
  report.cycles = options.cycles;
  report.seed = (std::uint64_t{std::random_device{}()} << 32) | std::random_device{}();

  const std::string tag = "bench";
  auto* allocation = static_cast<std::byte*>(saver.allocate({tag, options.backup}, options.bytes));
  struct FreeOnExit {
    Saver& saver;
    void* address;
    ~FreeOnExit() {
      try {
        saver.free(address);
      } catch (const Error&) {
      }
    }
  } free_on_exit{saver, allocation};

  {
    HostBuffer source(memory, options.bytes);
    fill_pattern(source.data(), options.bytes, 0, report.seed);
    report.h2d_s = better_of_two(memory, [&] { memory.copy_to_device(allocation, source.data(), options.bytes, 0); });
    report.d2h_s = better_of_two(memory, [&] { memory.copy_to_host(source.data(), allocation, options.bytes, 0); });
    if (options.backup == Backup::RestoreFrom) {
      saver.register_backup(tag, {{reinterpret_cast<std::uintptr_t>(allocation), source.data(), options.bytes}});
    }
    report.resident_before = memory.device_bytes_in_use();

    std::vector<double> pauses, resumes;
    for (int cycle = 0; cycle < options.cycles; ++cycle) {
      auto start = Clock::now();
      saver.pause(tag);
      pauses.push_back(seconds_since(start));
      if (cycle == 0) report.resident_paused = memory.device_bytes_in_use();
      start = Clock::now();
      saver.resume(tag);
      resumes.push_back(seconds_since(start));
    }
    report.resident_resumed = memory.device_bytes_in_use();
    report.host_bytes_held = saver.stats(tag).host_bytes_held;
    report.first_pause_s = pauses.front();
    report.first_resume_s = resumes.front();
    report.pause_s = pauses.size() > 1 ? median({pauses.begin() + 1, pauses.end()}) : pauses.front();
    report.resume_s = resumes.size() > 1 ? median({resumes.begin() + 1, resumes.end()}) : resumes.front();
    if (options.backup == Backup::RestoreFrom) saver.unregister_backup(tag);
  }

  const std::size_t staging_bytes = std::min<std::size_t>(options.bytes, std::size_t{256} << 20);
  HostBuffer staging(memory, staging_bytes);
  report.contents_restored = true;
  for (std::size_t offset = 0; offset < options.bytes && report.contents_restored; offset += staging_bytes) {
    const std::size_t bytes = std::min(staging_bytes, options.bytes - offset);
    memory.copy_to_host(staging.data(), allocation + offset, bytes, 0);
    memory.wait_for_copies();
    report.contents_restored = matches_pattern(staging.data(), bytes, offset, report.seed);
  }
  return report;
}

}  // namespace deltatrain::memsaver
