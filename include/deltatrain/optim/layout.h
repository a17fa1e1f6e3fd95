// ParamLayout: where every parameter lives in the flat buffers, and which rank owns what.
// Pure arithmetic on plain structs: no memory, no communication. The same structs are written to a
// checkpoint's metadata.json, and resharding is range arithmetic on two of them.
//
// Parameters are grouped into one flat buffer per dtype (in order of first appearance). Inside a
// buffer each parameter starts at a multiple of `alignment` elements; parameters are packed into
// buckets in order, and a bucket closes once it holds at least `bucket_numel` elements. Each bucket's
// end is padded to a multiple of lcm(dp_size, alignment), so it divides evenly across the
// data-parallel ranks and the next bucket starts aligned. Rank r owns shard r of every bucket.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "deltatrain/core/tensor.h"

namespace deltatrain::optim {

struct ParamSpec {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::f32;  // of the model parameter: f32 or bf16
};

struct LayoutOptions {
  std::int64_t alignment = 64;             // elements (Megatron's choice)
  std::int64_t bucket_numel = 40'000'000;  // Megatron's default bucket size, in elements
};

struct ParamSlot {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;  // first element in the buffer
  std::int64_t numel = 0;
  int bucket = 0;
};

struct Bucket {
  std::int64_t offset = 0;  // first element in the buffer
  std::int64_t numel = 0;   // padded: a multiple of the data-parallel size
};

struct BufferLayout {
  DType dtype = DType::f32;
  std::int64_t numel = 0;  // padded total; the sum of the buckets
  std::vector<ParamSlot> params;
  std::vector<Bucket> buckets;
};

struct ParamLayout {
  int dp_size = 1;
  LayoutOptions options;
  std::vector<BufferLayout> buffers;

  // Elements of one bucket a rank owns.
  std::int64_t shard_numel(const Bucket& bucket) const { return bucket.numel / dp_size; }
  // Where a bucket's shard starts in a rank's local state (the shards of one buffer, concatenated).
  std::int64_t local_offset(const Bucket& bucket) const { return bucket.offset / dp_size; }
  // A rank's local state elements for one buffer.
  std::int64_t local_numel(const BufferLayout& buffer) const { return buffer.numel / dp_size; }
  // Where rank `rank`'s shard of `bucket` starts in the buffer.
  std::int64_t shard_begin(const Bucket& bucket, int rank) const { return bucket.offset + rank * shard_numel(bucket); }
};

// InvalidArgument for an empty list, a duplicate or empty name, a non-positive dimension, a dtype
// other than f32/bf16, dp_size < 1, or options < 1.
ParamLayout make_param_layout(const std::vector<ParamSpec>& params, int dp_size, const LayoutOptions& options = {});

// The parameters a layout was made from, in order.
std::vector<ParamSpec> param_specs(const ParamLayout& layout);

// One contiguous run of elements to copy from a saved rank's shard into a new rank's shard.
struct ShardCopy {
  int buffer = 0;
  int source_rank = 0;
  int source_bucket = 0;
  std::int64_t source_offset = 0;  // inside source_rank's shard of source_bucket
  int target_bucket = 0;
  std::int64_t target_offset = 0;  // inside the new rank's shard of target_bucket
  std::int64_t numel = 0;
};

// The copies that fill `target_rank`'s shards of `target` from the shards of `saved`: parameter
// elements are matched by parameter and index, so bucket sizes, padding and dp sizes may differ.
// Elements outside every parameter (alignment gaps, padding) are not covered: they stay zero.
// InvalidArgument when the two layouts do not hold the same parameters (names, shapes, dtypes, order).
std::vector<ShardCopy> plan_reshard(const ParamLayout& saved, const ParamLayout& target, int target_rank);

}  // namespace deltatrain::optim
