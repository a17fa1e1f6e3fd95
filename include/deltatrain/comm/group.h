// Group: one communicator interface over two engines, MPI for CPU ranks and NCCL for GPU ranks.
//
// A group can be released (the engine's communicator is destroyed, so its memory is really freed)
// and reloaded (rebuilt with the same members); callers keep the same Group object throughout.
// Before an operation the group may check free memory and trim caches (MemoryCheck); which
// operations skip that check is data, not code.
#pragma once

#include <bitset>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "deltatrain/core/tensor.h"

namespace deltatrain::comm {

// Every operation a group performs; the memory check is configured per operation.
enum class Op : std::uint8_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  all_to_all,
  broadcast,
  object_broadcast,
  object_all_gather,
  barrier,
  send,
  recv,
};
inline constexpr std::size_t kOpCount = 10;
const char* op_name(Op op);
// Inverse of op_name; InvalidArgument naming the text and the known names otherwise.
Op parse_op(std::string_view name);

class OpSet {
 public:
  OpSet() = default;
  OpSet(std::initializer_list<Op> ops);
  bool contains(Op op) const { return bits_[static_cast<std::size_t>(op)]; }
  void insert(Op op) { bits_.set(static_cast<std::size_t>(op)); }
  void erase(Op op) { bits_.reset(static_cast<std::size_t>(op)); }
  bool operator==(const OpSet&) const = default;

 private:
  std::bitset<kOpCount> bits_;
};

// The hot path of a training step: these allocate nothing in the engines, run every step, and
// would pay the probe on every call (slime #1947). Everything else is checked by default.
OpSet hot_path_ops();

enum class ReduceOp : std::uint8_t { sum, max, min };

// Policy for the free-memory check. The probe and the trim are supplied by whoever owns the
// memory (a caching allocator, the memory saver); the group only decides when to call them.
struct MemoryCheck {
  std::function<std::uint64_t()> free_bytes;  // empty: no check at all
  std::function<void()> trim;                 // called when free memory is under the threshold
  std::uint64_t min_free_bytes = std::uint64_t{3} << 30;  // slime's 3 GiB
  OpSet skipped = hot_path_ops();
};

struct MemoryCheckStats {
  std::uint64_t probes = 0;  // operations that ran the check
  std::uint64_t trims = 0;   // checks that found free memory under the threshold (and called trim, if set)
};

// A communicator. Buffers live on device(): host memory for MPI groups, the group's GPU for NCCL
// groups. `stream` is a cudaStream_t for GPU groups (the operation is enqueued on it and returns
// without waiting) and is ignored by CPU groups (operations complete before returning).
// Counts are in elements of `dtype`. Every rank of the group must make the same calls in the same order.
class Group {
 public:
  virtual ~Group() = default;
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual Device device() const = 0;
  virtual std::string engine() const = 0;  // "mpi" or "nccl"

  // recv may equal send (in place).
  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                  void* stream = nullptr);
  // send holds size()*recv_count elements; rank r receives the reduction of block r. No overlap.
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype, ReduceOp op,
                      void* stream = nullptr);
  // recv holds size()*send_count elements. In place when send == recv + rank()*send_count.
  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype, void* stream = nullptr);
  // send and recv hold size()*count elements; block j of send goes to rank j. No overlap.
  void all_to_all(const void* send, void* recv, std::size_t count, DType dtype, void* stream = nullptr);
  void broadcast(void* data, std::size_t count, DType dtype, int root, void* stream = nullptr);
  // Host bytes, any length; every rank returns root's bytes. Waits for completion.
  std::string broadcast_object(const std::string& bytes, int root);
  // Host bytes, any length per rank; every rank returns all ranks' bytes, in rank order.
  std::vector<std::string> all_gather_object(const std::string& bytes);
  // Returns once every rank has entered it (on GPU groups: after the stream's earlier work).
  void barrier(void* stream = nullptr);
  void send(const void* data, std::size_t count, DType dtype, int peer, void* stream = nullptr);
  void recv(void* data, std::size_t count, DType dtype, int peer, void* stream = nullptr);

  // Destroys the engine's communicator; every operation then raises StateError until reload().
  // Collective: every rank calls it.
  void release();
  // Rebuilds the communicator with the same members. Collective.
  void reload();
  bool released() const { return released_; }

  void set_memory_check(MemoryCheck check) { check_ = std::move(check); }
  const MemoryCheck& memory_check() const { return check_; }
  const MemoryCheckStats& memory_check_stats() const { return stats_; }
  // Runs the policy for `op` as an operation would: exposed so its cost can be measured alone.
  void check_memory(Op op);

 protected:
  Group(int rank, int size) : rank_(rank), size_(size) {}

  virtual void do_all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                             void* stream) = 0;
  virtual void do_reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype, ReduceOp op,
                                 void* stream) = 0;
  virtual void do_all_gather(const void* send, void* recv, std::size_t send_count, DType dtype, void* stream) = 0;
  virtual void do_all_to_all(const void* send, void* recv, std::size_t count, DType dtype, void* stream) = 0;
  virtual void do_broadcast(void* data, std::size_t count, DType dtype, int root, void* stream) = 0;
  virtual std::string do_broadcast_object(const std::string& bytes, int root) = 0;
  virtual std::vector<std::string> do_all_gather_object(const std::string& bytes) = 0;
  virtual void do_barrier(void* stream) = 0;
  virtual void do_send(const void* data, std::size_t count, DType dtype, int peer, void* stream) = 0;
  virtual void do_recv(void* data, std::size_t count, DType dtype, int peer, void* stream) = 0;
  virtual void do_release() = 0;
  virtual void do_reload() = 0;

 private:
  // Checks shared by every engine (the peer or root, when `peer_argument` names one; the state),
  // then the memory policy.
  void enter(Op op, int peer = 0, const char* peer_argument = nullptr);

  int rank_;
  int size_;
  bool released_ = false;
  MemoryCheck check_;
  MemoryCheckStats stats_;
};

// Runs `work` on this rank, then lets every rank learn whether any rank failed: all of them raise the first
// failure (by rank) with its type (InvalidArgument with its argument, StateError, or Failure), naming the rank
// when there are several, so that no rank walks on into a collective alone. Collective.
void collectively(Group& group, const std::function<void()>& work);

// Host doubles summed over the ranks in rank order, so the result is the same whatever the engine's
// reduction order (and bitwise the same on every rank). Collective.
double sum_over_ranks(Group& group, double local);
// The same element-wise, for many values in one exchange (every rank passes as many). Collective.
std::vector<double> sum_over_ranks(Group& group, std::span<const double> local);
// The largest of the ranks' host doubles. Collective.
double max_over_ranks(Group& group, double local);
// Whether `local` is true on any rank. Collective.
bool any_rank(Group& group, bool local);

}  // namespace deltatrain::comm
