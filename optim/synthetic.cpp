#include "deltatrain/optim/synthetic.h"

#include <cmath>
#include <cstring>
#include <random>

#include "deltatrain/core/device_memory.h"
#include "deltatrain/core/error.h"
#include "deltatrain/optim/checkpoint.h"
#include "memory.h"
#include "shard_math.h"

namespace deltatrain::optim {

namespace {

constexpr const char* kNames[] = {"layer1.weight", "layer1.bias", "layer2.weight", "layer2.bias"};

std::vector<float> read_param(const DistributedAdamW& optimizer, const char* name) {
  const TensorView view = optimizer.param(name);
  std::vector<char> bytes(view.nbytes());
  copy_bytes(bytes.data(), view.data, bytes.size(), view.device, optimizer.stream());
  synchronize(view.device, optimizer.stream());
  std::vector<float> values(view.numel());
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (view.dtype == DType::bf16) {
      Bf16 b;
      std::memcpy(&b, bytes.data() + i * sizeof b, sizeof b);
      values[i] = to_float(b);
    } else {
      std::memcpy(&values[i], bytes.data() + i * sizeof(float), sizeof(float));
    }
  }
  return values;
}

void write_param(DistributedAdamW& optimizer, const char* name, const std::vector<float>& values) {
  const TensorView view = optimizer.param(name);
  std::vector<char> bytes(view.nbytes());
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (view.dtype == DType::bf16) {
      const Bf16 b = to_bf16(values[i]);
      std::memcpy(bytes.data() + i * sizeof b, &b, sizeof b);
    } else {
      std::memcpy(bytes.data() + i * sizeof(float), &values[i], sizeof(float));
    }
  }
  copy_bytes(view.data, bytes.data(), bytes.size(), view.device, optimizer.stream());
  synchronize(view.device, optimizer.stream());  // bytes is a local
}

}  // namespace

struct SyntheticRegression::Weights {
  std::vector<float> tensors[4];  // in kNames order: w1 [hidden, inputs], b1, w2 [outputs, hidden], b2
};

SyntheticRegression::SyntheticRegression(const SyntheticConfig& config) : config_(config) {
  if (config.inputs < 1 || config.hidden < 1 || config.outputs < 1 || config.batch < 1) {
    throw InvalidArgument("config", "inputs, hidden, outputs and batch must be >= 1");
  }
  std::mt19937_64 rng(config.seed);
  std::normal_distribution<float> normal;
  inputs_.resize(static_cast<std::size_t>(config.batch) * config.inputs);
  for (float& x : inputs_) x = normal(rng);
  // Targets from a fixed random "teacher": a smooth function the MLP can fit.
  std::vector<float> teacher(static_cast<std::size_t>(config.outputs) * config.inputs);
  for (float& a : teacher) a = normal(rng) / std::sqrt(static_cast<float>(config.inputs));
  targets_.resize(static_cast<std::size_t>(config.batch) * config.outputs);
  for (int n = 0; n < config.batch; ++n) {
    for (int o = 0; o < config.outputs; ++o) {
      double z = 0;
      for (int i = 0; i < config.inputs; ++i) z += teacher[o * config.inputs + i] * inputs_[n * config.inputs + i];
      targets_[n * config.outputs + o] = static_cast<float>(std::sin(2 * z));
    }
  }
}

std::vector<ParamSpec> SyntheticRegression::params() const {
  const std::int64_t in = config_.inputs, hid = config_.hidden, out = config_.outputs;
  return {{kNames[0], {hid, in}, config_.dtype},
          {kNames[1], {hid}, config_.dtype},
          {kNames[2], {out, hid}, config_.dtype},
          {kNames[3], {out}, config_.dtype}};
}

void SyntheticRegression::initialize(DistributedAdamW& optimizer) const {
  std::mt19937_64 rng(config_.seed + 1);
  std::normal_distribution<float> normal;
  const std::vector<ParamSpec> specs = params();
  // Weights scaled by 1/sqrt(fan-in), biases small.
  const float scale[] = {1 / std::sqrt(static_cast<float>(config_.inputs)), 0.1f,
                         1 / std::sqrt(static_cast<float>(config_.hidden)), 0.1f};
  for (std::size_t p = 0; p < specs.size(); ++p) {
    std::int64_t numel = 1;
    for (std::int64_t d : specs[p].shape) numel *= d;
    std::vector<float> values(numel);
    for (float& v : values) v = normal(rng) * scale[p];
    write_param(optimizer, kNames[p], values);
  }
  optimizer.initialize_from_params();
}

SyntheticRegression::Weights SyntheticRegression::read_weights(const DistributedAdamW& optimizer) const {
  Weights w;
  for (int p = 0; p < 4; ++p) w.tensors[p] = read_param(optimizer, kNames[p]);
  return w;
}

std::pair<int, int> SyntheticRegression::slice(const comm::Group& group) const {
  if (config_.batch % group.size() != 0) {
    throw InvalidArgument("ranks", "the synthetic batch of " + std::to_string(config_.batch) +
                                       " samples must divide evenly across ranks; got " + std::to_string(group.size()));
  }
  const int per_rank = config_.batch / group.size();
  return {group.rank() * per_rank, (group.rank() + 1) * per_rank};
}

// Loss 0.5 * |y - t|^2, averaged over samples [first, last); `grad`, if given, receives its gradient.
double SyntheticRegression::evaluate(const Weights& w, int first, int last, Weights* grad) const {
  const int in = config_.inputs, hid = config_.hidden, out = config_.outputs;
  const auto& [w1, b1, w2, b2] = w.tensors;
  std::vector<double> g[4];
  for (int p = 0; p < 4; ++p) g[p].assign(w.tensors[p].size(), 0.0);
  const double inv_n = 1.0 / (last - first);
  double loss = 0;
  std::vector<double> h(hid), dh(hid), dy(out);
  for (int n = first; n < last; ++n) {
    const float* x = &inputs_[static_cast<std::size_t>(n) * in];
    for (int j = 0; j < hid; ++j) {
      double a = b1[j];
      for (int i = 0; i < in; ++i) a += static_cast<double>(w1[j * in + i]) * x[i];
      h[j] = std::tanh(a);
    }
    for (int o = 0; o < out; ++o) {
      double y = b2[o];
      for (int j = 0; j < hid; ++j) y += static_cast<double>(w2[o * hid + j]) * h[j];
      const double error = y - targets_[static_cast<std::size_t>(n) * out + o];
      loss += 0.5 * error * error * inv_n;
      dy[o] = error * inv_n;
    }
    for (int j = 0; j < hid; ++j) {
      double back = 0;
      for (int o = 0; o < out; ++o) back += static_cast<double>(w2[o * hid + j]) * dy[o];
      dh[j] = back * (1 - h[j] * h[j]);
    }
    for (int o = 0; o < out; ++o) {
      for (int j = 0; j < hid; ++j) g[2][o * hid + j] += dy[o] * h[j];
      g[3][o] += dy[o];
    }
    for (int j = 0; j < hid; ++j) {
      for (int i = 0; i < in; ++i) g[0][j * in + i] += dh[j] * x[i];
      g[1][j] += dh[j];
    }
  }
  if (grad != nullptr) {
    for (int p = 0; p < 4; ++p) grad->tensors[p].assign(g[p].begin(), g[p].end());
  }
  return loss;
}

double SyntheticRegression::forward_backward(DistributedAdamW& optimizer) const {
  const auto [first, last] = slice(optimizer.group());
  Weights grad;
  const double loss = evaluate(read_weights(optimizer), first, last, &grad);
  for (int p = 0; p < 4; ++p) {
    const TensorView view = optimizer.grad(kNames[p]);
    copy_bytes(view.data, grad.tensors[p].data(), view.nbytes(), view.device, optimizer.stream());
    synchronize(view.device, optimizer.stream());  // grad is a local
  }
  return loss;
}

double SyntheticRegression::loss(const DistributedAdamW& optimizer) const {
  const auto [first, last] = slice(optimizer.group());
  const double local = evaluate(read_weights(optimizer), first, last, nullptr);
  // Host values travel as objects, which every engine moves; summed in rank order.
  std::string bytes(sizeof local, '\0');
  std::memcpy(bytes.data(), &local, sizeof local);
  double total = 0;
  for (const std::string& each : optimizer.group().all_gather_object(bytes)) {
    double value;
    std::memcpy(&value, each.data(), sizeof value);
    total += value;
  }
  return total / optimizer.group().size();
}

DemoResult run_demo(comm::Group& group, const DemoOptions& options, void* stream) {
  if (options.steps < 0) throw InvalidArgument("steps", "must be >= 0; got " + std::to_string(options.steps));
  if (options.save_at >= 0 && options.checkpoint_root.empty()) {
    throw InvalidArgument("ckpt", "a directory is needed to save at step " + std::to_string(options.save_at));
  }
  const SyntheticRegression problem(options.problem);
  DistributedAdamW optimizer(group, problem.params(), options.adamw, options.layout, stream);
  if (options.resume_from.empty()) {
    problem.initialize(optimizer);
  } else {
    load_checkpoint(optimizer, options.resume_from);
  }
  const std::int64_t first = optimizer.step_count() + 1, last = optimizer.step_count() + options.steps;
  if (options.save_at >= 0 && (options.save_at < first || options.save_at > last)) {
    throw InvalidArgument("save-at", "must be a step this run reaches, " + std::to_string(first) + " to " +
                                         std::to_string(last) + "; got " + std::to_string(options.save_at));
  }
  DemoResult result;
  for (std::int64_t i = 0; i < options.steps; ++i) {
    optimizer.zero_grad();
    problem.forward_backward(optimizer);
    optimizer.step();
    if (optimizer.step_count() == options.save_at) result.saved = save_checkpoint(optimizer, options.checkpoint_root);
  }
  result.step = optimizer.step_count();
  result.loss = problem.loss(optimizer);
  result.digest = digest_state(optimizer);
  return result;
}

}  // namespace deltatrain::optim
