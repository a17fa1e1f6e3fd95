// ParamLayout alone: the packing rules on random parameter lists, and plan_reshard against an
// element-by-element mapping computed independently (by scanning every element of every shard).
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>

#include "deltatrain/core/error.h"
#include "deltatrain/optim/layout.h"

namespace deltatrain::optim {
namespace {

std::uint64_t fresh_seed() { return (static_cast<std::uint64_t>(std::random_device{}()) << 32) | std::random_device{}(); }

std::vector<ParamSpec> random_params(std::mt19937_64& rng) {
  std::vector<ParamSpec> params;
  const int count = 1 + static_cast<int>(rng() % 12);
  for (int p = 0; p < count; ++p) {
    std::vector<std::int64_t> shape;
    const int dims = 1 + static_cast<int>(rng() % 3);
    for (int d = 0; d < dims; ++d) shape.push_back(1 + static_cast<std::int64_t>(rng() % 20));
    params.push_back({"param" + std::to_string(p), shape, rng() % 3 == 0 ? DType::bf16 : DType::f32});
  }
  return params;
}

LayoutOptions random_options(std::mt19937_64& rng) {
  return {1 + static_cast<std::int64_t>(rng() % 80), 1 + static_cast<std::int64_t>(rng() % 3000)};
}

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}

TEST(ParamLayout, PacksEveryParameterAlignedInsideOneBucketOfPaddedDivisibleBuckets) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<ParamSpec> params = random_params(rng);
    const LayoutOptions options = random_options(rng);
    const int dp = 1 + static_cast<int>(rng() % 8);
    const ParamLayout layout = make_param_layout(params, dp, options);
    const std::int64_t multiple = std::lcm(static_cast<std::int64_t>(dp), options.alignment);

    std::map<std::string, const ParamSlot*> placed;
    std::vector<DType> dtypes_seen;
    for (const BufferLayout& buffer : layout.buffers) {
      dtypes_seen.push_back(buffer.dtype);
      std::int64_t cursor = 0;
      for (std::size_t k = 0; k < buffer.buckets.size(); ++k) {
        const Bucket& bucket = buffer.buckets[k];
        ASSERT_EQ(bucket.offset, cursor) << "buckets tile the buffer";
        ASSERT_GT(bucket.numel, 0);
        ASSERT_EQ(bucket.numel % multiple, 0) << "padded to lcm(dp, alignment)";
        ASSERT_EQ(layout.shard_numel(bucket) * dp, bucket.numel);
        cursor += bucket.numel;
      }
      ASSERT_EQ(cursor, buffer.numel);
      std::int64_t previous_end = 0;
      for (const ParamSlot& slot : buffer.params) {
        const Bucket& bucket = buffer.buckets.at(slot.bucket);
        EXPECT_EQ(slot.offset % options.alignment, 0) << slot.name;
        EXPECT_GE(slot.offset, previous_end) << slot.name << " overlaps its predecessor";
        EXPECT_GE(slot.offset, bucket.offset) << slot.name;
        EXPECT_LE(slot.offset + slot.numel, bucket.offset + bucket.numel) << slot.name;
        // A bucket closes as soon as it reaches bucket_numel: no parameter starts in a full bucket.
        EXPECT_LT(slot.offset - bucket.offset, std::max<std::int64_t>(options.bucket_numel, 1) + options.alignment)
            << slot.name;
        previous_end = slot.offset + slot.numel;
        placed[slot.name] = &slot;
      }
      // The padding of the last bucket is the least that makes it divisible.
      const Bucket& last = buffer.buckets.back();
      EXPECT_LT(last.offset + last.numel - previous_end, multiple);
    }
    ASSERT_EQ(placed.size(), params.size());
    for (const ParamSpec& spec : params) {
      ASSERT_TRUE(placed.count(spec.name));
      EXPECT_EQ(placed[spec.name]->shape, spec.shape);
      EXPECT_EQ(placed[spec.name]->numel, numel_of(spec.shape));
    }
    // One buffer per dtype, in order of first appearance; param_specs gives them back buffer by buffer.
    std::vector<DType> first_seen;
    for (const ParamSpec& spec : params) {
      if (std::find(first_seen.begin(), first_seen.end(), spec.dtype) == first_seen.end()) first_seen.push_back(spec.dtype);
    }
    EXPECT_EQ(dtypes_seen, first_seen);
    EXPECT_EQ(param_specs(layout).size(), params.size());
  }
}

// Where each element of each parameter lives: (rank, bucket, offset in that rank's shard).
struct Home {
  int rank, bucket;
  std::int64_t offset;
  bool operator==(const Home&) const = default;
};

std::map<std::pair<std::string, std::int64_t>, Home> homes(const ParamLayout& layout, int buffer) {
  std::map<std::pair<std::string, std::int64_t>, Home> result;
  const BufferLayout& b = layout.buffers[buffer];
  for (std::size_t k = 0; k < b.buckets.size(); ++k) {
    for (int rank = 0; rank < layout.dp_size; ++rank) {
      for (std::int64_t i = 0; i < layout.shard_numel(b.buckets[k]); ++i) {
        const std::int64_t flat = layout.shard_begin(b.buckets[k], rank) + i;
        for (const ParamSlot& p : b.params) {
          if (flat >= p.offset && flat < p.offset + p.numel) {
            result[{p.name, flat - p.offset}] = {rank, static_cast<int>(k), i};
          }
        }
      }
    }
  }
  return result;
}

TEST(PlanReshard, CopiesEveryOwnedElementOnceFromWhereItWasSaved) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 60; ++trial) {
    const std::vector<ParamSpec> params = random_params(rng);
    const ParamLayout saved = make_param_layout(params, 1 + static_cast<int>(rng() % 6), random_options(rng));
    const ParamLayout target = make_param_layout(params, 1 + static_cast<int>(rng() % 6), random_options(rng));
    for (std::size_t b = 0; b < target.buffers.size(); ++b) {
      const auto saved_homes = homes(saved, static_cast<int>(b));
      const auto target_homes = homes(target, static_cast<int>(b));
      for (int rank = 0; rank < target.dp_size; ++rank) {
        // Expand the plan's runs element by element: (target bucket, target offset) -> saved home.
        std::map<std::pair<int, std::int64_t>, Home> planned;
        for (const ShardCopy& copy : plan_reshard(saved, target, rank)) {
          if (copy.buffer != static_cast<int>(b)) continue;
          ASSERT_GT(copy.numel, 0);
          for (std::int64_t i = 0; i < copy.numel; ++i) {
            const bool fresh = planned.insert({{copy.target_bucket, copy.target_offset + i},
                                               {copy.source_rank, copy.source_bucket, copy.source_offset + i}})
                                   .second;
            ASSERT_TRUE(fresh) << "an element is copied twice";
          }
        }
        std::size_t owned = 0;
        for (const auto& [element, home] : target_homes) {
          if (home.rank != rank) continue;
          ++owned;
          const auto it = planned.find({home.bucket, home.offset});
          ASSERT_NE(it, planned.end()) << element.first << "[" << element.second << "] is not copied";
          EXPECT_EQ(it->second, saved_homes.at(element)) << element.first << "[" << element.second << "]";
        }
        EXPECT_EQ(planned.size(), owned) << "the plan copies only parameter elements";
      }
    }
  }
}

TEST(PlanReshard, RefusesLayoutsOfDifferentParameters) {
  const std::vector<ParamSpec> params{{"a", {4, 4}, DType::f32}, {"b", {3}, DType::bf16}};
  const ParamLayout saved = make_param_layout(params, 2);
  std::vector<ParamSpec> reshaped = params;
  reshaped[0].shape = {4, 5};
  std::vector<ParamSpec> renamed = params;
  renamed[1].name = "c";
  std::vector<ParamSpec> retyped = params;
  retyped[1].dtype = DType::f32;
  for (const auto& other : {reshaped, renamed, retyped}) {
    EXPECT_THROW(plan_reshard(saved, make_param_layout(other, 2), 0), InvalidArgument);
  }
  EXPECT_THROW(plan_reshard(saved, saved, 2), InvalidArgument);
}

TEST(ParamLayout, RejectsBadInputNamingTheArgument) {
  const std::vector<ParamSpec> good{{"w", {2, 3}, DType::f32}};
  auto argument_of = [](auto&& call) {
    try {
      call();
    } catch (const InvalidArgument& e) {
      return e.argument();
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(argument_of([&] { make_param_layout(good, 0); }), "dp_size");
  EXPECT_EQ(argument_of([&] { make_param_layout(good, 2, {0, 10}); }), "alignment");
  EXPECT_EQ(argument_of([&] { make_param_layout(good, 2, {64, 0}); }), "bucket_numel");
  EXPECT_EQ(argument_of([&] { make_param_layout({}, 2); }), "params");
  EXPECT_EQ(argument_of([&] { make_param_layout({{"w", {2, 0}, DType::f32}}, 2); }), "params");
  EXPECT_EQ(argument_of([&] { make_param_layout({{"w", {2}, DType::f32}, {"w", {3}, DType::f32}}, 2); }), "params");
  EXPECT_EQ(argument_of([&] { make_param_layout({{"", {2}, DType::f32}}, 2); }), "params");
  EXPECT_EQ(argument_of([&] { make_param_layout({{"w", {2}, DType::i32}}, 2); }), "params");
}

}  // namespace
}  // namespace deltatrain::optim
