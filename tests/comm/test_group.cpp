// Group semantics on both engines, run under mpirun: each operation against what every rank can
// compute from the shared seed, release/reload, the memory-check policy, and argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>

#include "deltatrain/comm/group.h"
#include "deltatrain/comm/nccl_group.h"
#include "deltatrain/core/error.h"
#include "test_support.h"

namespace deltatrain::comm {
namespace {

using testing_support::DeviceMemory;

// The values rank `rank` contributes, regenerated identically on every rank.
std::vector<float> rank_values(std::uint64_t seed, int rank, std::size_t count) {
  std::mt19937_64 rng(seed * 1000003 + rank);
  std::uniform_real_distribution<float> uniform(-1, 1);
  std::vector<float> values(count);
  for (float& v : values) v = uniform(rng);
  return values;
}

class GroupTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    group_ = testing_support::make_group(GetParam(), MPI_COMM_WORLD, &skip);
    if (!group_) GTEST_SKIP() << skip;
    seed_ = testing_support::shared_seed();
    trace_.emplace(__FILE__, __LINE__, "seed " + std::to_string(seed_));  // printed with every failure
  }
  void synchronize() { group_->barrier(); }

  std::unique_ptr<Group> group_;
  std::uint64_t seed_ = 0;
  std::optional<::testing::ScopedTrace> trace_;
};

TEST_P(GroupTest, AllReduceMatchesSumMaxMinOfEveryRanksValues) {
  const int ranks = group_->size();
  const std::size_t count = 1000 + seed_ % 300;
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
    DeviceMemory buffer(group_->device(), count * sizeof(float));
    const std::vector<float> mine = rank_values(seed_, group_->rank(), count);
    buffer.upload(mine.data(), count * sizeof(float));
    group_->all_reduce(buffer.data(), buffer.data(), count, DType::f32, op);
    const std::vector<float> got = buffer.read<float>(count);
    std::vector<std::vector<float>> all;
    for (int r = 0; r < ranks; ++r) all.push_back(rank_values(seed_, r, count));
    for (std::size_t i = 0; i < count; ++i) {
      double sum = 0;
      float max = -2, min = 2;
      for (int r = 0; r < ranks; ++r) {
        const float v = all[r][i];
        sum += v;
        max = std::max(max, v);
        min = std::min(min, v);
      }
      if (op == ReduceOp::sum) ASSERT_NEAR(got[i], sum, 1e-5) << "element " << i;
      if (op == ReduceOp::max) ASSERT_EQ(got[i], max) << "element " << i;
      if (op == ReduceOp::min) ASSERT_EQ(got[i], min) << "element " << i;
    }
  }
}

TEST_P(GroupTest, AllReduceOfIntegersIsExact) {
  const std::int64_t mine = static_cast<std::int64_t>(seed_ % 1000003) * (group_->rank() + 1) + (std::int64_t{1} << 40);
  DeviceMemory buffer(group_->device(), sizeof mine);
  buffer.upload(&mine, sizeof mine);
  group_->all_reduce(buffer.data(), buffer.data(), 1, DType::i64, ReduceOp::sum);
  std::int64_t expected = 0;
  for (int r = 0; r < group_->size(); ++r) expected += static_cast<std::int64_t>(seed_ % 1000003) * (r + 1) + (std::int64_t{1} << 40);
  EXPECT_EQ(buffer.read<std::int64_t>(1)[0], expected);
}

TEST_P(GroupTest, ReduceScatterGivesEachRankTheSumOfItsBlock) {
  const int ranks = group_->size();
  const std::size_t block = 257 + seed_ % 100;
  DeviceMemory send(group_->device(), block * ranks * sizeof(float));
  DeviceMemory recv(group_->device(), block * sizeof(float));
  const std::vector<float> mine = rank_values(seed_, group_->rank(), block * ranks);
  send.upload(mine.data(), mine.size() * sizeof(float));
  group_->reduce_scatter(send.data(), recv.data(), block, DType::f32, ReduceOp::sum);
  const std::vector<float> got = recv.read<float>(block);
  std::vector<std::vector<float>> all;
  for (int r = 0; r < ranks; ++r) all.push_back(rank_values(seed_, r, block * ranks));
  for (std::size_t i = 0; i < block; ++i) {
    double sum = 0;
    for (int r = 0; r < ranks; ++r) sum += all[r][group_->rank() * block + i];
    ASSERT_NEAR(got[i], sum, 1e-5) << "element " << i;
  }
}

TEST_P(GroupTest, AllGatherOutOfPlaceAndInPlaceCopyEveryBlockBitForBit) {
  const int ranks = group_->size();
  const std::size_t block = 333 + seed_ % 50;
  for (bool in_place : {false, true}) {
    DeviceMemory send(group_->device(), block * sizeof(float));
    DeviceMemory recv(group_->device(), block * ranks * sizeof(float));
    const std::vector<float> mine = rank_values(seed_, group_->rank(), block);
    const void* source = send.data();
    if (in_place) {
      recv.upload(mine.data(), block * sizeof(float), group_->rank() * block * sizeof(float));
      source = recv.as<float>() + group_->rank() * block;
    } else {
      send.upload(mine.data(), block * sizeof(float));
    }
    group_->all_gather(source, recv.data(), block, DType::f32);
    const std::vector<float> got = recv.read<float>(block * ranks);
    for (int r = 0; r < ranks; ++r) {
      const std::vector<float> theirs = rank_values(seed_, r, block);
      ASSERT_EQ(0, std::memcmp(got.data() + r * block, theirs.data(), block * sizeof(float)))
          << "block " << r << (in_place ? " (in place)" : "");
    }
  }
}

TEST_P(GroupTest, AllToAllSendsBlockJToRankJ) {
  const int ranks = group_->size();
  const std::size_t block = 100 + seed_ % 64;
  DeviceMemory send(group_->device(), block * ranks * sizeof(float));
  DeviceMemory recv(group_->device(), block * ranks * sizeof(float));
  const std::vector<float> mine = rank_values(seed_, group_->rank(), block * ranks);
  send.upload(mine.data(), mine.size() * sizeof(float));
  group_->all_to_all(send.data(), recv.data(), block, DType::f32);
  const std::vector<float> got = recv.read<float>(block * ranks);
  for (int r = 0; r < ranks; ++r) {
    const std::vector<float> theirs = rank_values(seed_, r, block * ranks);
    ASSERT_EQ(0, std::memcmp(got.data() + r * block, theirs.data() + group_->rank() * block, block * sizeof(float)))
        << "block from rank " << r;
  }
}

TEST_P(GroupTest, BroadcastCopiesTheRootsBytesToEveryRank) {
  const int root = static_cast<int>(seed_ % group_->size());
  const std::size_t count = 777;
  DeviceMemory buffer(group_->device(), count * sizeof(float));
  const std::vector<float> mine = rank_values(seed_, group_->rank(), count);
  buffer.upload(mine.data(), count * sizeof(float));
  group_->broadcast(buffer.data(), count, DType::f32, root);
  const std::vector<float> roots = rank_values(seed_, root, count);
  EXPECT_EQ(0, std::memcmp(buffer.read<float>(count).data(), roots.data(), count * sizeof(float))) << "root " << root;
}

TEST_P(GroupTest, ObjectsOfAnyLengthTravelWhole) {
  auto object_of = [&](int rank) {
    std::string text(static_cast<std::size_t>((seed_ >> (rank * 3)) % 200) * static_cast<std::size_t>(rank != 1), 'x');
    for (std::size_t i = 0; i < text.size(); ++i) text[i] = static_cast<char>((seed_ + i * (rank + 7)) & 0xff);
    return text;
  };
  const int root = static_cast<int>((seed_ >> 7) % group_->size());
  EXPECT_EQ(group_->broadcast_object(object_of(group_->rank()), root), object_of(root));
  const std::vector<std::string> all = group_->all_gather_object(object_of(group_->rank()));
  ASSERT_EQ(static_cast<int>(all.size()), group_->size());
  for (int r = 0; r < group_->size(); ++r) EXPECT_EQ(all[r], object_of(r)) << "rank " << r;
}

TEST_P(GroupTest, SendAndRecvPassValuesAroundARing) {
  const int ranks = group_->size();
  if (ranks < 2) GTEST_SKIP() << "a ring needs two ranks";
  const int next = (group_->rank() + 1) % ranks, previous = (group_->rank() + ranks - 1) % ranks;
  const std::size_t count = 4096;
  DeviceMemory out(group_->device(), count * sizeof(float));
  DeviceMemory in(group_->device(), count * sizeof(float));
  const std::vector<float> mine = rank_values(seed_, group_->rank(), count);
  out.upload(mine.data(), count * sizeof(float));
  // Even ranks send first, odd ranks receive first: no engine can deadlock on that order.
  if (group_->rank() % 2 == 0) {
    group_->send(out.data(), count, DType::f32, next);
    group_->recv(in.data(), count, DType::f32, previous);
  } else {
    group_->recv(in.data(), count, DType::f32, previous);
    group_->send(out.data(), count, DType::f32, next);
  }
  const std::vector<float> expected = rank_values(seed_, previous, count);
  EXPECT_EQ(0, std::memcmp(in.read<float>(count).data(), expected.data(), count * sizeof(float)));
}

TEST_P(GroupTest, ReleasedGroupRefusesEveryOperationUntilReloaded) {
  DeviceMemory buffer(group_->device(), 64 * sizeof(float) * group_->size());
  void* p = buffer.data();
  group_->release();
  EXPECT_TRUE(group_->released());
  EXPECT_THROW(group_->release(), StateError);
  EXPECT_THROW(group_->all_reduce(p, p, 1, DType::f32, ReduceOp::sum), StateError);
  EXPECT_THROW(group_->reduce_scatter(p, buffer.as<float>() + 64 * group_->size() - 1, 1, DType::f32, ReduceOp::sum),
               StateError);
  EXPECT_THROW(group_->all_gather(buffer.as<float>() + group_->rank(), p, 1, DType::f32), StateError);
  EXPECT_THROW(group_->broadcast(p, 1, DType::f32, 0), StateError);
  EXPECT_THROW(group_->broadcast_object("x", 0), StateError);
  EXPECT_THROW(group_->all_gather_object("x"), StateError);
  EXPECT_THROW(group_->barrier(), StateError);
  EXPECT_THROW(group_->send(p, 1, DType::f32, 0), StateError);
  EXPECT_THROW(group_->recv(p, 1, DType::f32, 0), StateError);
  try {
    group_->barrier();
  } catch (const StateError& e) {
    EXPECT_NE(std::string(e.what()).find("released"), std::string::npos) << e.what();
  }

  group_->reload();
  EXPECT_FALSE(group_->released());
  EXPECT_THROW(group_->reload(), StateError);
  const std::int64_t one = 1;
  buffer.upload(&one, sizeof one);
  group_->all_reduce(p, p, 1, DType::i64, ReduceOp::sum);
  EXPECT_EQ(buffer.read<std::int64_t>(1)[0], group_->size()) << "the reloaded group has the same members";
}

TEST_P(GroupTest, MemoryCheckRunsForColdOperationsOnlyAndTrimsUnderTheThreshold) {
  std::uint64_t free_bytes = 0, probes = 0, trims = 0;
  MemoryCheck check;
  check.free_bytes = [&] {
    ++probes;
    return free_bytes;
  };
  check.trim = [&] { ++trims; };
  check.min_free_bytes = 1000;
  group_->set_memory_check(check);
  DeviceMemory buffer(group_->device(), 16 * sizeof(float) * group_->size());
  float* p = buffer.as<float>();

  free_bytes = 5000;  // plenty: probed, not trimmed
  group_->all_reduce(p, p, 4, DType::f32, ReduceOp::sum);
  group_->broadcast(p, 4, DType::f32, 0);
  EXPECT_EQ(probes, 2u);
  EXPECT_EQ(trims, 0u);

  free_bytes = 10;  // too little, but the hot path never asks
  group_->reduce_scatter(p, p + 8 * group_->size(), 4, DType::f32, ReduceOp::sum);
  group_->all_gather(p + 8 * group_->size() + 4 * group_->rank(), p + 8 * group_->size(), 4, DType::f32);
  group_->all_to_all(p, p + 8 * group_->size(), 4, DType::f32);
  group_->barrier();
  group_->broadcast_object("x", 0);
  group_->all_gather_object("x");
  EXPECT_EQ(probes, 2u);
  EXPECT_EQ(trims, 0u);

  group_->all_reduce(p, p, 4, DType::f32, ReduceOp::sum);  // cold and short of memory: trims
  EXPECT_EQ(probes, 3u);
  EXPECT_EQ(trims, 1u);

  check.skipped = OpSet{Op::all_reduce};  // the skip list is data: swap cold and hot
  group_->set_memory_check(check);
  group_->all_reduce(p, p, 4, DType::f32, ReduceOp::sum);
  group_->all_gather(p + 8 * group_->size() + 4 * group_->rank(), p + 8 * group_->size(), 4, DType::f32);
  EXPECT_EQ(probes, 4u);
  EXPECT_EQ(trims, 2u);
  EXPECT_EQ(group_->memory_check_stats().probes, 4u);
  EXPECT_EQ(group_->memory_check_stats().trims, 2u);
  synchronize();
}

TEST_P(GroupTest, BadArgumentsAreRejectedBeforeAnyCommunication) {
  DeviceMemory buffer(group_->device(), 64 * sizeof(float) * group_->size());
  float* p = buffer.as<float>();
  EXPECT_THROW(group_->broadcast(p, 1, DType::f32, group_->size()), InvalidArgument);
  EXPECT_THROW(group_->send(p, 1, DType::f32, -1), InvalidArgument);
  EXPECT_THROW(group_->reduce_scatter(p, p, 4, DType::f32, ReduceOp::sum), InvalidArgument);
  EXPECT_THROW(group_->all_to_all(p, p + 1, 4, DType::f32), InvalidArgument);
  if (group_->size() > 1) {
    EXPECT_THROW(group_->all_gather(p + 1, p, 4, DType::f32), InvalidArgument);
  }
}

TEST(MpiGroup, RefusesToReduceBfloat16) {
  std::string skip;
  auto group = testing_support::make_group("mpi", MPI_COMM_WORLD, &skip);
  std::uint16_t value = 0;
  EXPECT_THROW(group->all_reduce(&value, &value, 1, DType::bf16, ReduceOp::sum), InvalidArgument);
}

TEST(NcclGroup, ReleaseReturnsTheCommunicatorsDeviceMemory) {
  std::string skip;
  auto group = testing_support::make_group("nccl", MPI_COMM_WORLD, &skip);
  if (!group) GTEST_SKIP() << skip;
  DeviceMemory buffer(group->device(), 1 << 20);
  // NCCL connects lazily: the first collective allocates the channels' buffers.
  group->all_reduce(buffer.data(), buffer.data(), (1 << 20) / sizeof(float), DType::f32, ReduceOp::sum);
  group->barrier();
  const std::uint64_t before = cuda_free_bytes();
  group->release();
  const std::uint64_t after = cuda_free_bytes();
  EXPECT_GT(after, before) << "free device memory did not grow when the communicator was destroyed";
  group->reload();
  group->barrier();
}

TEST(OpNames, ParseInvertsNameAndRejectsUnknownNames) {
  for (std::size_t i = 0; i < kOpCount; ++i) EXPECT_EQ(parse_op(op_name(static_cast<Op>(i))), static_cast<Op>(i));
  EXPECT_THROW(parse_op("allreduce"), InvalidArgument);
  const OpSet hot = hot_path_ops();
  EXPECT_FALSE(hot.contains(Op::all_reduce));
  EXPECT_FALSE(hot.contains(Op::broadcast));
  for (Op op : {Op::reduce_scatter, Op::all_gather, Op::all_to_all, Op::send, Op::recv, Op::barrier,
                Op::object_broadcast}) {
    EXPECT_TRUE(hot.contains(op)) << op_name(op);
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, GroupTest, ::testing::Values("mpi", "nccl"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace deltatrain::comm
