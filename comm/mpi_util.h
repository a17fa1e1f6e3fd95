// MPI return codes, counts and host-object exchange, shared by both engines (MPI groups, and NCCL
// groups, which bootstrap and move host objects over MPI).
#pragma once

#include <mpi.h>

#include <climits>
#include <cstddef>
#include <string>
#include <vector>

#include "deltatrain/core/error.h"

namespace deltatrain::comm {

inline void mpi_check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw Failure(std::string(call) + " failed: " + std::string(text, length) + " (code " + std::to_string(code) + ")");
}

// MPI counts are ints; larger transfers are refused rather than truncated.
inline int mpi_count(std::size_t count) {
  if (count > static_cast<std::size_t>(INT_MAX)) {
    throw InvalidArgument("count", "an MPI operation moves at most " + std::to_string(INT_MAX) +
                                       " elements per call; got " + std::to_string(count));
  }
  return static_cast<int>(count);
}

// A private duplicate of a caller's communicator, with errors returned rather than aborting.
struct Members {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 0;
};
// `who` names the caller in the error raised when MPI is not initialised.
Members duplicate_members(MPI_Comm members, const char* who);

// Host bytes of any length from root to every rank of comm.
std::string mpi_broadcast_bytes(MPI_Comm comm, const std::string& bytes, int root);
// Every rank's host bytes, in rank order, on every rank of comm.
std::vector<std::string> mpi_all_gather_bytes(MPI_Comm comm, const std::string& bytes);

}  // namespace deltatrain::comm
