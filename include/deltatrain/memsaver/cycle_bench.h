// One measured park-and-restore cycle of the Saver on a backend, against the plain copy of the same size on
// the same machine: what `deltatrain bench memsaver` runs and prints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "deltatrain/memsaver/saver.h"

namespace deltatrain::memsaver {

struct CycleBenchOptions {
  std::string backend = "host";  // "host" or "cuda"
  int device = 0;
  std::size_t bytes = std::size_t{1} << 30;
  // restore_from registers the host buffer that filled the allocation as its weights backup.
  Backup backup = Backup::None;
  int cycles = 3;  // the first cycle also allocates the pinned copies; later cycles reuse them
  std::size_t chunk_bytes = SaverOptions{}.chunk_bytes;
};

struct CycleBenchReport {
  std::string backend;
  std::size_t bytes = 0;
  Backup backup = Backup::None;
  int cycles = 0;
  std::uint64_t seed = 0;        // of the fill pattern
  double first_pause_s = 0, first_resume_s = 0;
  double pause_s = 0, resume_s = 0;  // median of the cycles after the first (the first when cycles == 1)
  // Physical memory in use (PhysicalMemory::device_bytes_in_use): after the fill, after the first pause,
  // after the last resume.
  std::uint64_t resident_before = 0, resident_paused = 0, resident_resumed = 0;
  std::uint64_t host_bytes_held = 0;  // by the saver for this allocation after the last resume
  bool contents_restored = false;     // the fill pattern came back bitwise after the last resume
  // Reference: one plain copy of all the bytes each way between the allocation and pinned host memory
  // (host memcpy for the host backend), the better of two.
  double d2h_s = 0, h2d_s = 0;
};

CycleBenchReport run_cycle_bench(const CycleBenchOptions& options);

// Bytes per second in GiB/s.
double gib_per_s(std::size_t bytes, double seconds);

}  // namespace deltatrain::memsaver
