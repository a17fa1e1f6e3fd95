// Matrix products through cuBLASLt: row-major bfloat16 operands with any row strides, float32 compute,
// a bfloat16 or float32 result. One handle, one 32 MiB workspace and one heuristic per shape, kept for the
// object's life; every product runs on the object's stream. Decode's products (a few rows against a weight) run on
// the weight-streaming kernel instead where stream_gemm_plan.h's plan takes them.
//
// Row-invariant products (run's row_invariant; ModelOptions::batch_invariant): a row of the result must not depend
// on how many rows M there are. cuBLASLt's heuristic picks other kernels, split-K among them, for other M; so the
// algorithm is chosen once per shape without M (the heuristic asked at kInvariantRows rows): the best that does
// not split K, or else the best with its split turned off, and used at every M. Each output tile then sums its K
// products in one kernel, in one order, whatever M is.
#pragma once

#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "deltatrain/core/tensor.h"
#include "kernels.h"

namespace deltatrain::model::cuda {

class Gemm {
 public:
  explicit Gemm(cudaStream_t stream);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // c [M, N] = alpha op(a) op(b) + beta c, row-major with row strides lda, ldb, ldc (op(x) = x^T when trans_x;
  // a and b bfloat16, c `c_dtype`: bfloat16 or float32). K > 0. row_invariant: see above (a not transposed).
  // addend: the matrix beta scales when it is not c (the same layout), as cuBLASLt's C apart from its D.
  // b_is_weight: b is a layer's weight, which the kernel before this product on the stream does not write, so that
  // the weight-streaming kernel may start loading it while that kernel ends (kernels.h's StreamGemmCall).
  void run(bool trans_a, bool trans_b, Index M, Index N, Index K, float alpha, const void* a, Index lda,
           const void* b, Index ldb, float beta, void* c, Index ldc, DType c_dtype, bool row_invariant = false,
           const void* addend = nullptr, bool b_is_weight = false);

  // The heuristic's first `count` algorithms for run()'s product (not row-invariant), best first, with the
  // configuration each names; run() takes the first where the weight-streaming kernel does not apply. After each,
  // its variants that split K into each of `split_k` parts (summed in float32 in the workspace, in a fixed order)
  // where cuBLASLt accepts them. For benchmarks that time them (bench/gpu/gemm_candidates.cpp), with run_with().
  struct Candidate {
    cublasLtMatmulAlgo_t algo;
    std::uint32_t tile, stages, split_k, reduction;
    int heuristic_rank;
  };
  std::vector<Candidate> candidates(bool trans_a, bool trans_b, Index M, Index N, Index K, const void* a, Index lda,
                                    const void* b, Index ldb, void* c, Index ldc, DType c_dtype, int count,
                                    const std::vector<std::uint32_t>& split_k = {});
  void run_with(const cublasLtMatmulAlgo_t& algo, bool trans_a, bool trans_b, Index M, Index N, Index K, float alpha,
                const void* a, Index lda, const void* b, Index ldb, float beta, void* c, Index ldc, DType c_dtype,
                const void* addend = nullptr);

 private:
  // What the heuristic's choice depends on: the problem (M = -1: row-invariant) and the operands' alignments.
  using Key = std::array<std::int64_t, 12>;
  const cublasLtMatmulAlgo_t& algorithm(const Key& key);
  // The heuristic's first `count` results for `key` at M rows.
  std::vector<cublasLtMatmulHeuristicResult_t> heuristic(const Key& key, std::int64_t M, int count);
  // `algo` with K split into `parts` (1: not split), if cuBLASLt runs it for `key` at M rows.
  std::optional<cublasLtMatmulAlgo_t> split(const cublasLtMatmulAlgo_t& algo, const Key& key, std::int64_t M,
                                            std::uint32_t parts);

  cudaStream_t stream_;
  int multiprocessors_ = 0;
  bool stream_gemm_ready_ = false;    // the weight-streaming kernel is built for this device (and prepared)
  bool stream_gemm_allowed_ = true;   // DELTATRAIN_STREAM_GEMM is not 0
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, cublasLtMatmulAlgo_t> algorithms_;
};

}  // namespace deltatrain::model::cuda
