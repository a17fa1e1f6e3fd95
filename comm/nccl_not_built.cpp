// This build has no NCCL: NCCL groups report why they cannot be made (the reason comes from CMake).
#include "deltatrain/comm/nccl_group.h"

#include "deltatrain/core/error.h"

namespace deltatrain::comm {

namespace {
constexpr const char* kReason = DELTATRAIN_NCCL_MISSING;
}

bool nccl_available(std::string* reason) {
  if (reason != nullptr) *reason = kReason;
  return false;
}

std::unique_ptr<Group> make_nccl_group(MPI_Comm, int) { throw Unavailable("NCCL group", kReason); }

std::uint64_t cuda_free_bytes() { throw Unavailable("cuda_free_bytes", kReason); }

}  // namespace deltatrain::comm
