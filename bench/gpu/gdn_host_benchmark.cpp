// Host time of one call of the cuda GDN backend (issue 3 asks for at most 20 us per call). Calls are issued
// back to back without synchronising, on problems small enough (64 tokens, 2/4 heads, dims 128, bf16, L2
// norm, states) that the timer sees the host's own work: validation, backend choice, workspace lookup and
// the kernel launches. Every kDrainEvery calls the timer pauses while the GPU catches up, so that the
// launch queue never fills and blocks the host.
#include <benchmark/benchmark.h>

#include <random>
#include <string>

#include "deltatrain/core/cuda_check.h"
#include "device_tensors.h"

namespace deltatrain::gdn::testing {
namespace {

constexpr int kDrainEvery = 64;

Sample small_sample(std::int64_t tokens) {
  std::mt19937 rng(1);
  return random_sample(Layout{1, tokens, 2, 4, 128, 128, {}}, DType::bf16, DType::f32, true, true, rng);
}

template <class Call>
void time_host(benchmark::State& state, Call&& call) {
  int issued = 0;
  for (auto _ : state) {
    call();
    if (++issued % kDrainEvery == 0) {
      state.PauseTiming();
      cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      state.ResumeTiming();
    }
  }
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

bool skipped_without_gpu(benchmark::State& state) {
  const std::string why = cuda_backend_unusable();
  if (!why.empty()) state.SkipWithError(why.c_str());
  return !why.empty();
}

void BM_ChunkForward(benchmark::State& state) {
  if (skipped_without_gpu(state)) return;
  const Sample s = small_sample(64);
  const DeviceCallOptions options;
  const DeviceSample device(s, options);
  const DeviceTensor o(HostTensor(s.io, s.layout.v_shape())), ht(HostTensor(s.state(), s.layout.state_shape()));
  const ForwardOutputs out{o.view(), ht.view()};
  const Options call = device.options(options);
  time_host(state, [&] { chunk_forward(device.inputs(), out, call); });
}

void BM_RecurrentStep(benchmark::State& state) {
  if (skipped_without_gpu(state)) return;
  const Sample s = small_sample(1);
  const DeviceCallOptions options;
  const DeviceSample device(s, options);
  const DeviceTensor o(HostTensor(s.io, s.layout.v_shape())), ht(HostTensor(s.state(), s.layout.state_shape()));
  const ForwardOutputs out{o.view(), ht.view()};
  const Options call = device.options(options);
  time_host(state, [&] { recurrent_forward(device.inputs(), out, call); });
}

void BM_ChunkBackward(benchmark::State& state) {
  if (skipped_without_gpu(state)) return;
  const Sample s = small_sample(64);
  const Layout& l = s.layout;
  std::mt19937 rng(2);
  const Cotangents c = random_cotangents(s, true, rng);
  const DeviceCallOptions options;
  const DeviceSample device(s, options);
  const DeviceTensor d_o(HostTensor(c.d_o, s.io, l.v_shape())), dht(HostTensor(c.dht, s.state(), l.state_shape()));
  const DeviceTensor dq(HostTensor(s.io, l.qk_shape())), dk(HostTensor(s.io, l.qk_shape()));
  const DeviceTensor dv(HostTensor(s.io, l.v_shape())), dh0(HostTensor(s.state(), l.state_shape()));
  const DeviceTensor dg(HostTensor(s.gate, l.gate_shape())), dbeta(HostTensor(s.gate, l.gate_shape()));
  const BackwardInputs grads_in{d_o.view(), dht.view()};
  const Gradients grads_out{dq.view(), dk.view(), dv.view(), dg.view(), dbeta.view(), dh0.view()};
  const Options call = device.options(options);
  time_host(state, [&] { chunk_backward(device.inputs(), grads_in, grads_out, call); });
}

BENCHMARK(BM_ChunkForward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RecurrentStep)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ChunkBackward)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace deltatrain::gdn::testing
