// Where a component's long-lived memory comes from. The optimizer, the model's activations and the rollout's
// caches take an optional Allocator (null: plain cudaMalloc, or aligned host memory on the CPU); the RL loop
// hands them the memory saver's tagged regions (memsaver::make_allocator), so that it can park one phase's
// memory while the other phase runs, at the same addresses.
#pragma once

#include <cstddef>

#include "deltatrain/core/tensor.h"

namespace deltatrain {

class Allocator {
 public:
  virtual ~Allocator() = default;
  // At least `bytes` (> 0), 256-byte aligned, on device(); contents undefined. Throws (OutOfMemory,
  // StateError, ...) rather than return null. `what` names the memory in the error.
  virtual void* allocate(std::size_t bytes, const char* what) = 0;
  // Gives back an allocation of this allocator; never throws (callers are destructors).
  virtual void deallocate(void* address) noexcept = 0;
  virtual Device device() const = 0;
};

}  // namespace deltatrain
