// cuBLASLt's candidates for the model's products, timed: what a rule choosing among them would choose from
// (bench/NOTES.md, Rollout and Model). For each weight of a config's layers (the stacked GDN input projections,
// out_proj, attention's q/k/v and o_proj, the MLP's stacked gate/up and down) and its lm_head, at each row count:
// the heuristic's first --candidates algorithms (model/cuda/gemm.h's Gemm::candidates), each timed with CUDA events
// over a graph of --reps launches after a warm-up, with its tile, stages and split-K; beside them Gemm::run itself
// ("kernel": "run": the weight-streaming kernel where its plan takes the product, else the first candidate), and
// with --stream-splits the weight-streaming kernel itself at each of those split counts wherever its pipeline can
// take the product (what its plan chooses from; "kernel": "stream").
//
// --products decode: y = x W^T at decode's few rows, where a product reads its weight once, so the weight's bytes
// over the time are the bandwidth it gets. --products training: the three products of a linear layer's training
// step at a batch's tokens (model.cpp's linear and linear_backward: y = x W^T, dx = dy W, and dW += dy^T x into
// float32 gradients), the lm_head's at the GPU's loss chunk (model.h's default_loss_chunk) when rows exceed it.
// Each launch takes its b operand from the next of copies that together exceed the L2 cache, as a step's layers do
// (one weight timed alone would be served from L2 after its first launch). One JSON object per (product, pass, rows,
// kernel) on stdout, or an array in --json.
//
//   gemm_candidates [--config qwen3.5-0.8b] [--products decode|training] [--values constant|random]
//                   [--rows 1,16,64,256] [--candidates 16] [--split-k 2,4,8] [--stream-splits 1,2,4,8]
//                   [--reps 200] [--json FILE]
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <bit>
#include <cstdint>
#include <random>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "cuda/stream_gemm_plan.h"
#include "deltatrain/core/cuda_check.h"
#include "deltatrain/model/config.h"
#include "deltatrain/model/model.h"

using namespace deltatrain;

namespace {

// The H200's L2 is 50 MB; four times that in copies of b keeps every launch's b coming from HBM.
constexpr std::size_t kBytesBeyondL2 = std::size_t{200} << 20;

struct Product {
  std::string name;
  std::int64_t out_features, in_features;  // the weight [N, K]; y [M, N] = x [M, K] W^T
};

std::vector<Product> layer_products(const model::Config& c) {
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

// c [M, N] = op(a) op(b) + beta c, row-major and dense (Gemm::run's arguments).
struct Shape {
  bool trans_a, trans_b;
  std::int64_t M, N, K;
  DType c_dtype;
  float beta;
  std::int64_t lda() const { return trans_a ? M : K; }
  std::int64_t ldb() const { return trans_b ? K : N; }
};

struct Pass {
  std::string name;
  Shape shape;
};

// y [rows, out] = x W^T, W [out, in] as b.
Pass forward_pass(const Product& p, std::int64_t rows) {
  return {"forward", {false, true, rows, p.out_features, p.in_features, DType::bf16, 0.f}};
}

// A linear layer's training products at `rows` tokens: the forward, dx [rows, in] = dy W (W as b), and
// dW [out, in] += dy^T x into float32 (dy [rows, out] as a transposed; x as b).
std::vector<Pass> training_passes(const Product& p, std::int64_t rows) {
  return {forward_pass(p, rows),
          {"input_grad", {false, false, rows, p.in_features, p.out_features, DType::bf16, 0.f}},
          {"weight_grad", {true, false, p.out_features, p.in_features, rows, DType::f32, 1.f}}};
}

// Device memory for one product's operands: one small value everywhere (bf16 0x3c3c ~ 0.0115), or random bfloat16
// values in [-1, 1] (a 1 MiB random block repeated). A product's speed depends on them: tensor cores switching random
// bits draw more power than on constant ones, so under sustained load the clocks, and the products, may run slower
// on random values, as a training step's do.
struct Buffer {
  void* data = nullptr;
  Buffer(std::size_t bytes, bool random) {
    cuda_check(cudaMalloc(&data, bytes), "cudaMalloc");
    if (!random) {
      cuda_check(cudaMemset(data, 0x3c, bytes), "cudaMemset");
      return;
    }
    static const std::vector<std::uint16_t> block = [] {
      std::mt19937 rng(20261203);
      std::uniform_real_distribution<float> uniform(-1.f, 1.f);
      std::vector<std::uint16_t> values(std::size_t{1} << 19);
      for (std::uint16_t& v : values) v = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(uniform(rng)) >> 16);
      return values;
    }();
    const std::size_t block_bytes = block.size() * sizeof(std::uint16_t);
    for (std::size_t at = 0; at < bytes; at += block_bytes)
      cuda_check(cudaMemcpy(static_cast<char*>(data) + at, block.data(), std::min(block_bytes, bytes - at),
                            cudaMemcpyHostToDevice),
                 "cudaMemcpy");
  }
  ~Buffer() { cudaFree(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cuBLASLt's candidates for the model's products, timed"};
  std::string config_name = "qwen3.5-0.8b", products = "decode", values = "constant", json_path;
  std::vector<std::int64_t> row_counts{1, 16, 64, 256};
  std::vector<std::uint32_t> split_k;
  std::vector<int> stream_splits;
  int candidates = 16, reps = 200;
  app.add_option("--config", config_name);
  app.add_option("--products", products, "decode: y = x W^T; training: also dx = dy W and dW += dy^T x")
      ->check(CLI::IsMember({"decode", "training"}));
  app.add_option("--values", values, "the operands' values: constant (one small value) or random")
      ->check(CLI::IsMember({"constant", "random"}));
  app.add_option("--rows", row_counts, "row counts (decode's batch sizes, training's tokens), comma-separated")
      ->delimiter(',')
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  app.add_option("--candidates", candidates, "heuristic results to time per product")->check(CLI::Range(1, 64));
  app.add_option("--split-k", split_k,
                 "also time each candidate with K split into these numbers of parts, comma-separated")
      ->delimiter(',')
      ->check(CLI::Range(1u, 64u));
  app.add_option("--stream-splits", stream_splits,
                 "also time the weight-streaming kernel over these numbers of K splits (decode's forward products)")
      ->delimiter(',')
      ->check(CLI::IsMember({1, 2, 4, 8}));
  app.add_option("--reps", reps, "timed launches per candidate")->check(CLI::Range(1, 100000));
  app.add_option("--json", json_path);
  CLI11_PARSE(app, argc, argv);

  try {
    const bool training = products == "training", random_values = values == "random";
    const model::Config config = model::load_config(config_name);
    cudaStream_t stream;
    cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
    model::cuda::Gemm gemm(stream);
    const bool stream_kernel_built = !stream_splits.empty() && model::cuda::prepare_stream_gemm();
    cudaEvent_t start, stop;
    cuda_check(cudaEventCreate(&start), "cudaEventCreate");
    cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
    nlohmann::json rows = nlohmann::json::array();
    const std::int64_t loss_chunk = model::default_loss_chunk(Device{DeviceType::cuda, 0});
    for (const Product& p : layer_products(config)) {
      for (const std::int64_t batch_rows : row_counts) {
        const std::int64_t tokens = p.name == "lm_head" && training ? std::min(batch_rows, loss_chunk) : batch_rows;
        for (const Pass& pass : training ? training_passes(p, tokens) : std::vector<Pass>{forward_pass(p, tokens)}) {
          const Shape& s = pass.shape;
          const std::size_t a_bytes = static_cast<std::size_t>(s.M * s.K) * 2,
                            b_bytes = static_cast<std::size_t>(s.K * s.N) * 2,
                            c_bytes = static_cast<std::size_t>(s.M * s.N) * dtype_size(s.c_dtype);
          std::vector<std::unique_ptr<Buffer>> bs;
          for (std::size_t held = 0; held < kBytesBeyondL2 || bs.empty(); held += b_bytes)
            bs.push_back(std::make_unique<Buffer>(b_bytes, random_values));
          const Buffer a(a_bytes, random_values), c(c_bytes, random_values);
          const std::vector<model::cuda::Gemm::Candidate> found =
              gemm.candidates(s.trans_a, s.trans_b, s.M, s.N, s.K, a.data, s.lda(), bs[0]->data, s.ldb(), c.data, s.N,
                              s.c_dtype, candidates, split_k);
          // Mean time of one launch over `reps`, each on the next copy of b, replayed from a CUDA graph as a decode
          // step is (timing the launches themselves would time cuBLASLt's host work at decode's sizes).
          const auto time_us = [&](const auto& product) {
            cudaGraph_t graph;
            cudaGraphExec_t replay;
            cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
            for (int i = 0; i < reps; ++i) product(bs[static_cast<std::size_t>(i) % bs.size()]->data);
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
            row.update({{"product", p.name}, {"pass", pass.name}, {"values", values}, {"rows", tokens}, {"M", s.M}, {"N", s.N},
                        {"K", s.K}, {"us", us}, {"tflops", 2e-6 * static_cast<double>(s.M * s.N) * s.K / us},
                        {"weight_gb_per_s", static_cast<double>(p.out_features * p.in_features * 2) / (us * 1e3)}});
            std::printf("%s\n", row.dump().c_str());
            std::fflush(stdout);
            rows.push_back(std::move(row));
          };
          record({{"kernel", "run"}}, time_us([&](const void* b) {
                   gemm.run(s.trans_a, s.trans_b, s.M, s.N, s.K, 1.f, a.data, s.lda(), b, s.ldb(), s.beta, c.data,
                            s.N, s.c_dtype);
                 }));
          // The kernel's own limits (rows, a whole number of chunks per split, a cluster per tile), not the plan's
          // choice of where it pays.
          const bool streamable = stream_kernel_built && !s.trans_a && s.trans_b &&
                                  s.M <= model::cuda::kStreamMaxRows && s.K % model::cuda::kStreamChunk == 0;
          for (const int splits : streamable ? stream_splits : std::vector<int>{}) {
            const model::cuda::StreamGemmPlan plan{(s.N + model::cuda::kStreamFeatures - 1) / model::cuda::kStreamFeatures,
                                                   splits};
            if (s.K / model::cuda::kStreamChunk < splits) continue;
            record({{"kernel", "stream"}, {"splits", splits}, {"ctas", plan.feature_tiles * splits}},
                   time_us([&](const void* b) {
                     model::cuda::stream_gemm(plan,
                                              {s.M, s.N, s.K, 1.f, a.data, s.lda(), b, s.ldb(), s.beta, c.data,
                                               c.data, s.N, s.c_dtype == DType::f32, true},
                                              stream);
                   }));
          }
          for (const model::cuda::Gemm::Candidate& candidate : found) {
            record({{"kernel", "cublaslt"}, {"heuristic_rank", candidate.heuristic_rank}, {"tile", candidate.tile},
                    {"stages", candidate.stages}, {"split_k", candidate.split_k}, {"reduction", candidate.reduction}},
                   time_us([&](const void* b) {
                     gemm.run_with(candidate.algo, s.trans_a, s.trans_b, s.M, s.N, s.K, 1.f, a.data, s.lda(), b,
                                   s.ldb(), s.beta, c.data, s.N, s.c_dtype);
                   }));
          }
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
