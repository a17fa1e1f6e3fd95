#include "deltatrain/model/inference.h"

#include <string>

#include "deltatrain/core/error.h"
#include "arena.h"

namespace deltatrain::model {
namespace {

// The gdn operator's state dtype: float64 in a float64 model, float32 otherwise.
DType state_dtype(const ModelOptions& options) { return options.dtype == DType::f64 ? DType::f64 : DType::f32; }

// Visits each tensor of each layer's state with its dtype and shape: the one description that both the
// allocation and the byte count read.
template <class Visit>
void for_each_tensor(const Config& c, const ModelOptions& options, std::int64_t slots, std::int64_t max_length,
                     const Visit& visit) {
  for (int l = 0; l < c.num_hidden_layers(); ++l) {
    if (c.layer_types[l] == LayerKind::linear_attention) {
      visit(l, &LayerState::gdn_state, state_dtype(options),
            {slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim});
      visit(l, &LayerState::conv_state, options.dtype, {slots, c.linear_conv_kernel_dim - 1, c.linear_conv_dim()});
    } else {
      const std::int64_t kv = std::int64_t{c.num_key_value_heads} * c.head_dim;
      visit(l, &LayerState::k_cache, options.dtype, {slots, max_length, kv});
      visit(l, &LayerState::v_cache, options.dtype, {slots, max_length, kv});
    }
  }
}

}  // namespace

InferenceState::InferenceState(const Config& config, const ModelOptions& options, std::int64_t slots,
                               std::int64_t max_length)
    : slots_(slots), max_length_(max_length) {
  validate(config);
  if (slots < 1) throw InvalidArgument("slots", "must be at least 1, got " + std::to_string(slots));
  if (max_length < 1 || max_length > INT32_MAX)
    throw InvalidArgument("max_length", "must be in [1, 2^31 - 1], got " + std::to_string(max_length));
  memory_ = std::make_unique<Arena>(options.device, options.memory);
  layers_.resize(config.num_hidden_layers());
  lengths_.assign(slots, 0);
  for_each_tensor(config, options, slots, max_length,
                  [&](int l, TensorView LayerState::*member, DType dtype, std::initializer_list<std::int64_t> shape) {
                    layers_[l].*member = memory_->allocate(dtype, shape);
                  });
}

InferenceState::~InferenceState() = default;

std::int64_t InferenceState::bytes(const Config& config, const ModelOptions& options, std::int64_t slots,
                                   std::int64_t max_length) {
  std::int64_t total = 0;
  for_each_tensor(config, options, slots, max_length,
                  [&](int, TensorView LayerState::*, DType dtype, std::initializer_list<std::int64_t> shape) {
                    std::int64_t n = static_cast<std::int64_t>(dtype_size(dtype));
                    for (const std::int64_t extent : shape) n *= extent;
                    total += n;
                  });
  return total;
}

}  // namespace deltatrain::model
