// The model's fused attention (cuDNN's SDPA through model/cuda/cudnn_attention.h) timed alone, forward and backward,
// on a config's attention shape over --sequences x --seq-len packed tokens: what the deterministic backward costs
// against cuDNN's other one (dQ by atomics), and what GQA costs against the same heads with the key/value heads
// repeated (--kv-heads 8 for the 0.8B model's 8 query heads: an MHA call the model could make by copying its keys and
// values, summing their gradients per group afterwards; those copies are not timed here). Each variant's backward runs
// twice more on the same inputs and reports whether dq, dk and dv came out bit for bit the same.
//
// Times are CUDA events around --reps launches after two of warm-up, inputs random bfloat16 in [-1, 1].
// CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT (cudnn-frontend's own setting, read when a graph is built) selects its
// other deterministic backward on Hopper (ordered dQ accumulation) when set below the dP workspace it would need.
//
//   attention_benchmark [--config qwen3.5-0.8b] [--sequences 8] [--seq-len 4096] [--kv-heads 2,8]
//                       [--backward deterministic,atomic] [--reps 10] [--json FILE]
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "cuda/cudnn_attention.h"
#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/model/config.h"

using namespace deltatrain;
using model::cuda::Matrix;

namespace {

// A [rows, cols] bfloat16 matrix in device memory, random in [-1, 1] (or zeros).
struct DeviceMatrix {
  Matrix m;
  DeviceMatrix(std::int64_t rows, std::int64_t cols, std::uint32_t seed) {
    m = {nullptr, rows, cols, cols};
    const std::size_t count = static_cast<std::size_t>(rows * cols);
    cuda_check(cudaMalloc(&m.data, count * 2), "cudaMalloc");
    if (seed == 0) {
      cuda_check(cudaMemset(m.data, 0, count * 2), "cudaMemset");
      return;
    }
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> uniform(-1.f, 1.f);
    std::vector<std::uint16_t> host(count);
    for (std::uint16_t& v : host) v = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(uniform(rng)) >> 16);
    cuda_check(cudaMemcpy(m.data, host.data(), count * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~DeviceMatrix() { cudaFree(m.data); }
  DeviceMatrix(const DeviceMatrix&) = delete;
  DeviceMatrix& operator=(const DeviceMatrix&) = delete;
  std::vector<std::uint16_t> download() const {
    std::vector<std::uint16_t> host(static_cast<std::size_t>(m.rows * m.cols));
    cuda_check(cudaMemcpy(host.data(), m.data, host.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return host;
  }
};

// Median milliseconds of `reps` runs of `launch`, each timed by its own pair of events, after two of warm-up.
template <class Launch>
double median_ms(int reps, cudaStream_t stream, Launch launch) {
  cudaEvent_t start, stop;
  cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < 2; ++i) launch();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    cuda_check(cudaEventRecord(start, stream), "cudaEventRecord");
    launch();
    cuda_check(cudaEventRecord(stop, stream), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float t = 0;
    cuda_check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"the model's fused attention (cuDNN) timed alone, forward and backward"};
  std::string config_name = "qwen3.5-0.8b", json_path;
  int sequences = 8, seq_len = 4096, reps = 10;
  std::vector<int> kv_heads_list;
  std::vector<std::string> backward_modes{"deterministic", "atomic"};
  app.add_option("--config", config_name);
  app.add_option("--sequences", sequences)->check(CLI::Range(1, 1024));
  app.add_option("--seq-len", seq_len)->check(CLI::Range(1, 1 << 20));
  app.add_option("--kv-heads", kv_heads_list,
                 "key/value heads to run (each dividing the config's query heads; default: the config's)")
      ->delimiter(',');
  app.add_option("--backward", backward_modes, "the backward's algorithms: deterministic, atomic")
      ->delimiter(',')
      ->check(CLI::IsMember({"deterministic", "atomic"}));
  app.add_option("--reps", reps)->check(CLI::Range(1, 10000));
  app.add_option("--json", json_path);
  CLI11_PARSE(app, argc, argv);

  try {
    const model::Config config = model::load_config(config_name);
    const int q_heads = config.num_attention_heads, head_dim = config.head_dim;
    if (kv_heads_list.empty()) kv_heads_list.push_back(config.num_key_value_heads);
    for (int kv : kv_heads_list)
      if (kv < 1 || q_heads % kv != 0)
        throw InvalidArgument("--kv-heads", "must divide the config's " + std::to_string(q_heads) + " query heads");
    cudaStream_t stream;
    cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
    const std::int64_t tokens = std::int64_t{sequences} * seq_len;
    std::vector<std::int32_t> cu{0};
    for (int n = 0; n < sequences; ++n) cu.push_back(cu.back() + seq_len);
    std::int32_t* cu_device = nullptr;
    cuda_check(cudaMalloc(reinterpret_cast<void**>(&cu_device), cu.size() * sizeof(std::int32_t)), "cudaMalloc");
    cuda_check(cudaMemcpy(cu_device, cu.data(), cu.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice),
               "cudaMemcpy");
    const model::cuda::Sequences seqs{cu_device, sequences};
    // Causal products: Q K^T and P V over the half square, each 2 FLOPs a multiply-add; the backward's five
    // products are 2.5 times the forward's two.
    const double forward_flops = 4.0 * sequences * (double(seq_len) * (seq_len + 1) / 2) * head_dim * q_heads;

    const std::int64_t q_cols = std::int64_t{q_heads} * head_dim;
    const DeviceMatrix q(tokens, q_cols, 1), dout(tokens, q_cols, 2), o(tokens, q_cols, 0), dq(tokens, q_cols, 0);
    float* lse_data = nullptr;
    cuda_check(cudaMalloc(reinterpret_cast<void**>(&lse_data), sizeof(float) * q_heads * tokens), "cudaMalloc");
    const Matrix lse{lse_data, q_heads, tokens, tokens};

    nlohmann::json rows = nlohmann::json::array();
    for (const std::string& mode : backward_modes) {
      model::cuda::CudnnAttention attention(mode == "deterministic" ? model::cuda::AttentionBackward::deterministic
                                                                    : model::cuda::AttentionBackward::atomic);
      model::cuda::Workspace workspace(stream);
      for (int kv_heads : kv_heads_list) {
        const std::int64_t kv_cols = std::int64_t{kv_heads} * head_dim;
        const DeviceMatrix k(tokens, kv_cols, 3), v(tokens, kv_cols, 4);
        const DeviceMatrix dk(tokens, kv_cols, 0), dv(tokens, kv_cols, 0);
        const model::cuda::AttentionShape shape{q_heads, kv_heads, head_dim, 1.f / std::sqrt(float(head_dim))};
        const auto forward = [&] {
          attention.forward(workspace, o.m, lse, q.m, k.m, v.m, shape, cu, seqs, stream);
        };
        const auto backward = [&] {
          attention.backward(workspace, dq.m, dk.m, dv.m, dout.m, q.m, k.m, v.m, o.m, lse, shape, cu, seqs, stream);
        };
        const double forward_ms = median_ms(reps, stream, forward);
        const double backward_ms = median_ms(reps, stream, backward);
        cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        const auto first = std::vector{dq.download(), dk.download(), dv.download()};
        backward();
        cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        const bool repeats = first == std::vector{dq.download(), dk.download(), dv.download()};
        nlohmann::json row = {{"config", config_name},
                              {"sequences", sequences},
                              {"seq_len", seq_len},
                              {"q_heads", q_heads},
                              {"kv_heads", kv_heads},
                              {"head_dim", head_dim},
                              {"backward", mode},
                              {"forward_ms", forward_ms},
                              {"backward_ms", backward_ms},
                              {"forward_tflops", forward_flops / forward_ms * 1e-9},
                              {"backward_tflops", 2.5 * forward_flops / backward_ms * 1e-9},
                              {"backward_bitwise_repeat", repeats}};
        std::printf("%s\n", row.dump().c_str());
        std::fflush(stdout);
        rows.push_back(row);
      }
    }
    cudaFree(lse_data);
    cudaFree(cu_device);
    if (!json_path.empty()) std::ofstream(json_path) << rows.dump(2) << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_benchmark: %s\n", e.what());
    return 1;
  }
}
