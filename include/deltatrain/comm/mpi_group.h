// The MPI engine: CPU ranks, host buffers, blocking operations.
#pragma once

#include <mpi.h>

#include <memory>

#include "deltatrain/comm/group.h"

namespace deltatrain::comm {

// A group over the members of `members` (duplicated, so the caller's communicator is untouched).
// MPI must be initialised. No memory check is configured: CPU callers plug in their own probe.
std::unique_ptr<Group> make_mpi_group(MPI_Comm members);

// The MPI datatype for a deltatrain dtype; InvalidArgument for types MPI cannot reduce (bf16, f16).
MPI_Datatype mpi_datatype(DType dtype);

}  // namespace deltatrain::comm
