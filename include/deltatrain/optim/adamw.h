// DistributedAdamW: ZeRO-1 AdamW over a communicator group.
//
// The model parameters and their float32 gradients live in flat buffers laid out by ParamLayout,
// on the group's device (host memory for MPI groups, the GPU for NCCL groups). Each rank keeps
// float32 main parameters and Adam moments for its shard of every bucket only.
//
// A step: reduce-scatter the gradients (summed, then averaged over ranks), clip by the global norm,
// AdamW on the local shard, write the shard back into the model parameters (float32 or bfloat16),
// all-gather the parameters. Adam's `step` is one integer for the whole optimizer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "deltatrain/comm/group.h"
#include "deltatrain/core/allocator.h"
#include "deltatrain/core/tensor.h"
#include "deltatrain/optim/layout.h"

namespace deltatrain::optim {

struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  double max_grad_norm = 1.0;  // 0 turns clipping off
};

// InvalidArgument naming the field when a value is out of range.
void check_config(const AdamWConfig& config);

// The three float32 tensors a rank holds per buffer, and their names in checkpoints (Megatron's).
enum class StateTensor { main_param, exp_avg, exp_avg_sq };
inline constexpr StateTensor kStateTensors[] = {StateTensor::main_param, StateTensor::exp_avg, StateTensor::exp_avg_sq};
const char* state_tensor_name(StateTensor tensor);  // "fp32_param", "exp_avg", "exp_avg_sq"

// Where the optimizer's buffers live, by role (null: plain device memory). The RL loop gives each role its
// own memory-saver tag, so that the rollout phase can park the gradients and the state and keep the weights.
struct OptimizerMemory {
  Allocator* params = nullptr;  // the model parameters (full)
  Allocator* grads = nullptr;   // their gradients (full) and this rank's summed shard
  Allocator* state = nullptr;   // main parameters, moments and the norm scratch (this rank's shards)
};

class DistributedAdamW {
 public:
  // `stream` (a cudaStream_t) carries every GPU operation; ignored for CPU groups. The group must
  // outlive the optimizer; it may be released and reloaded between steps.
  DistributedAdamW(comm::Group& group, const std::vector<ParamSpec>& params, const AdamWConfig& config,
                   const LayoutOptions& layout_options = {}, void* stream = nullptr,
                   const OptimizerMemory& memory = {});
  ~DistributedAdamW();
  DistributedAdamW(const DistributedAdamW&) = delete;
  DistributedAdamW& operator=(const DistributedAdamW&) = delete;

  const ParamLayout& layout() const { return layout_; }
  comm::Group& group() const { return group_; }
  void* stream() const { return stream_; }
  const AdamWConfig& config() const { return config_; }
  void set_config(const AdamWConfig& config);
  std::int64_t step_count() const { return step_; }

  // Views into the flat buffers, on the group's device. InvalidArgument for an unknown name.
  TensorView param(std::string_view name) const;
  TensorView grad(std::string_view name) const;  // float32
  TensorView param_buffer(int buffer) const;
  TensorView grad_buffer(int buffer) const;

  void zero_grad();
  // Takes the model parameters (identical on every rank) as the starting point: copies this rank's
  // shard into the float32 main parameters, zeroes the moments and the step.
  void initialize_from_params();
  void step();
  // The global norm of the last step's averaged gradient, before clipping. Waits for the device.
  double grad_norm() const;

  // This rank's float32 shard state for one buffer (its buckets' shards, concatenated), on its device.
  TensorView local_state(StateTensor tensor, int buffer) const;
  // For checkpoint loading: the step, then parameters rebuilt from the main parameters (cast to the
  // model dtype on each shard, all-gathered). Collective.
  void restore_step(std::int64_t step);
  void sync_params_from_main();

  // A state tensor gathered from every rank, in parameter order without gaps or padding, on the
  // host: the same on every rank and for every dp size. Collective.
  std::vector<float> gather_state(StateTensor tensor) const;

 private:
  struct Buffers;
  void for_each_shard(const std::function<void(int buffer, const Bucket& bucket)>& visit) const;
  const ParamSlot& slot(std::string_view name, int* buffer) const;

  comm::Group& group_;
  ParamLayout layout_;
  AdamWConfig config_;
  void* stream_;
  std::int64_t step_ = 0;
  std::unique_ptr<Buffers> buffers_;
};

}  // namespace deltatrain::optim
