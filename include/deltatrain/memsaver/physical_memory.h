// Mechanism of the memory saver: virtual ranges whose physical backing can be dropped and brought back at the
// same address, and the copies between that memory and the host. It knows nothing of tags or policies
// (those are the Saver's); two implementations: CUDA virtual memory management and host pages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "deltatrain/core/error.h"

namespace deltatrain::memsaver {

class PhysicalMemory {
 public:
  virtual ~PhysicalMemory() = default;

  // "cuda" or "host".
  virtual std::string name() const = 0;
  // Reservations and mappings are whole multiples of this many bytes.
  virtual std::size_t granularity() const = 0;
  // Independent copy queues (CUDA streams); copies on different lanes may overlap.
  virtual int lanes() const = 0;

  // Reserve `bytes` of address space with no physical memory behind it.
  virtual void* reserve(std::size_t bytes) = 0;
  // Back [address, address+bytes) of a reservation with fresh physical memory (contents undefined).
  virtual void map(void* address, std::size_t bytes) = 0;
  // Give the physical memory of a mapped range back; the addresses stay reserved.
  virtual void unmap(void* address, std::size_t bytes) = 0;
  // Give back a reservation (unmapped first).
  virtual void release(void* address, std::size_t bytes) = 0;

  // Wait until no queued device work can still touch mapped memory (before it is copied out or unmapped).
  virtual void synchronize_device() = 0;
  // Queue a copy on a lane; it may complete only at wait_for_copies().
  virtual void copy_to_host(void* host, const void* mapped, std::size_t bytes, int lane) = 0;
  virtual void copy_to_device(void* mapped, const void* host, std::size_t bytes, int lane) = 0;
  // Wait for every copy queued so far, on every lane.
  virtual void wait_for_copies() = 0;

  // Host memory the copies reach at full speed (pinned for CUDA), kept by the caller across cycles.
  virtual void* allocate_host(std::size_t bytes) = 0;
  virtual void free_host(void* host, std::size_t bytes) = 0;
  // Make caller-owned host memory reach full copy speed. Returns true when this call pinned it (undo with
  // unpin_host), false when it needed nothing (already pinned, or host pages).
  virtual bool pin_host(void* host, std::size_t bytes) = 0;
  virtual void unpin_host(void* host) = 0;

  // Physical memory of this kind in use now: CUDA, the device's used bytes (all processes, cuMemGetInfo);
  // host pages, the resident bytes of every live reservation (mincore). Measured, not counted by bookkeeping.
  virtual std::uint64_t device_bytes_in_use() const = 0;
};

// Anonymous host mappings: reserve with PROT_NONE, map with MAP_FIXED and populate (MADV_POPULATE_WRITE), unmap
// by replacing the range with a fresh PROT_NONE mapping (so the pages are freed and the resident size falls).
std::unique_ptr<PhysicalMemory> make_host_pages();

// CUDA virtual memory management on one device (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess,
// cuMemUnmap, cuMemAddressFree), copies on `lanes` non-blocking streams of the device's primary context,
// pinned host memory from cuMemHostAlloc. The driver is loaded at run time, so a build with CUDA runs on a
// machine without a driver and this throws Unavailable there.
std::unique_ptr<PhysicalMemory> make_cuda_vmm(int device, int lanes = 4);

// Either of the above by name ("host" or "cuda"); InvalidArgument for any other name.
std::unique_ptr<PhysicalMemory> make_physical_memory(const std::string& backend, int device = 0);

}  // namespace deltatrain::memsaver
