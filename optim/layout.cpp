#include "deltatrain/optim/layout.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "deltatrain/core/error.h"

namespace deltatrain::optim {

namespace {

std::int64_t round_up(std::int64_t value, std::int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

std::int64_t checked_numel(const ParamSpec& param) {
  std::int64_t numel = 1;
  for (std::int64_t dim : param.shape) {
    if (dim <= 0) {
      throw InvalidArgument("params", "every dimension must be positive; '" + param.name + "' has shape " +
                                          shape_text(param.shape));
    }
    numel *= dim;
  }
  return numel;
}

void check_inputs(const std::vector<ParamSpec>& params, int dp_size, const LayoutOptions& options) {
  if (dp_size < 1) throw InvalidArgument("dp_size", "must be at least 1; got " + std::to_string(dp_size));
  if (options.alignment < 1) {
    throw InvalidArgument("alignment", "must be at least 1 element; got " + std::to_string(options.alignment));
  }
  if (options.bucket_numel < 1) {
    throw InvalidArgument("bucket_numel", "must be at least 1 element; got " + std::to_string(options.bucket_numel));
  }
  if (params.empty()) throw InvalidArgument("params", "must hold at least one parameter; got none");
  std::set<std::string> names;
  for (const ParamSpec& param : params) {
    if (param.name.empty()) throw InvalidArgument("params", "every parameter needs a name; got an empty one");
    if (!names.insert(param.name).second) {
      throw InvalidArgument("params", "names must be unique; '" + param.name + "' appears twice");
    }
    if (param.dtype != DType::f32 && param.dtype != DType::bf16) {
      throw InvalidArgument("params", std::string("model parameters are float32 or bfloat16; '") + param.name +
                                          "' is " + dtype_name(param.dtype));
    }
  }
}

// Packs one dtype's parameters into buckets.
BufferLayout pack_buffer(DType dtype, const std::vector<ParamSpec>& params, int dp_size, const LayoutOptions& options) {
  const std::int64_t bucket_multiple = std::lcm(static_cast<std::int64_t>(dp_size), options.alignment);
  BufferLayout buffer{dtype, 0, {}, {}};
  std::int64_t cursor = 0;
  Bucket open{0, 0};
  auto close_bucket = [&] {
    open.numel = round_up(cursor - open.offset, bucket_multiple);
    buffer.buckets.push_back(open);
    cursor = open.offset + open.numel;
    open = Bucket{cursor, 0};
  };
  for (const ParamSpec& param : params) {
    if (param.dtype != dtype) continue;
    const std::int64_t numel = checked_numel(param);
    const std::int64_t offset = round_up(cursor, options.alignment);
    buffer.params.push_back({param.name, param.shape, offset, numel, static_cast<int>(buffer.buckets.size())});
    cursor = offset + numel;
    if (cursor - open.offset >= options.bucket_numel) close_bucket();
  }
  if (cursor > open.offset) close_bucket();
  buffer.numel = cursor;
  return buffer;
}

struct Range {
  std::int64_t begin = 0, end = 0;
  bool empty() const { return end <= begin; }
};

Range intersect(Range a, Range b) { return {std::max(a.begin, b.begin), std::min(a.end, b.end)}; }

void check_same_params(const ParamLayout& saved, const ParamLayout& target) {
  if (saved.buffers.size() != target.buffers.size()) {
    throw InvalidArgument("layout", "the checkpoint has " + std::to_string(saved.buffers.size()) +
                                        " parameter buffers (dtypes) but the model has " +
                                        std::to_string(target.buffers.size()));
  }
  for (std::size_t b = 0; b < saved.buffers.size(); ++b) {
    const BufferLayout& s = saved.buffers[b];
    const BufferLayout& t = target.buffers[b];
    if (s.dtype != t.dtype) {
      throw InvalidArgument("layout", "buffer " + std::to_string(b) + " holds " + dtype_name(s.dtype) +
                                          " parameters in the checkpoint but " + dtype_name(t.dtype) + " in the model");
    }
    if (s.params.size() != t.params.size()) {
      throw InvalidArgument("layout", "buffer " + std::to_string(b) + " holds " + std::to_string(s.params.size()) +
                                          " parameters in the checkpoint but " + std::to_string(t.params.size()) +
                                          " in the model");
    }
    for (std::size_t p = 0; p < s.params.size(); ++p) {
      if (s.params[p].name != t.params[p].name || s.params[p].shape != t.params[p].shape) {
        throw InvalidArgument("layout", "parameter " + std::to_string(p) + " of buffer " + std::to_string(b) +
                                            " is '" + s.params[p].name + "' " + shape_text(s.params[p].shape) +
                                            " in the checkpoint but '" + t.params[p].name + "' " +
                                            shape_text(t.params[p].shape) + " in the model");
      }
    }
  }
}

}  // namespace

ParamLayout make_param_layout(const std::vector<ParamSpec>& params, int dp_size, const LayoutOptions& options) {
  check_inputs(params, dp_size, options);
  ParamLayout layout{dp_size, options, {}};
  std::vector<DType> dtypes;
  for (const ParamSpec& param : params) {
    if (std::find(dtypes.begin(), dtypes.end(), param.dtype) == dtypes.end()) dtypes.push_back(param.dtype);
  }
  for (DType dtype : dtypes) layout.buffers.push_back(pack_buffer(dtype, params, dp_size, options));
  return layout;
}

std::vector<ParamSpec> param_specs(const ParamLayout& layout) {
  std::vector<ParamSpec> specs;
  for (const BufferLayout& buffer : layout.buffers) {
    for (const ParamSlot& slot : buffer.params) specs.push_back({slot.name, slot.shape, buffer.dtype});
  }
  return specs;
}

std::vector<ShardCopy> plan_reshard(const ParamLayout& saved, const ParamLayout& target, int target_rank) {
  if (target_rank < 0 || target_rank >= target.dp_size) {
    throw InvalidArgument("target_rank", "must be in [0, " + std::to_string(target.dp_size) + "); got " +
                                             std::to_string(target_rank));
  }
  check_same_params(saved, target);
  std::vector<ShardCopy> copies;
  for (std::size_t b = 0; b < target.buffers.size(); ++b) {
    const BufferLayout& target_buffer = target.buffers[b];
    const BufferLayout& saved_buffer = saved.buffers[b];
    for (std::size_t p = 0; p < target_buffer.params.size(); ++p) {
      const ParamSlot& t = target_buffer.params[p];
      const ParamSlot& s = saved_buffer.params[p];
      const Bucket& t_bucket = target_buffer.buckets[t.bucket];
      const std::int64_t t_shard_begin = target.shard_begin(t_bucket, target_rank);
      // The part of this parameter that the new rank owns, as element indices of the parameter.
      const Range owned = intersect({t.offset, t.offset + t.numel}, {t_shard_begin, t_shard_begin + target.shard_numel(t_bucket)});
      if (owned.empty()) continue;
      const Range elements{owned.begin - t.offset, owned.end - t.offset};
      const Bucket& s_bucket = saved_buffer.buckets[s.bucket];
      for (int rank = 0; rank < saved.dp_size; ++rank) {
        const std::int64_t s_shard_begin = saved.shard_begin(s_bucket, rank);
        const Range piece = intersect({s.offset + elements.begin, s.offset + elements.end},
                                      {s_shard_begin, s_shard_begin + saved.shard_numel(s_bucket)});
        if (piece.empty()) continue;
        copies.push_back({static_cast<int>(b), rank, s.bucket, piece.begin - s_shard_begin, t.bucket,
                          piece.begin - s.offset + t.offset - t_shard_begin, piece.end - piece.begin});
      }
    }
  }
  return copies;
}

}  // namespace deltatrain::optim
