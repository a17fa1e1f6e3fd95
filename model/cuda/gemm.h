// Matrix products through cuBLASLt: row-major bfloat16 operands with any row strides, float32 compute,
// a bfloat16 or float32 result. One handle, one 32 MiB workspace and one heuristic per shape, kept for the
// object's life; every product runs on the object's stream.
#pragma once

#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <map>

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
  // a and b bfloat16, c `c_dtype`: bfloat16 or float32). K > 0.
  void run(bool trans_a, bool trans_b, Index M, Index N, Index K, float alpha, const void* a, Index lda,
           const void* b, Index ldb, float beta, void* c, Index ldc, DType c_dtype);

 private:
  // What the heuristic's choice depends on: the problem and the operands' alignments.
  using Key = std::array<std::int64_t, 12>;
  const cublasLtMatmulAlgo_t& algorithm(const Key& key, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                        cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c);

  cudaStream_t stream_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, cublasLtMatmulAlgo_t> algorithms_;
};

}  // namespace deltatrain::model::cuda
