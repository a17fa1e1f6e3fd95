// The NCCL engine: GPU ranks, device buffers, operations enqueued on the caller's stream.
// The NCCL unique id is bootstrapped over MPI among the same members.
//
// release() and reload() return before the communicator's teardown (~0.2 s on an H200) or rebuild is done: both
// run on worker threads, so a phase switch overlaps them with its other work (the rollout after a release, the
// restored training memory before the first collective after a reload; a rebuild does not wait for the previous
// teardown). The next operation waits for the rebuild and raises its failure; the teardown's device memory is
// free once it ends (at the latest when the next release or the group's destruction waits for it).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>

#include "deltatrain/comm/group.h"

namespace deltatrain::comm {

// Whether NCCL groups can be made here (built with CUDA and NCCL, at least one GPU), with the reason.
bool nccl_available(std::string* reason = nullptr);

// A group over the members of `members`, each rank on its GPU `device` (made current here).
// The memory check probes the device's free memory (cudaMemGetInfo); the caller supplies `trim`.
// Unavailable where nccl_available() is false.
std::unique_ptr<Group> make_nccl_group(MPI_Comm members, int device);

// Free device memory of the current GPU as the driver reports it (cudaMemGetInfo).
std::uint64_t cuda_free_bytes();

}  // namespace deltatrain::comm
