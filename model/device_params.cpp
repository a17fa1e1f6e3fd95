#include <string_view>

#include "arena.h"
#include "deltatrain/model/params.h"

namespace deltatrain::model {

DeviceParams::DeviceParams(const ParamStore& host, Device device) : host_(host), device_(device) {
  params_ = device_allocate(host.param_buffer().nbytes(), device, "model parameters");
  try {
    grads_ = device_allocate(host.grad_buffer().nbytes(), device, "model gradients");
  } catch (...) {
    device_free(params_, device);
    throw;
  }
}

DeviceParams::~DeviceParams() {
  device_free(params_, device_);
  device_free(grads_, device_);
}

// The host view's place in its buffer, at the same place in the device copy.
TensorView DeviceParams::translate(const TensorView& host_view, const TensorView& host_buffer, void* device_base) const {
  TensorView v = host_view;
  v.data = static_cast<std::byte*>(device_base) +
           (static_cast<const std::byte*>(host_view.data) - static_cast<const std::byte*>(host_buffer.data));
  v.device = device_;
  return v;
}

TensorLookup DeviceParams::params() const {
  return [this](std::string_view name) { return translate(host_.param(name), host_.param_buffer(), params_); };
}

TensorLookup DeviceParams::grads() const {
  return [this](std::string_view name) { return translate(host_.grad(name), host_.grad_buffer(), grads_); };
}

void DeviceParams::upload(const ParamStore& host, void* stream) {
  const TensorView buffer = host.param_buffer();
  copy_bytes(params_, buffer.data, buffer.nbytes(), device_, stream);
  synchronize(device_, stream);  // the host store may change once this returns
}

void DeviceParams::download_grads(const ParamStore& host, void* stream) const {
  const TensorView buffer = host.grad_buffer();
  copy_bytes(buffer.data, grads_, buffer.nbytes(), device_, stream);
  synchronize(device_, stream);
}

void DeviceParams::zero_grads(void* stream) {
  zero_bytes(grads_, host_.grad_buffer().nbytes(), device_, stream);
}

}  // namespace deltatrain::model
