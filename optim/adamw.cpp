#include "deltatrain/optim/adamw.h"

#include <cmath>

#include "deltatrain/core/device_memory.h"
#include "deltatrain/core/error.h"
#include "memory.h"
#include "shard_math.h"

namespace deltatrain::optim {

namespace {

void check_range(const char* field, double value, bool ok, const std::string& rule) {
  if (!ok) throw InvalidArgument(field, rule + "; got " + std::to_string(value));
}

TensorView flat_view(void* data, DType dtype, std::int64_t numel, Device device) {
  return TensorView::contiguous(data, dtype, {numel}, device);
}

TensorView param_view(void* base, DType dtype, const ParamSlot& slot, Device device) {
  TensorView view;
  view.data = static_cast<char*>(base) + slot.offset * dtype_size(dtype);
  view.dtype = dtype;
  view.device = device;
  view.ndim = static_cast<int>(slot.shape.size());
  std::int64_t stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    view.shape[d] = slot.shape[d];
    view.strides[d] = stride;
    stride *= slot.shape[d];
  }
  return view;
}

}  // namespace

void check_config(const AdamWConfig& c) {
  check_range("lr", c.lr, c.lr >= 0 && std::isfinite(c.lr), "must be finite and >= 0");
  check_range("beta1", c.beta1, c.beta1 >= 0 && c.beta1 < 1, "must be in [0, 1)");
  check_range("beta2", c.beta2, c.beta2 >= 0 && c.beta2 < 1, "must be in [0, 1)");
  check_range("eps", c.eps, c.eps > 0 && std::isfinite(c.eps), "must be finite and > 0");
  check_range("weight_decay", c.weight_decay, c.weight_decay >= 0 && std::isfinite(c.weight_decay),
              "must be finite and >= 0");
  check_range("max_grad_norm", c.max_grad_norm, c.max_grad_norm >= 0 && std::isfinite(c.max_grad_norm),
              "must be finite and >= 0 (0 turns clipping off)");
}

const char* state_tensor_name(StateTensor tensor) {
  switch (tensor) {
    case StateTensor::main_param:
      return "fp32_param";
    case StateTensor::exp_avg:
      return "exp_avg";
    case StateTensor::exp_avg_sq:
      return "exp_avg_sq";
  }
  return "?";
}

// Per buffer: model parameters and gradients (full), state and summed gradients (this rank's shards).
struct DistributedAdamW::Buffers {
  std::vector<DeviceBuffer> params, grads, summed_grads;
  std::vector<DeviceBuffer> state[3];
  // [scratch of sum_squares | one sum of squares per buffer | their total, all-reduced]
  DeviceBuffer sums;
  bool stepped = false;

  DeviceBuffer& of(StateTensor tensor, int buffer) { return state[static_cast<int>(tensor)][buffer]; }
  double* scratch() const { return sums.as<double>(); }
  double* per_buffer() const { return sums.as<double>() + kSumSquaresScratch; }
  double* total(int buffers) const { return per_buffer() + buffers; }
};

DistributedAdamW::DistributedAdamW(comm::Group& group, const std::vector<ParamSpec>& params,
                                   const AdamWConfig& config, const LayoutOptions& layout_options, void* stream,
                                   const OptimizerMemory& memory)
    : group_(group),
      layout_(make_param_layout(params, group.size(), layout_options)),
      config_(config),
      stream_(stream),
      buffers_(std::make_unique<Buffers>()) {
  check_config(config);
  const Device device = group.device();
  for (const BufferLayout& buffer : layout_.buffers) {
    const auto local = static_cast<std::size_t>(layout_.local_numel(buffer));
    buffers_->params.emplace_back(device, buffer.numel * dtype_size(buffer.dtype), memory.params);
    buffers_->grads.emplace_back(device, buffer.numel * sizeof(float), memory.grads);
    buffers_->summed_grads.emplace_back(device, local * sizeof(float), memory.grads);
    for (auto& tensor : buffers_->state) tensor.emplace_back(device, local * sizeof(float), memory.state);
  }
  buffers_->sums =
      DeviceBuffer(device, (kSumSquaresScratch + layout_.buffers.size() + 1) * sizeof(double), memory.state);
}

DistributedAdamW::~DistributedAdamW() = default;

void DistributedAdamW::set_config(const AdamWConfig& config) {
  check_config(config);
  config_ = config;
}

const ParamSlot& DistributedAdamW::slot(std::string_view name, int* buffer) const {
  for (std::size_t b = 0; b < layout_.buffers.size(); ++b) {
    for (const ParamSlot& s : layout_.buffers[b].params) {
      if (s.name == name) {
        *buffer = static_cast<int>(b);
        return s;
      }
    }
  }
  throw InvalidArgument("name", "no parameter is called '" + std::string(name) + "'");
}

TensorView DistributedAdamW::param(std::string_view name) const {
  int b = 0;
  const ParamSlot& s = slot(name, &b);
  return param_view(buffers_->params[b].data(), layout_.buffers[b].dtype, s, group_.device());
}

TensorView DistributedAdamW::grad(std::string_view name) const {
  int b = 0;
  const ParamSlot& s = slot(name, &b);
  return param_view(buffers_->grads[b].data(), DType::f32, s, group_.device());
}

TensorView DistributedAdamW::param_buffer(int buffer) const {
  const BufferLayout& layout = layout_.buffers.at(buffer);
  return flat_view(buffers_->params[buffer].data(), layout.dtype, layout.numel, group_.device());
}

TensorView DistributedAdamW::grad_buffer(int buffer) const {
  return flat_view(buffers_->grads.at(buffer).data(), DType::f32, layout_.buffers[buffer].numel, group_.device());
}

TensorView DistributedAdamW::local_state(StateTensor tensor, int buffer) const {
  const BufferLayout& layout = layout_.buffers.at(buffer);
  return flat_view(buffers_->of(tensor, buffer).data(), DType::f32, layout_.local_numel(layout), group_.device());
}

void DistributedAdamW::for_each_shard(const std::function<void(int, const Bucket&)>& visit) const {
  for (std::size_t b = 0; b < layout_.buffers.size(); ++b) {
    for (const Bucket& bucket : layout_.buffers[b].buckets) visit(static_cast<int>(b), bucket);
  }
}

void DistributedAdamW::zero_grad() {
  for (const DeviceBuffer& grads : buffers_->grads) zero_bytes(grads.data(), grads.bytes(), grads.device(), stream_);
}

void DistributedAdamW::initialize_from_params() {
  const Device device = group_.device();
  const int rank = group_.rank();
  for_each_shard([&](int b, const Bucket& bucket) {
    const DType dtype = layout_.buffers[b].dtype;
    const void* model = buffers_->params[b].as<char>() + layout_.shard_begin(bucket, rank) * dtype_size(dtype);
    float* main = buffers_->of(StateTensor::main_param, b).as<float>() + layout_.local_offset(bucket);
    cast_model_to_main(device, model, dtype, main, layout_.shard_numel(bucket), stream_);
  });
  for (int b = 0; b < static_cast<int>(layout_.buffers.size()); ++b) {
    for (StateTensor moment : {StateTensor::exp_avg, StateTensor::exp_avg_sq}) {
      const DeviceBuffer& state = buffers_->of(moment, b);
      zero_bytes(state.data(), state.bytes(), device, stream_);
    }
  }
  step_ = 0;
}

void DistributedAdamW::step() {
  const Device device = group_.device();
  const int rank = group_.rank();
  const int buffers = static_cast<int>(layout_.buffers.size());
  Buffers& buf = *buffers_;

  for_each_shard([&](int b, const Bucket& bucket) {
    group_.reduce_scatter(buf.grads[b].as<float>() + bucket.offset,
                          buf.summed_grads[b].as<float>() + layout_.local_offset(bucket), layout_.shard_numel(bucket),
                          DType::f32, comm::ReduceOp::sum, stream_);
  });
  for (int b = 0; b < buffers; ++b) {
    sum_squares(device, buf.summed_grads[b].as<float>(), layout_.local_numel(layout_.buffers[b]), buf.per_buffer() + b,
                buf.scratch(), stream_);
  }
  sum_in_order(device, buf.per_buffer(), buffers, buf.total(buffers), stream_);
  group_.all_reduce(buf.total(buffers), buf.total(buffers), 1, DType::f64, comm::ReduceOp::sum, stream_);

  ++step_;
  AdamWCoefficients c;
  c.beta1 = static_cast<float>(config_.beta1);
  c.beta2 = static_cast<float>(config_.beta2);
  c.one_minus_beta1 = static_cast<float>(1 - config_.beta1);
  c.one_minus_beta2 = static_cast<float>(1 - config_.beta2);
  c.decay = static_cast<float>(1 - config_.lr * config_.weight_decay);
  c.step_size = static_cast<float>(config_.lr / (1 - std::pow(config_.beta1, static_cast<double>(step_))));
  c.inv_sqrt_bc2 = static_cast<float>(1 / std::sqrt(1 - std::pow(config_.beta2, static_cast<double>(step_))));
  c.eps = static_cast<float>(config_.eps);
  c.max_grad_norm = config_.max_grad_norm;
  c.inv_dp = 1.0 / group_.size();

  for_each_shard([&](int b, const Bucket& bucket) {
    const DType dtype = layout_.buffers[b].dtype;
    const std::int64_t local = layout_.local_offset(bucket);
    ShardUpdate shard;
    shard.main = buf.of(StateTensor::main_param, b).as<float>() + local;
    shard.exp_avg = buf.of(StateTensor::exp_avg, b).as<float>() + local;
    shard.exp_avg_sq = buf.of(StateTensor::exp_avg_sq, b).as<float>() + local;
    shard.grad = buf.summed_grads[b].as<float>() + local;
    shard.model = buf.params[b].as<char>() + layout_.shard_begin(bucket, rank) * dtype_size(dtype);
    shard.model_dtype = dtype;
    shard.numel = layout_.shard_numel(bucket);
    adamw_update(device, shard, buf.total(buffers), c, stream_);
    char* params = buf.params[b].as<char>();
    group_.all_gather(shard.model, params + bucket.offset * dtype_size(dtype), shard.numel, dtype, stream_);
  });
  buf.stepped = true;
}

double DistributedAdamW::grad_norm() const {
  if (!buffers_->stepped) throw StateError("optim: grad_norm() before the first step()");
  double sum_squares = 0;
  const int buffers = static_cast<int>(layout_.buffers.size());
  copy_bytes(&sum_squares, buffers_->total(buffers), sizeof sum_squares, group_.device(), stream_);
  synchronize(group_.device(), stream_);
  return std::sqrt(sum_squares) / group_.size();
}

void DistributedAdamW::restore_step(std::int64_t step) {
  if (step < 0) throw InvalidArgument("step", "must be >= 0; got " + std::to_string(step));
  step_ = step;
}

void DistributedAdamW::sync_params_from_main() {
  const int rank = group_.rank();
  for_each_shard([&](int b, const Bucket& bucket) {
    const DType dtype = layout_.buffers[b].dtype;
    char* params = buffers_->params[b].as<char>();
    void* model = params + layout_.shard_begin(bucket, rank) * dtype_size(dtype);
    const float* main = buffers_->of(StateTensor::main_param, b).as<float>() + layout_.local_offset(bucket);
    cast_main_to_model(group_.device(), main, model, dtype, layout_.shard_numel(bucket), stream_);
    group_.all_gather(model, params + bucket.offset * dtype_size(dtype), layout_.shard_numel(bucket), dtype, stream_);
  });
}

std::vector<float> DistributedAdamW::gather_state(StateTensor tensor) const {
  std::vector<float> gathered;
  for (std::size_t b = 0; b < layout_.buffers.size(); ++b) {
    const BufferLayout& buffer = layout_.buffers[b];
    const DeviceBuffer full(group_.device(), buffer.numel * sizeof(float));
    for (const Bucket& bucket : buffer.buckets) {
      group_.all_gather(buffers_->of(tensor, static_cast<int>(b)).as<float>() + layout_.local_offset(bucket),
                        full.as<float>() + bucket.offset, layout_.shard_numel(bucket), DType::f32, stream_);
    }
    std::vector<float> host(buffer.numel);
    copy_bytes(host.data(), full.data(), full.bytes(), group_.device(), stream_);
    synchronize(group_.device(), stream_);
    for (const ParamSlot& s : buffer.params) {
      gathered.insert(gathered.end(), host.begin() + s.offset, host.begin() + s.offset + s.numel);
    }
  }
  return gathered;
}

}  // namespace deltatrain::optim
