#include "deltatrain/model/params.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <random>

#include "deltatrain/core/bfloat16.h"
#include "deltatrain/core/error.h"

namespace deltatrain::model {

namespace {

// FNV-1a, 64 bit: a stable hash of a parameter's name (std::hash differs between standard libraries).
std::uint64_t fnv1a(std::string_view text) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

// SplitMix64's finaliser: spreads (seed, name) over the generator's seed space.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform and normal draws written out here, so that the values are the same with every standard library
// (std::uniform_real_distribution and std::normal_distribution are not specified bit for bit).
class Stream {
 public:
  Stream(std::uint64_t seed, std::string_view name) : engine_(mix(seed ^ mix(fnv1a(name)))) {}
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {  // Box-Muller, both values of each pair used
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = static_cast<double>((engine_() >> 11) + 1) * 0x1.0p-53;  // (0, 1]: log is finite
    const double u2 = uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0;
  bool has_spare_ = false;
};

bool ends_with(std::string_view text, std::string_view tail) {
  return text.size() >= tail.size() && text.substr(text.size() - tail.size()) == tail;
}

template <class Fill>
void write_values(void* data, DType dtype, std::int64_t n, Fill&& value) {
  switch (dtype) {
    case DType::f32:
      for (std::int64_t i = 0; i < n; ++i) static_cast<float*>(data)[i] = static_cast<float>(value());
      break;
    case DType::f64:
      for (std::int64_t i = 0; i < n; ++i) static_cast<double*>(data)[i] = value();
      break;
    case DType::bf16:
      for (std::int64_t i = 0; i < n; ++i) {
        static_cast<std::uint16_t*>(data)[i] = float_to_bf16(static_cast<float>(value()));
      }
      break;
    default:
      throw InvalidArgument("dtype", std::string("must be f32, f64 or bf16; got ") + dtype_name(dtype));
  }
}

TensorView host_view(void* data, DType dtype, const std::vector<std::int64_t>& shape) {
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.ndim = static_cast<int>(shape.size());
  std::int64_t stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    view.shape[d] = shape[d];
    view.strides[d] = stride;
    stride *= shape[d];
  }
  return view;
}

}  // namespace

const char* param_kind_name(ParamKind kind) {
  switch (kind) {
    case ParamKind::embedding:
      return "embedding";
    case ParamKind::lm_head:
      return "lm_head";
    case ParamKind::norm:
      return "norm";
    case ParamKind::gated_norm:
      return "gated_norm";
    case ParamKind::gdn_linear:
      return "gdn_linear";
    case ParamKind::gdn_conv:
      return "gdn_conv";
    case ParamKind::gdn_decay:
      return "gdn_decay";
    case ParamKind::attention:
      return "attention";
    case ParamKind::mlp:
      return "mlp";
  }
  return "unknown";
}

std::int64_t ParamInfo::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

std::vector<ParamInfo> param_infos(const Config& c) {
  validate(c);
  const std::int64_t hidden = c.hidden_size;
  const std::int64_t nv = c.linear_num_value_heads;
  const std::int64_t q_dim = std::int64_t{c.num_attention_heads} * c.head_dim;
  const std::int64_t kv_dim = std::int64_t{c.num_key_value_heads} * c.head_dim;
  std::vector<ParamInfo> infos;
  auto add = [&](std::string name, std::vector<std::int64_t> shape, ParamKind kind) {
    infos.push_back({std::move(name), std::move(shape), kind});
  };
  add("model.embed_tokens.weight", {c.vocab_size, hidden}, ParamKind::embedding);
  for (int i = 0; i < c.num_hidden_layers(); ++i) {
    const std::string layer = "model.layers." + std::to_string(i) + ".";
    add(layer + "input_layernorm.weight", {hidden}, ParamKind::norm);
    if (c.layer_types[i] == LayerKind::linear_attention) {
      const std::string p = layer + "linear_attn.";
      add(p + "in_proj_qkv.weight", {c.linear_conv_dim(), hidden}, ParamKind::gdn_linear);
      add(p + "in_proj_z.weight", {c.linear_value_dim(), hidden}, ParamKind::gdn_linear);
      add(p + "in_proj_b.weight", {nv, hidden}, ParamKind::gdn_linear);
      add(p + "in_proj_a.weight", {nv, hidden}, ParamKind::gdn_linear);
      add(p + "conv1d.weight", {c.linear_conv_dim(), 1, c.linear_conv_kernel_dim}, ParamKind::gdn_conv);
      add(p + "A_log", {nv}, ParamKind::gdn_decay);
      add(p + "dt_bias", {nv}, ParamKind::gdn_decay);
      add(p + "norm.weight", {c.linear_value_head_dim}, ParamKind::gated_norm);
      add(p + "out_proj.weight", {hidden, c.linear_value_dim()}, ParamKind::gdn_linear);
    } else {
      const std::string p = layer + "self_attn.";
      add(p + "q_proj.weight", {2 * q_dim, hidden}, ParamKind::attention);  // query and gate
      add(p + "k_proj.weight", {kv_dim, hidden}, ParamKind::attention);
      add(p + "v_proj.weight", {kv_dim, hidden}, ParamKind::attention);
      add(p + "o_proj.weight", {hidden, q_dim}, ParamKind::attention);
      add(p + "q_norm.weight", {c.head_dim}, ParamKind::norm);
      add(p + "k_norm.weight", {c.head_dim}, ParamKind::norm);
    }
    add(layer + "post_attention_layernorm.weight", {hidden}, ParamKind::norm);
    add(layer + "mlp.gate_proj.weight", {c.intermediate_size, hidden}, ParamKind::mlp);
    add(layer + "mlp.up_proj.weight", {c.intermediate_size, hidden}, ParamKind::mlp);
    add(layer + "mlp.down_proj.weight", {hidden, c.intermediate_size}, ParamKind::mlp);
  }
  add("model.norm.weight", {hidden}, ParamKind::norm);
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, hidden}, ParamKind::lm_head);
  return infos;
}

std::int64_t param_count(const Config& config) {
  std::int64_t total = 0;
  for (const ParamInfo& info : param_infos(config)) total += info.numel();
  return total;
}

void init_param(const ParamInfo& info, double initializer_range, std::uint64_t seed, DType dtype, void* data) {
  if (dtype != DType::f32 && dtype != DType::f64 && dtype != DType::bf16) {
    throw InvalidArgument("dtype", std::string("must be f32, f64 or bf16; got ") + dtype_name(dtype));
  }
  if (!std::isfinite(initializer_range) || initializer_range < 0) {
    throw InvalidArgument("initializer_range", "must be a finite number >= 0");
  }
  const std::int64_t n = info.numel();
  if (data == nullptr && n > 0) throw InvalidArgument("data", "is null for parameter '" + info.name + "'");
  Stream stream(seed, info.name);
  switch (info.kind) {
    case ParamKind::norm:
      return write_values(data, dtype, n, [] { return 0.0; });
    case ParamKind::gated_norm:
      return write_values(data, dtype, n, [] { return 1.0; });
    case ParamKind::gdn_decay:
      if (ends_with(info.name, "A_log")) {
        return write_values(data, dtype, n, [&] { return std::log(0.01 + (16.0 - 0.01) * stream.uniform()); });
      }
      return write_values(data, dtype, n, [] { return 1.0; });  // dt_bias
    default:
      return write_values(data, dtype, n, [&] { return initializer_range * stream.normal(); });
  }
}

ParamStore::ParamStore(const Config& config, DType dtype) : infos_(param_infos(config)), dtype_(dtype) {
  if (dtype != DType::f32 && dtype != DType::f64 && dtype != DType::bf16) {
    throw InvalidArgument("dtype", std::string("must be f32, f64 or bf16; got ") + dtype_name(dtype));
  }
  for (std::size_t i = 0; i < infos_.size(); ++i) {
    offsets_.push_back(numel_);
    index_.emplace(infos_[i].name, i);
    numel_ += infos_[i].numel();
  }
  params_.assign(static_cast<std::size_t>(numel_) * dtype_size(dtype_), std::byte{0});
  grads_.assign(static_cast<std::size_t>(numel_) * dtype_size(grad_dtype()), std::byte{0});
}

DType ParamStore::grad_dtype() const { return dtype_ == DType::bf16 ? DType::f32 : dtype_; }

TensorView ParamStore::view(std::vector<std::byte>& storage, DType dtype, std::string_view name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    throw InvalidArgument("name", "'" + std::string(name) + "' is not a parameter of this model");
  }
  return host_view(storage.data() + offsets_[it->second] * static_cast<std::int64_t>(dtype_size(dtype)), dtype,
                   infos_[it->second].shape);
}

TensorView ParamStore::param(std::string_view name) const { return view(params_, dtype_, name); }
TensorView ParamStore::grad(std::string_view name) const { return view(grads_, grad_dtype(), name); }

TensorLookup ParamStore::params() const {
  return [this](std::string_view name) { return param(name); };
}
TensorLookup ParamStore::grads() const {
  return [this](std::string_view name) { return grad(name); };
}

void ParamStore::init(double initializer_range, std::uint64_t seed) {
  if (!std::isfinite(initializer_range) || initializer_range < 0) {  // before the threads: nothing throws in them
    throw InvalidArgument("initializer_range", "must be a finite number >= 0");
  }
  const std::size_t element = dtype_size(dtype_);
  const auto count = static_cast<std::int64_t>(infos_.size());
  // Each parameter draws from its own stream, so the order (and the thread) does not change the values.
#pragma omp parallel for schedule(dynamic)
  for (std::int64_t i = 0; i < count; ++i) {
    init_param(infos_[i], initializer_range, seed, dtype_, params_.data() + offsets_[i] * element);
  }
}

void ParamStore::zero_grads() { std::fill(grads_.begin(), grads_.end(), std::byte{0}); }

TensorView ParamStore::param_buffer() const { return host_view(params_.data(), dtype_, {numel_}); }
TensorView ParamStore::grad_buffer() const { return host_view(grads_.data(), grad_dtype(), {numel_}); }

}  // namespace deltatrain::model
