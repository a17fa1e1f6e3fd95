// cuBLASLt's candidates for a decode step's products, timed. For each product of a config's layers (the stacked
// GDN input projections, out_proj, attention's q/k/v and o_proj, the MLP's stacked gate/up and down) and its
// lm_head, at each row count: the heuristic's first --candidates algorithms (model/cuda/gemm.h's
// Gemm::candidates), each timed with CUDA events over a graph of --reps launches after a warm-up,
// with its tile, stages and split-K. At decode's few rows a product reads its weight once, so the weight's bytes
// over the time are the bandwidth it gets: what a rule for small row counts would choose from (bench/NOTES.md,
// Rollout). Beside them, Gemm::run itself ("kernel": "run"): the weight-streaming kernel where its plan takes the
// product (stream_gemm_plan.h), else the first candidate. The launches take their weight from copies that together
// exceed the L2 cache, as the layers of a decode step do (one weight timed alone would be served from L2 after its
// first launch). One JSON object per (product, rows, kernel) on stdout, or an array in --json.
//
//   gemm_candidates [--config qwen3.5-0.8b] [--rows 1,16,64,256] [--candidates 16] [--split-k 2,4,8]
//                   [--reps 200] [--json FILE]
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/gemm.h"
#include "deltatrain/core/cuda_check.h"
#include "deltatrain/model/config.h"

using namespace deltatrain;

namespace {

// The H200's L2 is 50 MB; four times that in weight copies keeps every launch's weight coming from HBM.
constexpr std::size_t kWeightBytesBeyondL2 = std::size_t{200} << 20;

struct Product {
  std::string name;
  std::int64_t out_features, in_features;  // the weight [N, K]; y [M, N] = x [M, K] W^T
};

std::vector<Product> decode_products(const model::Config& c) {
  const std::int64_t hidden = c.hidden_size, hd = c.head_dim;
  return {{"gdn.in_proj", c.linear_in_proj_dim(), hidden},
          {"gdn.out_proj", hidden, c.linear_value_dim()},
          {"attention.q_proj", 2 * std::int64_t{c.num_attention_heads} * hd, hidden},
          {"attention.k_proj", std::int64_t{c.num_key_value_heads} * hd, hidden},
          {"attention.o_proj", hidden, std::int64_t{c.num_attention_heads} * hd},
          {"mlp.gate_up", 2 * c.intermediate_size, hidden},
          {"mlp.down", hidden, c.intermediate_size},
          {"lm_head", c.vocab_size, hidden}};
}

// Device memory for one product's operands, filled with small values (the kernels' time does not depend on them).
struct Buffer {
  void* data = nullptr;
  explicit Buffer(std::size_t bytes) {
    cuda_check(cudaMalloc(&data, bytes), "cudaMalloc");
    cuda_check(cudaMemset(data, 0x3c, bytes), "cudaMemset");  // bf16 0x3c3c ~ 0.0115
  }
  ~Buffer() { cudaFree(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cuBLASLt's candidates for a decode step's products, timed"};
  std::string config_name = "qwen3.5-0.8b", json_path;
  std::vector<std::int64_t> row_counts{1, 16, 64, 256};
  std::vector<std::uint32_t> split_k;
  int candidates = 16, reps = 200;
  app.add_option("--config", config_name);
  app.add_option("--rows", row_counts, "row counts (a decode step's batch sizes), comma-separated")
      ->delimiter(',')
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  app.add_option("--candidates", candidates, "heuristic results to time per product")->check(CLI::Range(1, 64));
  app.add_option("--split-k", split_k,
                 "also time each candidate with K split into these numbers of parts, comma-separated")
      ->delimiter(',')
      ->check(CLI::Range(1u, 64u));
  app.add_option("--reps", reps, "timed launches per candidate")->check(CLI::Range(1, 100000));
  app.add_option("--json", json_path);
  CLI11_PARSE(app, argc, argv);

  try {
    const model::Config config = model::load_config(config_name);
    cudaStream_t stream;
    cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
    model::cuda::Gemm gemm(stream);
    cudaEvent_t start, stop;
    cuda_check(cudaEventCreate(&start), "cudaEventCreate");
    cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
    nlohmann::json rows = nlohmann::json::array();
    for (const Product& p : decode_products(config)) {
      const std::int64_t N = p.out_features, K = p.in_features;
      const std::size_t weight_bytes = static_cast<std::size_t>(N * K) * 2;
      std::vector<std::unique_ptr<Buffer>> weights;
      for (std::size_t held = 0; held < kWeightBytesBeyondL2 || weights.empty(); held += weight_bytes)
        weights.push_back(std::make_unique<Buffer>(weight_bytes));
      for (const std::int64_t M : row_counts) {
        const Buffer x(static_cast<std::size_t>(M * K) * 2), y(static_cast<std::size_t>(M * N) * 2);
        const std::vector<model::cuda::Gemm::Candidate> found =
            gemm.candidates(false, true, M, N, K, x.data, K, weights[0]->data, K, y.data, N, DType::bf16, candidates,
                            split_k);
        // Mean time of one launch over `reps`, each launch on the next weight copy, replayed from a CUDA graph as a
        // decode step is (timing the launches themselves would time cuBLASLt's host work at these sizes).
        const auto time_us = [&](const auto& product) {
          cudaGraph_t graph;
          cudaGraphExec_t replay;
          cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
          for (int i = 0; i < reps; ++i) product(weights[static_cast<std::size_t>(i) % weights.size()]->data);
          cuda_check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
          cuda_check(cudaGraphInstantiate(&replay, graph, 0), "cudaGraphInstantiate");
          cuda_check(cudaGraphLaunch(replay, stream), "cudaGraphLaunch");  // warm-up
          cuda_check(cudaEventRecord(start, stream), "cudaEventRecord");
          cuda_check(cudaGraphLaunch(replay, stream), "cudaGraphLaunch");
          cuda_check(cudaEventRecord(stop, stream), "cudaEventRecord");
          cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
          float ms = 0;
          cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
          cuda_check(cudaGraphExecDestroy(replay), "cudaGraphExecDestroy");
          cuda_check(cudaGraphDestroy(graph), "cudaGraphDestroy");
          return 1e3 * ms / reps;
        };
        const auto record = [&](nlohmann::json row, double us) {
          row.update({{"product", p.name}, {"rows", M}, {"N", N}, {"K", K}, {"us", us},
                      {"weight_gb_per_s", static_cast<double>(N * K * 2) / (us * 1e3)}});
          std::printf("%s\n", row.dump().c_str());
          rows.push_back(std::move(row));
        };
        // What the model runs: Gemm::run, the weight-streaming kernel where its plan takes the product.
        record({{"kernel", "run"}}, time_us([&](const void* weight) {
                 gemm.run(false, true, M, N, K, 1.f, x.data, K, weight, K, 0.f, y.data, N, DType::bf16);
               }));
        for (const model::cuda::Gemm::Candidate& candidate : found) {
          record({{"kernel", "cublaslt"}, {"heuristic_rank", candidate.heuristic_rank}, {"tile", candidate.tile},
                  {"stages", candidate.stages}, {"split_k", candidate.split_k}, {"reduction", candidate.reduction}},
                 time_us([&](const void* weight) {
                   gemm.run_with(candidate.algo, false, true, M, N, K, 1.f, x.data, K, weight, K, 0.f, y.data, N,
                                 DType::bf16);
                 }));
        }
      }
    }
    if (!json_path.empty()) std::ofstream(json_path) << rows.dump(1) << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemm_candidates: %s\n", e.what());
    return 1;
  }
}
