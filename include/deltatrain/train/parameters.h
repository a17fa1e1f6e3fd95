// The model's parameters as the optimizer holds them, shared by the trainer and the RL loop: their dtype on
// each device (the one place it is chosen), the optimizer's specs, and copies between the optimizer's buffers
// (on any device) and a host ParamStore (initial weights in, checkpoints out).
#pragma once

#include <memory>
#include <vector>

#include "deltatrain/core/tensor.h"
#include "deltatrain/model/config.h"
#include "deltatrain/model/params.h"
#include "deltatrain/optim/adamw.h"

namespace deltatrain::train {

// float32 on the CPU, bfloat16 on a GPU; the optimizer keeps float32 main weights and moments either way.
DType param_dtype(Device device);

std::vector<optim::ParamSpec> param_specs(const model::Config& config, Device device);

// Copies `host` (a store of the optimizer's config and param_dtype) into the optimizer's parameter buffers
// and makes them its starting point (initialize_from_params). Collective.
void start_from(optim::DistributedAdamW& optimizer, const model::ParamStore& host);

// The optimizer's parameters as they are now, on the host in their dtype (waits for the copies).
std::unique_ptr<model::ParamStore> host_params(const optim::DistributedAdamW& optimizer, const model::Config& config);

}  // namespace deltatrain::train
