#include "device_tensors.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "deltatrain/gdn/registry.h"

namespace deltatrain::gdn::testing {

std::string cuda_backend_unusable() {
  if (!cuda_info().usable()) return "no usable GPU: " + cuda_info().unavailable_reason;
  for (const auto& backend : Registry::instance().backends()) {
    if (backend->name() != "cuda") continue;
    const Availability verdict = backend->available();
    return verdict.ok ? "" : "the cuda backend is unavailable: " + verdict.reason;
  }
  return "no cuda backend is registered";
}

DeviceTensor::DeviceTensor(const HostTensor& host, bool poisoned) : shape_of_(host) {
  const std::size_t bytes = host.bytes().size();
  cuda_check(cudaMalloc(&data_, bytes == 0 ? 1 : bytes), "cudaMalloc");
  if (poisoned) {
    poison();
  } else {
    cuda_check(cudaMemcpy(data_, host.bytes().data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
}

DeviceTensor::DeviceTensor(DeviceTensor&& other) noexcept
    : shape_of_(std::move(other.shape_of_)), data_(std::exchange(other.data_, nullptr)) {}

DeviceTensor& DeviceTensor::operator=(DeviceTensor&& other) noexcept {
  std::swap(shape_of_, other.shape_of_);
  std::swap(data_, other.data_);
  return *this;
}

DeviceTensor::~DeviceTensor() {
  if (data_ != nullptr) cudaFree(data_);
}

TensorView DeviceTensor::view() const {
  TensorView view = shape_of_.view();
  view.data = data_;
  view.device = Device{DeviceType::cuda, 0};
  return view;
}

HostTensor DeviceTensor::download() const {
  HostTensor host(shape_of_.dtype(), shape_of_.shape());
  cuda_check(cudaMemcpy(host.view().data, data_, host.bytes().size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return host;
}

void DeviceTensor::poison() { cuda_check(cudaMemset(data_, 0xff, shape_of_.bytes().size()), "cudaMemset"); }

DeviceSample::DeviceSample(const Sample& s, const DeviceCallOptions& options) : sample_(s) {
  const Layout& l = s.layout;
  q_ = DeviceTensor(HostTensor(s.q, s.io, l.qk_shape()));
  k_ = DeviceTensor(HostTensor(s.k, s.io, l.qk_shape()));
  v_ = DeviceTensor(HostTensor(s.v, s.io, l.v_shape()));
  g_ = DeviceTensor(HostTensor(s.g, s.gate, l.gate_shape()));
  beta_ = DeviceTensor(HostTensor(s.beta, s.gate, l.gate_shape()));
  inputs_ = Inputs{q_.view(), k_.view(), v_.view(), g_.view(), beta_.view(), std::nullopt, std::nullopt, std::nullopt};
  if (!s.h0.empty()) {
    h0_ = DeviceTensor(HostTensor(s.h0, s.state(), l.state_shape()));
    inputs_.initial_state = h0_.view();
  }
  if (!l.cu_seqlens.empty()) {
    cu_seqlens_host_ = HostTensor(std::vector<double>(l.cu_seqlens.begin(), l.cu_seqlens.end()), s.cu_dtype,
                                  {static_cast<std::int64_t>(l.cu_seqlens.size())});
    if (options.cu_seqlens_on_device) {
      cu_seqlens_ = DeviceTensor(cu_seqlens_host_);
      inputs_.cu_seqlens = cu_seqlens_.view();
      inputs_.cu_seqlens_host = cu_seqlens_host_.view();
    } else {
      inputs_.cu_seqlens = cu_seqlens_host_.view();
    }
  }
}

Options DeviceSample::options(const DeviceCallOptions& call) const {
  Options options;
  options.backend = "cuda";
  options.use_qk_l2norm_in_kernel = sample_.l2norm;
  options.stream = call.stream;
  return options;
}

namespace {

// The forward on an uploaded sample, writing `saved` where given.
ForwardResult forward_on(const DeviceSample& device, const Sample& s, const DeviceCallOptions& options, bool recurrent,
                         const DeviceTensor* saved) {
  const DeviceTensor o(HostTensor(s.io, s.layout.v_shape()), true);
  DeviceTensor ht;
  ForwardOutputs outputs{o.view(), std::nullopt};
  if (options.final_state) {
    ht = DeviceTensor(HostTensor(s.state(), s.layout.state_shape()), true);
    outputs.final_state = ht.view();
  }
  if (saved != nullptr) outputs.saved = saved->view();
  if (recurrent) {
    recurrent_forward(device.inputs(), outputs, device.options(options));
  } else {
    chunk_forward(device.inputs(), outputs, device.options(options));
  }
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the forward");
  ForwardResult result{o.download(), {}};
  if (options.final_state) result.ht = ht.download();
  return result;
}

// The backward on an uploaded sample, reading `saved` where given.
BackwardResult backward_on(const DeviceSample& device, const Sample& s, const Cotangents& c,
                           const DeviceCallOptions& options, const DeviceTensor* saved) {
  const Layout& l = s.layout;
  const DeviceTensor d_o(HostTensor(c.d_o, s.io, l.v_shape()));
  DeviceTensor dht;
  BackwardInputs grads_in{d_o.view(), std::nullopt};
  if (!c.dht.empty()) {
    dht = DeviceTensor(HostTensor(c.dht, s.state(), l.state_shape()));
    grads_in.dht = dht.view();
  }
  if (saved != nullptr) grads_in.saved = saved->view();
  const DeviceTensor dq(HostTensor(s.io, l.qk_shape()), true), dk(HostTensor(s.io, l.qk_shape()), true);
  const DeviceTensor dv(HostTensor(s.io, l.v_shape()), true);
  const DeviceTensor dg(HostTensor(s.gate, l.gate_shape()), true), dbeta(HostTensor(s.gate, l.gate_shape()), true);
  DeviceTensor dh0;
  Gradients grads_out{dq.view(), dk.view(), dv.view(), dg.view(), dbeta.view(), std::nullopt};
  if (!s.h0.empty()) {
    dh0 = DeviceTensor(HostTensor(s.state(), l.state_shape()), true);
    grads_out.dh0 = dh0.view();
  }
  chunk_backward(device.inputs(), grads_in, grads_out, device.options(options));
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the backward");
  BackwardResult r{dq.download(), dk.download(), dv.download(), dg.download(), dbeta.download(), {}};
  if (!s.h0.empty()) r.dh0 = dh0.download();
  return r;
}

}  // namespace

ForwardResult cuda_forward(const Sample& s, const DeviceCallOptions& options, bool recurrent) {
  return forward_on(DeviceSample(s, options), s, options, recurrent, nullptr);
}

SavedRun cuda_forward_backward_saved(const Sample& s, const Cotangents& c, const DeviceCallOptions& options) {
  const DeviceSample device(s, options);
  const std::size_t bytes = forward_saved_bytes(device.inputs(), device.options(options));
  const DeviceTensor saved(HostTensor(DType::u8, {static_cast<std::int64_t>(bytes)}), true);
  ForwardResult forward = forward_on(device, s, options, false, &saved);
  return {std::move(forward), backward_on(device, s, c, options, &saved), bytes};
}

ForwardResult cuda_recurrent_on_pool(const Sample& s, const StatePool& pool, const DeviceCallOptions& options) {
  Sample without_h0 = s;
  without_h0.h0.clear();
  const DeviceSample device(without_h0, options);
  const bool in_place = options.final_state && pool.final_before.empty();
  const DeviceTensor o(HostTensor(s.io, s.layout.v_shape()), true);
  const DeviceTensor initial(HostTensor(pool.initial, s.state(), pool.shape(s.layout)));
  DeviceTensor separate_final;
  if (options.final_state && !in_place) {
    separate_final = DeviceTensor(HostTensor(pool.final_before, s.state(), pool.shape(s.layout)));
  }
  const HostTensor indices_host(std::vector<double>(pool.indices.begin(), pool.indices.end()), DType::i32,
                                {static_cast<std::int64_t>(pool.indices.size())});
  const DeviceTensor indices(indices_host);
  Inputs inputs = device.inputs();
  inputs.initial_state = initial.view();
  inputs.state_indices = indices.view();
  inputs.state_indices_host = indices_host.view();
  const DeviceTensor& final_pool = in_place ? initial : separate_final;
  ForwardOutputs outputs{o.view(), std::nullopt};
  if (options.final_state) outputs.final_state = final_pool.view();
  recurrent_forward(inputs, outputs, device.options(options));
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the recurrent step");
  ForwardResult result{o.download(), {}};
  if (options.final_state) result.ht = final_pool.download();
  return result;
}

BackwardResult cuda_backward(const Sample& s, const Cotangents& c, const DeviceCallOptions& options) {
  return backward_on(DeviceSample(s, options), s, c, options, nullptr);
}

double frobenius_error(const std::vector<double>& actual, const std::vector<double>& expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double gap = 0, norm = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i]) || !std::isfinite(expected[i])) return std::numeric_limits<double>::infinity();
    gap += (actual[i] - expected[i]) * (actual[i] - expected[i]);
    norm += expected[i] * expected[i];
  }
  if (norm == 0) return gap == 0 ? 0 : std::numeric_limits<double>::infinity();
  return std::sqrt(gap / norm);
}

::testing::AssertionResult frobenius_close(const std::string& what, const std::vector<double>& actual,
                                           const std::vector<double>& expected, double tolerance) {
  const double error = frobenius_error(actual, expected);
  // The measured errors are worth reading when a tolerance is revisited.
  std::printf("  %-12s relative Frobenius error %.3e (tolerance %.1e)\n", what.c_str(), error, tolerance);
  if (error <= tolerance) return ::testing::AssertionSuccess();
  std::size_t unwritten = 0;
  for (double x : actual) unwritten += std::isnan(x) ? 1 : 0;
  return ::testing::AssertionFailure() << what << ": relative Frobenius error " << error << " > " << tolerance << " ("
                                       << unwritten << " of " << actual.size() << " values NaN)";
}

double cuda_tolerance(DType io) {
  switch (io) {
    case DType::f32:  // three TF32 products per float32 product: near float32 accuracy
      return 1e-4;
    case DType::f16:  // operands and stored intermediates with 11 significant bits
      return 4e-3;
    case DType::bf16:  // 8 significant bits
      return 1.5e-2;
    default:
      return 0;
  }
}

}  // namespace deltatrain::gdn::testing
