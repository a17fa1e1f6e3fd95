// Which products run on the weight-streaming kernel (stream_gemm.cu) and how it divides them: the one decision,
// made here from the product's shape and the GPU's SM count, so that Gemm::run only dispatches on it. Plain C++
// (no CUDA types), so it is tested on machines without a GPU.
//
// The kernel is for decode's narrow layer products: up to 64 activation rows (a decode step's batch) against a weight
// of at most ~2k output features (out_proj, o_proj, the MLP's down, k and v), where the time is the weight's bytes
// over the memory bandwidth and cuBLASLt's choices leave most SMs idle or split K into extra reductions: on the H200
// it takes 3.8 us where cuBLASLt takes 12.2 (out_proj at one row), 5.4 where it takes 5.35 (out_proj at 64 rows)
// and 3.3 where it takes 4.0 (k_proj at 64 rows), and inside decode's graph it requests its weight while the kernel
// before it ends, which cuBLASLt cannot. Wider weights stream faster through cuBLASLt's tiles (the GDN input
// projections 2.6 TB/s, the lm_head 4.1; bench/NOTES.md, Rollout). The plan never comes from timings (a rollout
// must be reproducible), and where it applies nothing in it depends on M, so a row's result does not depend on how
// many rows the call has.
#pragma once

#include <cstdint>
#include <optional>

namespace deltatrain::model::cuda {

constexpr int kStreamFeatures = 64;  // weight rows (output features) a CTA computes: one wgmma's M
constexpr int kStreamChunk = 64;     // K elements a pipeline stage holds
constexpr int kStreamMaxRows = 64;   // activation rows the kernel takes: one wgmma's N
constexpr int kStreamStages = 5;     // pipeline depth: 5 x 16 KB and a 17 KB receive buffer, two CTAs an SM
constexpr int kStreamMaxSplits = 8;  // CTAs of a cluster over one tile's K (the portable cluster size)
constexpr int kStreamCtasPerSm = 2;

// Gemm::run's product c [M, N] = alpha op(a) op(b) + beta c, as much of it as the choice depends on.
struct StreamGemmProblem {
  bool trans_a = false, trans_b = true;
  std::int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0;
  std::uint32_t align_a = 0, align_b = 0;  // the largest powers of two (bytes) dividing a's and b's addresses
  bool row_invariant = false;  // Gemm::run's row_invariant: cuBLASLt's fixed choice, at every M
  bool device_ready = false;   // the kernel is built for this device (sm_90a: wgmma and clusters)
  bool allowed = true;         // DELTATRAIN_STREAM_GEMM is not 0 (core/system.h's switch_setting)
};

struct StreamGemmPlan {
  std::int64_t feature_tiles;  // ceil(N / kStreamFeatures)
  int splits;                  // CTAs per feature tile (one cluster), each over a contiguous run of K chunks
  friend bool operator==(const StreamGemmPlan&, const StreamGemmPlan&) = default;
};

// The plan for `p` on a GPU of `multiprocessors` SMs, or nothing where the kernel does not apply or does not pay:
// a or b transposed other than as x [M, K] times W [N, K]^T, more than kStreamMaxRows rows, K not a multiple of
// kStreamChunk, operands or row strides not 16-byte aligned, more feature tiles than fill one wave of
// kStreamCtasPerSm per SM with kStreamMaxSplits splits each, row-invariant calls, devices it is not built for, or
// switched off. Any beta: the kernel adds beta c in its epilogue.
std::optional<StreamGemmPlan> plan_stream_gemm(const StreamGemmProblem& p, int multiprocessors);

}  // namespace deltatrain::model::cuda
