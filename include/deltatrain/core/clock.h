// Wall-clock intervals for progress and phase timings: the steady clock, never the calendar one.
#pragma once

#include <chrono>

namespace deltatrain {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace deltatrain
