// The floor of decode's recurrent GDN step, measured: what the GPU's memory gives the step's traffic pattern
// alone. A decode step reads every slot's float32 state [HV, K, V] and writes it back in place, one layer after
// another (bench/NOTES.md, Rollout: the recurrent kernel's time is compared with this, not with the datasheet's
// bandwidth). Three kernels over `layers` state pools of `slots` x HV x K x V floats, each pool beyond the L2
// cache together with the others (as a step's layers are), timed by CUDA events over a graph of one pass over
// the pools:
//   read        each pool's floats summed (one float per thread kept live so the loads are not dropped)
//   in_place    each float scaled in place (read and write the same addresses: the recurrent step's pattern)
//   copy        each pool read and written to a second pool (the write-back to other addresses)
// One JSON object per kernel on stdout: microseconds per layer and the bytes moved per second.
//
//   state_bandwidth [--slots 64] [--heads 16] [--key-dim 128] [--value-dim 128] [--layers 18] [--reps 20]
//                   [--ctas-per-sm 8]   (0: one float4 a thread, no grid-stride loop)
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "deltatrain/core/cuda_check.h"

using deltatrain::cuda_check;

namespace {

constexpr int kThreads = 256;

__global__ void read_kernel(const float4* x, long long n, float* sink) {
  float sum = 0.f;
  for (long long i = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    const float4 v = x[i];
    sum += v.x + v.y + v.z + v.w;
  }
  if (sum == 123.456f) *sink = sum;  // never true for the data written below; keeps the loads live
}

__global__ void in_place_kernel(float4* x, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    float4 v = x[i];
    v.x *= 0.999f, v.y *= 0.999f, v.z *= 0.999f, v.w *= 0.999f;
    x[i] = v;
  }
}

__global__ void copy_kernel(const float4* x, float4* y, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * kThreads)
    y[i] = x[i];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The memory floor of decode's recurrent GDN step"};
  long long slots = 64, heads = 16, key_dim = 128, value_dim = 128;
  int layers = 18, reps = 20, ctas_per_sm = 8;
  app.add_option("--slots", slots, "sequences in the batch")->check(CLI::PositiveNumber);
  app.add_option("--heads", heads, "GDN value heads")->check(CLI::PositiveNumber);
  app.add_option("--key-dim", key_dim, "K")->check(CLI::PositiveNumber);
  app.add_option("--value-dim", value_dim, "V (a multiple of 4)")->check(CLI::PositiveNumber);
  app.add_option("--layers", layers, "state pools, one per GDN layer")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "graph launches timed")->check(CLI::PositiveNumber);
  app.add_option("--ctas-per-sm", ctas_per_sm, "CTAs of 256 threads a SM, walking the pool; 0: a thread a float4")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  if (value_dim % 4 != 0) {
    std::fprintf(stderr, "state_bandwidth: --value-dim must be a multiple of 4, got %lld\n", value_dim);
    return 2;
  }
  const long long floats = slots * heads * key_dim * value_dim, vectors = floats / 4;
  const std::size_t bytes = static_cast<std::size_t>(floats) * sizeof(float);

  int device = 0, multiprocessors = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device), "SM count");
  const long long one_each = (vectors + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(
      ctas_per_sm == 0 ? one_each : std::min<long long>(static_cast<long long>(ctas_per_sm) * multiprocessors, one_each));

  std::vector<float4*> pools(2 * layers);
  for (float4*& pool : pools) {
    cuda_check(cudaMalloc(&pool, bytes), "cudaMalloc");
    cuda_check(cudaMemset(pool, 0, bytes), "cudaMemset");
  }
  float* sink = nullptr;
  cuda_check(cudaMalloc(&sink, sizeof(float)), "cudaMalloc");
  cudaStream_t stream{};
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  const auto time_pass = [&](const char* name, auto&& launch_layer, double bytes_per_layer) {
    cudaGraph_t graph{};
    cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    for (int l = 0; l < layers; ++l) launch_layer(l);
    cuda_check(cudaStreamEndCapture(stream, &graph), "end capture");
    cudaGraphExec_t exec{};
    cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    cuda_check(cudaGraphLaunch(exec, stream), "warm-up");
    cudaEvent_t start{}, stop{};
    cuda_check(cudaEventCreate(&start), "event");
    cuda_check(cudaEventCreate(&stop), "event");
    cuda_check(cudaEventRecord(start, stream), "record");
    for (int r = 0; r < reps; ++r) cuda_check(cudaGraphLaunch(exec, stream), "graph launch");
    cuda_check(cudaEventRecord(stop, stream), "record");
    cuda_check(cudaEventSynchronize(stop), "synchronize");
    float ms = 0.f;
    cuda_check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    const double us_per_layer = 1e3 * ms / (static_cast<double>(reps) * layers);
    nlohmann::json row{{"kernel", name},     {"slots", slots},   {"heads", heads},
                       {"key_dim", key_dim}, {"value_dim", value_dim}, {"layers", layers},
                       {"ctas", blocks},     {"us_per_layer", us_per_layer}, {"tb_per_s", bytes_per_layer / (us_per_layer * 1e6)}};
    std::printf("%s\n", row.dump().c_str());
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  };
  time_pass("read", [&](int l) { read_kernel<<<blocks, kThreads, 0, stream>>>(pools[l], vectors, sink); },
            static_cast<double>(bytes));
  time_pass("in_place", [&](int l) { in_place_kernel<<<blocks, kThreads, 0, stream>>>(pools[l], vectors); },
            2.0 * static_cast<double>(bytes));
  time_pass("copy", [&](int l) { copy_kernel<<<blocks, kThreads, 0, stream>>>(pools[l], pools[layers + l], vectors); },
            2.0 * static_cast<double>(bytes));
  cuda_check(cudaGetLastError(), "kernels");
  for (float4* pool : pools) cudaFree(pool);
  cudaFree(sink);
  cudaStreamDestroy(stream);
  return 0;
}
