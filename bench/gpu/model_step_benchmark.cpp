// One training step of the model on a GPU (forward + loss + backward, bfloat16): tokens/s, model FLOPs
// utilisation against the H200's dense bf16 peak, and memory. Parameters are HF's initialisation from a
// seed, tokens random, packed as --sequences x --seq-len.
//
//   model_step_benchmark [--config qwen3.5-0.8b] [--sequences 8] [--seq-len 4096] [--steps 5] [--warmup 2]
//                        [--peak-tflops 989] [--recompute] [--loss-chunk TOKENS] [--json FILE]
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/model/cost.h"
#include "deltatrain/model/model.h"
#include "deltatrain/model/params.h"

using namespace deltatrain;

int main(int argc, char** argv) {
  CLI::App app{"one training step of the model on a GPU"};
  std::string config_name = "qwen3.5-0.8b", json_path;
  int sequences = 8, seq_len = 4096, steps = 5, warmup = 2;
  double peak_tflops = 989;
  bool recompute = false;
  std::int64_t loss_chunk = model::ModelOptions{}.loss_chunk;
  app.add_option("--config", config_name);
  app.add_option("--sequences", sequences);
  app.add_option("--seq-len", seq_len);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--peak-tflops", peak_tflops, "dense bf16 peak of the GPU (H200: 989)");
  app.add_flag("--recompute", recompute);
  app.add_option("--loss-chunk", loss_chunk, "tokens per chunk of the loss (0: the model's default for a GPU)");
  app.add_option("--json", json_path);
  CLI11_PARSE(app, argc, argv);

  try {
    const model::Config config = model::load_config(config_name);
    const Device gpu{DeviceType::cuda, 0};
    cudaStream_t stream;
    cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
    std::size_t free_before = 0, total = 0;
    cuda_check(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo");

    model::ParamStore host(config, DType::bf16);
    host.init(config.initializer_range, 1);
    model::DeviceParams device(host, gpu);
    device.upload(host, stream);
    model::Model m(config, {.device = gpu, .dtype = DType::bf16, .stream = stream, .loss_chunk = loss_chunk,
                            .recompute = recompute});
    m.bind(device.params(), device.grads());

    std::mt19937 rng(7);
    std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(config.vocab_size - 1));
    std::vector<std::int32_t> tokens(std::size_t(sequences) * seq_len), cu{0};
    for (auto& t : tokens) t = token(rng);
    for (int n = 0; n < sequences; ++n) cu.push_back(cu.back() + seq_len);

    cudaEvent_t start, middle, stop;
    cuda_check(cudaEventCreate(&start), "cudaEventCreate");
    cuda_check(cudaEventCreate(&middle), "cudaEventCreate");
    cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
    // GPU time by events; beside it the host's time inside forward() (which waits for the loss) and backward()
    // (which only queues work): a backward whose host time nears its GPU time is bound by the host's launches.
    std::vector<double> step_ms, forward_ms, host_forward_ms, host_backward_ms;
    const auto since_ms = [](std::chrono::steady_clock::time_point t0) {
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
    double loss = 0;
    for (int s = 0; s < warmup + steps; ++s) {
      device.zero_grads(stream);
      cuda_check(cudaEventRecord(start, stream), "cudaEventRecord");
      const auto forward_start = std::chrono::steady_clock::now();
      loss = m.forward({tokens, cu});  // waits for the loss (one synchronisation per step)
      const double host_forward = since_ms(forward_start);
      cuda_check(cudaEventRecord(middle, stream), "cudaEventRecord");
      const auto backward_start = std::chrono::steady_clock::now();
      m.backward();
      const double host_backward = since_ms(backward_start);
      cuda_check(cudaEventRecord(stop, stream), "cudaEventRecord");
      cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float total_ms = 0, fwd_ms = 0;
      cudaEventElapsedTime(&total_ms, start, stop);
      cudaEventElapsedTime(&fwd_ms, start, middle);
      if (s >= warmup) {
        step_ms.push_back(total_ms);
        forward_ms.push_back(fwd_ms);
        host_forward_ms.push_back(host_forward);
        host_backward_ms.push_back(host_backward);
      }
      std::printf("step %d: loss %.4f, %.1f ms (forward %.1f; host %.1f in forward, %.1f in backward)\n", s, loss,
                  total_ms, fwd_ms, host_forward, host_backward);
    }
    const auto median_of = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double median = median_of(step_ms), median_forward = median_of(forward_ms);
    std::size_t free_after = 0;
    cuda_check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo");
    const double tokens_per_s = double(tokens.size()) / (median / 1e3);
    const model::TokenFlops flops = model::training_flops_per_token(config, seq_len);
    const double mfu = flops.total() * tokens_per_s / (peak_tflops * 1e12);
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    nlohmann::ordered_json out = {
        {"gpu", prop.name},           {"config", config_name},
        {"tokens", tokens.size()},    {"sequences", sequences},
        {"seq_len", seq_len},         {"recompute", recompute},
        {"loss_chunk", loss_chunk > 0 ? loss_chunk : model::default_loss_chunk(gpu)},
        {"step_ms", median},          {"forward_ms", median_forward},
        {"backward_ms", median - median_forward},
        {"host_forward_ms", median_of(host_forward_ms)}, {"host_backward_ms", median_of(host_backward_ms)},
        {"tokens_per_s", tokens_per_s}, {"training_gflop_per_token", flops.total() / 1e9},
        {"mfu", mfu},                 {"peak_tflops", peak_tflops},
        {"memory_used_gib", double(free_before - free_after) / (1ull << 30)},
        {"loss", loss}};
    std::printf("%s\n", out.dump(1).c_str());
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_step_benchmark: %s\n", e.what());
    return 1;
  }
  return 0;
}
