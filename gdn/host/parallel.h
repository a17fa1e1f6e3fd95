// Failing cleanly inside the host backends' OpenMP regions, and naming what
// could not be allocated.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iterator>
#include <new>
#include <string>
#include <utility>

#include "deltatrain/core/error.h"

namespace deltatrain::gdn::host {

// "4.0 TiB": sizes in messages, where an exact byte count of 13 digits would
// not be read.
inline std::string format_bytes(double bytes) {
  static constexpr const char *kUnits[] = {"bytes", "KiB", "MiB", "GiB",
                                           "TiB",   "PiB", "EiB"};
  int unit = 0;
  while (bytes >= 1024 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    bytes /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.1f %s", bytes,
                kUnits[unit]);
  return text;
}

// Runs `allocate`, turning std::bad_alloc into OutOfMemory naming `what`: a
// bare bad_alloc reaches Python as a MemoryError that says nothing of which
// buffer of which call was too large.
template <class Allocate>
decltype(auto) allocating(const std::string &what, Allocate &&allocate) {
  try {
    return std::forward<Allocate>(allocate)();
  } catch (const std::bad_alloc &) {
    throw OutOfMemory("out of memory allocating " + what);
  }
}

// An exception must not leave an OpenMP region: the runtime would call
// std::terminate. Work inside one runs through guard(): the first exception any
// thread throws is kept (std::bad_alloc as OutOfMemory naming `allocations`,
// what the region allocates), every thread then skips its remaining work, and
// rethrow() raises it once the region has ended.
class ParallelFailure {
public:
  explicit ParallelFailure(std::string allocations)
      : allocations_(std::move(allocations)) {}

  template <class Work> void guard(Work &&work) noexcept {
    if (failed_.load(std::memory_order_relaxed))
      return;
    try {
      allocating(allocations_, std::forward<Work>(work));
    } catch (...) {
#pragma omp critical(deltatrain_gdn_parallel_failure)
      if (!first_)
        first_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }

  void rethrow() const {
    if (first_)
      std::rethrow_exception(first_);
  }

private:
  std::string allocations_;
  std::atomic<bool> failed_{false};
  std::exception_ptr first_;
};

} // namespace deltatrain::gdn::host
