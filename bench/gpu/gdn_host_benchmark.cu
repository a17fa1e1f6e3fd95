// Host time of one call of the cuda GDN backend (issue 3 asks for at most 20 us per call): the wall time
// of issuing calls back to back while the GPU is held busy by a spinning kernel, so that every call only
// queues and the timer sees the host's own work (validation, backend choice, workspace lookup, kernel
// launches), never the GPU. Problems are small (64 tokens, 2/4 heads, dims 128, bf16, L2 norm, states).
// Every kBatch calls the timer pauses, the GPU drains and a new spin starts, so the launch queue never
// fills and blocks the host.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <random>
#include <string>

#include "deltatrain/core/cuda_check.h"
#include "device_tensors.h"

namespace deltatrain::gdn::testing {
namespace {

constexpr int kBatch = 32;                  // calls queued behind one spin: at most 7 launches each
constexpr long long kSpinCycles = 4'000'000;  // about 2 ms: longer than issuing a batch takes

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

Sample small_sample(std::int64_t tokens) {
  std::mt19937 rng(1);
  return random_sample(Layout{1, tokens, 2, 4, 128, 128, {}}, DType::bf16, DType::f32, true, true, rng);
}

void hold_gpu() {
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  spin<<<1, 1>>>(kSpinCycles);
  cuda_check(cudaGetLastError(), "spin launch");
}

template <class Call>
void time_host(benchmark::State& state, Call&& call) {
  call();  // the workspace is sized on the first call
  hold_gpu();
  int issued = 0;
  for (auto _ : state) {
    call();
    if (++issued % kBatch == 0) {
      state.PauseTiming();
      hold_gpu();
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

// Arg 0: the chunked forward over 64 tokens; arg 1: the recurrent step (one token).
void BM_Forward(benchmark::State& state) {
  if (skipped_without_gpu(state)) return;
  const bool recurrent = state.range(0) == 1;
  const Sample s = small_sample(recurrent ? 1 : 64);
  const DeviceCallOptions options;
  const DeviceSample device(s, options);
  const DeviceTensor o(HostTensor(s.io, s.layout.v_shape())), ht(HostTensor(s.state(), s.layout.state_shape()));
  const ForwardOutputs out{o.view(), ht.view()};
  const Options call = device.options(options);
  time_host(state, [&] {
    if (recurrent) {
      recurrent_forward(device.inputs(), out, call);
    } else {
      chunk_forward(device.inputs(), out, call);
    }
  });
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

BENCHMARK(BM_Forward)->ArgName("recurrent")->Arg(0)->Arg(1)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ChunkBackward)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace deltatrain::gdn::testing
