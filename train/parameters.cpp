#include "deltatrain/train/parameters.h"

#include "deltatrain/core/error.h"
#include "deltatrain/core/device_memory.h"

namespace deltatrain::train {

DType param_dtype(Device device) { return device.type == DeviceType::cpu ? DType::f32 : DType::bf16; }

std::vector<optim::ParamSpec> param_specs(const model::Config& config, Device device) {
  std::vector<optim::ParamSpec> specs;
  for (const model::ParamInfo& info : model::param_infos(config)) specs.push_back({info.name, info.shape, param_dtype(device)});
  return specs;
}

void start_from(optim::DistributedAdamW& optimizer, const model::ParamStore& host) {
  for (const model::ParamInfo& info : host.infos()) {
    const TensorView from = host.param(info.name), to = optimizer.param(info.name);
    if (from.dtype != to.dtype || from.nbytes() != to.nbytes()) {
      throw InvalidArgument("host", "parameter " + info.name + " does not match the optimizer's (dtype or shape)");
    }
    copy_bytes(to.data, from.data, from.nbytes(), to.device, nullptr);
  }
  synchronize(optimizer.group().device(), nullptr);
  optimizer.initialize_from_params();
}

std::unique_ptr<model::ParamStore> host_params(const optim::DistributedAdamW& optimizer, const model::Config& config) {
  auto host = std::make_unique<model::ParamStore>(config, param_dtype(optimizer.group().device()));
  for (const model::ParamInfo& info : host->infos()) {
    const TensorView from = optimizer.param(info.name), to = host->param(info.name);
    copy_bytes(to.data, from.data, to.nbytes(), from.device, nullptr);
  }
  synchronize(optimizer.group().device(), nullptr);
  return host;
}

}  // namespace deltatrain::train
