#include "deltatrain/comm/nccl_group.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <future>
#include <string>
#include <utility>
#include <vector>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "mpi_util.h"

namespace deltatrain::comm {

namespace {

void nccl_check(ncclResult_t result, const char* call, ncclComm_t comm = nullptr) {
  if (result == ncclSuccess) return;
  std::string detail = comm != nullptr ? ncclGetLastError(comm) : "";
  throw Failure(std::string(call) + " failed: " + ncclGetErrorString(result) + " (code " +
                std::to_string(static_cast<int>(result)) + ")" + (detail.empty() ? "" : ": " + detail));
}

ncclDataType_t nccl_datatype(DType dtype) {
  switch (dtype) {
    case DType::f16:
      return ncclFloat16;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
  }
  throw InvalidArgument("dtype", "unknown dtype");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  throw InvalidArgument("op", "unknown reduction");
}

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

class NcclGroup final : public Group {
 public:
  NcclGroup(MPI_Comm members, int rank, int size, int device) : Group(rank, size), members_(members), device_(device) {
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    cuda_check(cudaMalloc(&barrier_word_, sizeof(float)), "cudaMalloc");
    do_reload();
    MemoryCheck check;
    check.free_bytes = cuda_free_bytes;
    set_memory_check(std::move(check));
  }
  ~NcclGroup() override {
    for (std::future<void>* work : {&rebuild_, &teardown_}) {
      try {
        if (work->valid()) work->get();
      } catch (const std::exception&) {
        // A destructor reports nothing: the failure was the rebuild's or the teardown's, and nothing uses it now.
      }
    }
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    cudaFree(barrier_word_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&members_);
  }

  Device device() const override { return {DeviceType::cuda, device_}; }
  std::string engine() const override { return "nccl"; }

 protected:
  void do_all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                     void* stream) override {
    ncclComm_t comm = communicator();
    nccl_check(ncclAllReduce(send, recv, count, nccl_datatype(dtype), nccl_op(op), comm, as_stream(stream)),
               "ncclAllReduce", comm);
  }
  void do_reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype, ReduceOp op,
                         void* stream) override {
    ncclComm_t comm = communicator();
    nccl_check(ncclReduceScatter(send, recv, recv_count, nccl_datatype(dtype), nccl_op(op), comm, as_stream(stream)),
               "ncclReduceScatter", comm);
  }
  void do_all_gather(const void* send, void* recv, std::size_t send_count, DType dtype, void* stream) override {
    ncclComm_t comm = communicator();
    nccl_check(ncclAllGather(send, recv, send_count, nccl_datatype(dtype), comm, as_stream(stream)), "ncclAllGather",
               comm);
  }
  void do_all_to_all(const void* send, void* recv, std::size_t count, DType dtype, void* stream) override {
    ncclComm_t comm = communicator();
    const std::size_t block = count * dtype_size(dtype);
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (int peer = 0; peer < size(); ++peer) {
      nccl_check(ncclSend(static_cast<const char*>(send) + peer * block, count, nccl_datatype(dtype), peer, comm,
                          as_stream(stream)),
                 "ncclSend", comm);
      nccl_check(ncclRecv(static_cast<char*>(recv) + peer * block, count, nccl_datatype(dtype), peer, comm,
                          as_stream(stream)),
                 "ncclRecv", comm);
    }
    nccl_check(ncclGroupEnd(), "ncclGroupEnd", comm);
  }
  void do_broadcast(void* data, std::size_t count, DType dtype, int root, void* stream) override {
    ncclComm_t comm = communicator();
    nccl_check(ncclBroadcast(data, data, count, nccl_datatype(dtype), root, comm, as_stream(stream)), "ncclBroadcast",
               comm);
  }
  // Objects are host bytes: they travel over the MPI bootstrap communicator, never through the GPU.
  std::string do_broadcast_object(const std::string& bytes, int root) override {
    return mpi_broadcast_bytes(members_, bytes, root);
  }
  std::vector<std::string> do_all_gather_object(const std::string& bytes) override {
    return mpi_all_gather_bytes(members_, bytes);
  }
  void do_barrier(void* stream) override {
    ncclComm_t comm = communicator();
    nccl_check(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum, comm, as_stream(stream)),
               "ncclAllReduce", comm);
    cuda_check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
  }
  void do_send(const void* data, std::size_t count, DType dtype, int peer, void* stream) override {
    ncclComm_t comm = communicator();
    nccl_check(ncclSend(data, count, nccl_datatype(dtype), peer, comm, as_stream(stream)), "ncclSend", comm);
  }
  void do_recv(void* data, std::size_t count, DType dtype, int peer, void* stream) override {
    ncclComm_t comm = communicator();
    nccl_check(ncclRecv(data, count, nccl_datatype(dtype), peer, comm, as_stream(stream)), "ncclRecv", comm);
  }
  // The teardown and the rebuild run on worker threads, so that a phase switch does not wait for them: the
  // teardown overlaps whatever the caller does next (the rollout; it may still run when the next rebuild
  // starts, as the two communicators are independent), the rebuild overlaps the memory the caller restores
  // before its first collective. Only the unique id's broadcast stays on the calling thread (MPI is initialised
  // for one thread). An operation or a release waits for the rebuild in flight and raises its failure; the
  // next release waits for the previous teardown.
  void do_release() override {
    ncclComm_t comm = std::exchange(communicator(), nullptr);
    if (teardown_.valid()) teardown_.get();
    teardown_ = std::async(std::launch::async, [comm, device = device_] {
      cuda_check(cudaSetDevice(device), "cudaSetDevice");
      // Finalize flushes outstanding operations; destroy then frees the communicator's device buffers.
      nccl_check(ncclCommFinalize(comm), "ncclCommFinalize", comm);
      nccl_check(ncclCommDestroy(comm), "ncclCommDestroy");
    });
  }
  void do_reload() override {
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    ncclUniqueId id{};
    if (rank() == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    mpi_check(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, members_), "MPI_Bcast");
    rebuild_ = std::async(std::launch::async, [this, id, ranks = size(), me = rank(), device = device_] {
      cuda_check(cudaSetDevice(device), "cudaSetDevice");
      nccl_check(ncclCommInitRank(&comm_, ranks, id, me), "ncclCommInitRank");
    });
  }

  // The communicator, once the rebuild in flight is done (rethrowing its failure).
  ncclComm_t& communicator() {
    if (rebuild_.valid()) rebuild_.get();
    return comm_;
  }

 private:
  MPI_Comm members_;  // the bootstrap: carries the unique id at every reload, and host objects
  int device_;
  ncclComm_t comm_ = nullptr;
  std::future<void> rebuild_;   // do_reload's, until the first operation
  std::future<void> teardown_;  // do_release's, until the next release or the destructor
  void* barrier_word_ = nullptr;
};

}  // namespace

bool nccl_available(std::string* reason) {
  const CudaInfo& cuda = cuda_info();
  if (!cuda.usable()) {
    if (reason != nullptr) *reason = cuda.unavailable_reason;
    return false;
  }
  return true;
}

std::uint64_t cuda_free_bytes() {
  std::size_t free = 0, total = 0;
  cuda_check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

std::unique_ptr<Group> make_nccl_group(MPI_Comm members, int device) {
  std::string reason;
  if (!nccl_available(&reason)) throw Unavailable("NCCL group", reason);
  const int gpus = static_cast<int>(cuda_info().gpus.size());
  if (device < 0 || device >= gpus) {
    throw InvalidArgument("device", "must be a visible GPU index in [0, " + std::to_string(gpus) + "); got " +
                                        std::to_string(device));
  }
  const Members own = duplicate_members(members, "make_nccl_group (its bootstrap)");
  return std::make_unique<NcclGroup>(own.comm, own.rank, own.size, device);
}

}  // namespace deltatrain::comm
