#include "deltatrain/comm/mpi_group.h"

#include <string>
#include <vector>

#include "mpi_util.h"
#include "deltatrain/core/error.h"

namespace deltatrain::comm {

namespace {

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return MPI_SUM;
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
  }
  throw InvalidArgument("op", "unknown reduction");
}

// Moving bytes needs no arithmetic: an unsigned integer of the element's width carries any dtype.
MPI_Datatype mpi_carrier(DType dtype) {
  switch (dtype_size(dtype)) {
    case 1:
      return MPI_UINT8_T;
    case 2:
      return MPI_UINT16_T;
    case 4:
      return MPI_UINT32_T;
    default:
      return MPI_UINT64_T;
  }
}

class MpiGroup final : public Group {
 public:
  MpiGroup(MPI_Comm members, int rank, int size) : Group(rank, size), members_(members) { do_reload(); }
  ~MpiGroup() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;  // MPI_Finalize already freed every communicator
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    MPI_Comm_free(&members_);
  }

  Device device() const override { return {}; }
  std::string engine() const override { return "mpi"; }

 protected:
  void do_all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, void*) override {
    const void* source = send == recv ? MPI_IN_PLACE : send;
    mpi_check(MPI_Allreduce(source, recv, mpi_count(count), mpi_datatype(dtype), mpi_op(op), comm_), "MPI_Allreduce");
  }
  void do_reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype, ReduceOp op,
                         void*) override {
    mpi_check(MPI_Reduce_scatter_block(send, recv, mpi_count(recv_count), mpi_datatype(dtype), mpi_op(op), comm_),
              "MPI_Reduce_scatter_block");
  }
  void do_all_gather(const void* send, void* recv, std::size_t send_count, DType dtype, void*) override {
    const std::size_t bytes = send_count * dtype_size(dtype);
    const bool in_place = send == static_cast<const char*>(recv) + bytes * rank();
    mpi_check(MPI_Allgather(in_place ? MPI_IN_PLACE : send, mpi_count(send_count), mpi_carrier(dtype), recv,
                            mpi_count(send_count), mpi_carrier(dtype), comm_),
              "MPI_Allgather");
  }
  void do_all_to_all(const void* send, void* recv, std::size_t count, DType dtype, void*) override {
    mpi_check(MPI_Alltoall(send, mpi_count(count), mpi_carrier(dtype), recv, mpi_count(count), mpi_carrier(dtype),
                           comm_),
              "MPI_Alltoall");
  }
  void do_broadcast(void* data, std::size_t count, DType dtype, int root, void*) override {
    mpi_check(MPI_Bcast(data, mpi_count(count), mpi_carrier(dtype), root, comm_), "MPI_Bcast");
  }
  std::string do_broadcast_object(const std::string& bytes, int root) override {
    return mpi_broadcast_bytes(comm_, bytes, root);
  }
  std::vector<std::string> do_all_gather_object(const std::string& bytes) override {
    return mpi_all_gather_bytes(comm_, bytes);
  }
  void do_barrier(void*) override { mpi_check(MPI_Barrier(comm_), "MPI_Barrier"); }
  void do_send(const void* data, std::size_t count, DType dtype, int peer, void*) override {
    mpi_check(MPI_Send(data, mpi_count(count), mpi_carrier(dtype), peer, 0, comm_), "MPI_Send");
  }
  void do_recv(void* data, std::size_t count, DType dtype, int peer, void*) override {
    mpi_check(MPI_Recv(data, mpi_count(count), mpi_carrier(dtype), peer, 0, comm_, MPI_STATUS_IGNORE), "MPI_Recv");
  }
  void do_release() override {
    mpi_check(MPI_Comm_free(&comm_), "MPI_Comm_free");
  }
  void do_reload() override {
    mpi_check(MPI_Comm_dup(members_, &comm_), "MPI_Comm_dup");  // inherits MPI_ERRORS_RETURN
  }

 private:
  MPI_Comm members_;              // kept for the group's lifetime: reload() rebuilds from it
  MPI_Comm comm_ = MPI_COMM_NULL;  // the communicator that operations use; freed by release()
};

}  // namespace

MPI_Datatype mpi_datatype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
    case DType::f16:
    case DType::bf16:
      break;
  }
  throw InvalidArgument("dtype", std::string("MPI groups reduce float32, float64 and integers only; got ") +
                                     dtype_name(dtype));
}

std::unique_ptr<Group> make_mpi_group(MPI_Comm members) {
  const Members own = duplicate_members(members, "make_mpi_group");
  return std::make_unique<MpiGroup>(own.comm, own.rank, own.size);
}

}  // namespace deltatrain::comm
