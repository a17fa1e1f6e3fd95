#include "deltatrain/comm/group.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "deltatrain/core/error.h"

namespace deltatrain::comm {

namespace {

constexpr std::array<const char*, kOpCount> kOpNames = {
    "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
    "object_broadcast", "object_all_gather", "barrier", "send", "recv",
};

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto* pa = static_cast<const char*>(a);
  const auto* pb = static_cast<const char*>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

}  // namespace

const char* op_name(Op op) { return kOpNames[static_cast<std::size_t>(op)]; }

Op parse_op(std::string_view name) {
  for (std::size_t i = 0; i < kOpCount; ++i) {
    if (name == kOpNames[i]) return static_cast<Op>(i);
  }
  std::string known;
  for (const char* n : kOpNames) known += std::string(known.empty() ? "" : ", ") + n;
  throw InvalidArgument("op", "must be one of " + known + "; got '" + std::string(name) + "'");
}

OpSet::OpSet(std::initializer_list<Op> ops) {
  for (Op op : ops) insert(op);
}

OpSet hot_path_ops() {
  return {Op::reduce_scatter, Op::all_gather,        Op::all_to_all, Op::send, Op::recv,
          Op::barrier,        Op::object_broadcast, Op::object_all_gather};
}

void Group::check_memory(Op op) {
  if (!check_.free_bytes || check_.skipped.contains(op)) return;
  ++stats_.probes;
  if (check_.free_bytes() < check_.min_free_bytes) {
    ++stats_.trims;
    if (check_.trim) check_.trim();
  }
}

void Group::enter(Op op, int peer, const char* peer_argument) {
  if (peer_argument != nullptr && (peer < 0 || peer >= size_)) {
    throw InvalidArgument(peer_argument, "must be a rank of the group, in [0, " + std::to_string(size_) + "); got " +
                                             std::to_string(peer));
  }
  if (released_) {
    throw StateError(std::string("comm: ") + op_name(op) + " on a released " + engine() +
                     " group; call reload() first");
  }
  check_memory(op);
}

void Group::all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, void* stream) {
  enter(Op::all_reduce);
  do_all_reduce(send, recv, count, dtype, op, stream);
}

void Group::reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype, ReduceOp op,
                           void* stream) {
  const std::size_t bytes = recv_count * dtype_size(dtype);
  if (overlaps(send, bytes * size_, recv, bytes)) {
    throw InvalidArgument("recv", "reduce_scatter needs a receive buffer apart from the send buffer");
  }
  enter(Op::reduce_scatter);
  do_reduce_scatter(send, recv, recv_count, dtype, op, stream);
}

void Group::all_gather(const void* send, void* recv, std::size_t send_count, DType dtype, void* stream) {
  const std::size_t bytes = send_count * dtype_size(dtype);
  const void* own_block = static_cast<const char*>(recv) + bytes * rank_;
  if (send != own_block && overlaps(send, bytes, recv, bytes * size_)) {
    throw InvalidArgument("send", "all_gather's send buffer must be apart from recv or be exactly recv's block "
                                  "of this rank (in place)");
  }
  enter(Op::all_gather);
  do_all_gather(send, recv, send_count, dtype, stream);
}

void Group::all_to_all(const void* send, void* recv, std::size_t count, DType dtype, void* stream) {
  const std::size_t bytes = count * dtype_size(dtype) * size_;
  if (overlaps(send, bytes, recv, bytes)) {
    throw InvalidArgument("recv", "all_to_all needs a receive buffer apart from the send buffer");
  }
  enter(Op::all_to_all);
  do_all_to_all(send, recv, count, dtype, stream);
}

void Group::broadcast(void* data, std::size_t count, DType dtype, int root, void* stream) {
  enter(Op::broadcast, root, "root");
  do_broadcast(data, count, dtype, root, stream);
}

std::string Group::broadcast_object(const std::string& bytes, int root) {
  enter(Op::object_broadcast, root, "root");
  return do_broadcast_object(bytes, root);
}

std::vector<std::string> Group::all_gather_object(const std::string& bytes) {
  enter(Op::object_all_gather);
  return do_all_gather_object(bytes);
}

void Group::barrier(void* stream) {
  enter(Op::barrier);
  do_barrier(stream);
}

void Group::send(const void* data, std::size_t count, DType dtype, int peer, void* stream) {
  enter(Op::send, peer, "peer");
  do_send(data, count, dtype, peer, stream);
}

void Group::recv(void* data, std::size_t count, DType dtype, int peer, void* stream) {
  enter(Op::recv, peer, "peer");
  do_recv(data, count, dtype, peer, stream);
}

void Group::release() {
  if (released_) throw StateError("comm: release() on a " + engine() + " group that is already released");
  do_release();
  released_ = true;
}

void Group::reload() {
  if (!released_) throw StateError("comm: reload() on a " + engine() + " group that is not released");
  do_reload();
  released_ = false;
}

void collectively(Group& group, const std::function<void()>& work) {
  std::string failure;  // empty: success; else a kind letter, then what the kind needs
  try {
    work();
  } catch (const InvalidArgument& e) {
    failure = "I" + e.argument() + '\n' + e.what();
  } catch (const StateError& e) {
    failure = std::string("S") + e.what();
  } catch (const std::exception& e) {
    failure = std::string("F") + e.what();
  }
  const std::vector<std::string> all = group.all_gather_object(failure);
  for (std::size_t rank = 0; rank < all.size(); ++rank) {
    const std::string& f = all[rank];
    if (f.empty()) continue;
    const std::string text = f.substr(1);
    if (f[0] == 'I') {
      const std::string argument = text.substr(0, text.find('\n'));
      const std::string what = text.substr(text.find('\n') + 1);
      const std::string prefix = "invalid argument '" + argument + "': ";
      throw InvalidArgument(argument, what.substr(std::min(prefix.size(), what.size())));
    }
    const std::string message = text + (all.size() > 1 ? " (on rank " + std::to_string(rank) + ")" : "");
    if (f[0] == 'S') throw StateError(message);
    throw Failure(message);
  }
}

std::vector<double> sum_over_ranks(Group& group, std::span<const double> local) {
  std::string bytes(local.size_bytes(), '\0');
  std::memcpy(bytes.data(), local.data(), bytes.size());
  std::vector<double> total(local.size(), 0.0);
  for (const std::string& each : group.all_gather_object(bytes)) {
    if (each.size() != bytes.size()) throw StateError("sum_over_ranks: the ranks passed different counts");
    for (std::size_t i = 0; i < total.size(); ++i) {
      double value;
      std::memcpy(&value, each.data() + i * sizeof value, sizeof value);
      total[i] += value;
    }
  }
  return total;
}

double sum_over_ranks(Group& group, double local) { return sum_over_ranks(group, std::span<const double>(&local, 1))[0]; }

bool any_rank(Group& group, bool local) {
  // Host bytes through the object exchange: a GPU group's collectives take device buffers.
  for (const std::string& each : group.all_gather_object(local ? "1" : "0")) {
    if (each == "1") return true;
  }
  return false;
}

double max_over_ranks(Group& group, double local) {
  std::string bytes(sizeof local, '\0');
  std::memcpy(bytes.data(), &local, sizeof local);
  double largest = local;
  for (const std::string& each : group.all_gather_object(bytes)) {
    double value;
    std::memcpy(&value, each.data(), sizeof value);
    largest = std::max(largest, value);
  }
  return largest;
}

}  // namespace deltatrain::comm
