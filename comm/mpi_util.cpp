#include "mpi_util.h"

#include <cstdint>

namespace deltatrain::comm {

Members duplicate_members(MPI_Comm members, const char* who) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw StateError(std::string("comm: ") + who + " needs MPI to be initialised (MPI_Init)");
  Members own;
  mpi_check(MPI_Comm_dup(members, &own.comm), "MPI_Comm_dup");
  mpi_check(MPI_Comm_set_errhandler(own.comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  mpi_check(MPI_Comm_rank(own.comm, &own.rank), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(own.comm, &own.size), "MPI_Comm_size");
  return own;
}

std::string mpi_broadcast_bytes(MPI_Comm comm, const std::string& bytes, int root) {
  int rank = 0;
  mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  std::uint64_t length = bytes.size();
  mpi_check(MPI_Bcast(&length, 1, MPI_UINT64_T, root, comm), "MPI_Bcast");
  std::string out = rank == root ? bytes : std::string(length, '\0');
  mpi_check(MPI_Bcast(out.data(), mpi_count(length), MPI_BYTE, root, comm), "MPI_Bcast");
  return out;
}

std::vector<std::string> mpi_all_gather_bytes(MPI_Comm comm, const std::string& bytes) {
  int size = 0;
  mpi_check(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  const int length = mpi_count(bytes.size());
  std::vector<int> lengths(size);
  mpi_check(MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, comm), "MPI_Allgather");
  std::vector<int> displacements(size);
  std::size_t total = 0;
  for (int r = 0; r < size; ++r) {
    displacements[r] = mpi_count(total);
    total += lengths[r];
  }
  std::string all(total, '\0');
  mpi_check(MPI_Allgatherv(bytes.data(), length, MPI_BYTE, all.data(), lengths.data(), displacements.data(),
                           MPI_BYTE, comm),
            "MPI_Allgatherv");
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r) out.push_back(all.substr(displacements[r], lengths[r]));
  return out;
}

}  // namespace deltatrain::comm
