#include "gemm.h"

#include <string>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"

namespace deltatrain::model::cuda {
namespace {

constexpr std::size_t kWorkspaceBytes = 32u << 20;

void check(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw Failure(std::string(call) + " failed: " + cublasLtGetStatusString(status) + " (" +
                std::to_string(static_cast<int>(status)) + ")");
}

// The largest power of two (up to 256) that divides the address: what the kernels may assume.
std::uint32_t alignment(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

// Owns one descriptor of each kind for the length of a call.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~Descriptors() {
    if (preference != nullptr) cublasLtMatmulPreferenceDestroy(preference);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

Gemm::Gemm(cudaStream_t stream) : stream_(stream) {
  check(cublasLtCreate(&handle_), "cublasLtCreate");
  const cudaError_t status = cudaMalloc(&workspace_, kWorkspaceBytes);
  if (status != cudaSuccess) {
    cublasLtDestroy(handle_);
    cuda_check(status, "cudaMalloc (cuBLASLt workspace)");
  }
}

Gemm::~Gemm() {
  // Work queued on the stream may still use the workspace: cudaFree waits for the device first.
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

// Row-major c = op(a) op(b) is column-major c^T = op(b)^T op(a)^T, and a row-major matrix with row stride
// ld is the column-major transpose with leading dimension ld: so cuBLASLt multiplies (b, a) with the same
// transposition flags and m = N, n = M.
void Gemm::run(bool trans_a, bool trans_b, Index M, Index N, Index K, float alpha, const void* a, Index lda,
               const void* b, Index ldb, float beta, void* c, Index ldc, DType c_dtype) {
  const cudaDataType_t c_type = c_dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  const cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our b
  const cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  Descriptors d;
  check(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof op_first),
        "cublasLtMatmulDescSetAttribute");
  check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof op_second),
        "cublasLtMatmulDescSetAttribute");
  // Column-major extents: cuBLASLt's A is [N, K] (stored [K, N] when transposed), B [K, M] (or [M, K]).
  check(cublasLtMatrixLayoutCreate(&d.a, CUDA_R_16BF, trans_b ? K : N, trans_b ? N : K, ldb),
        "cublasLtMatrixLayoutCreate");
  check(cublasLtMatrixLayoutCreate(&d.b, CUDA_R_16BF, trans_a ? M : K, trans_a ? K : M, lda),
        "cublasLtMatrixLayoutCreate");
  check(cublasLtMatrixLayoutCreate(&d.c, c_type, N, M, ldc), "cublasLtMatrixLayoutCreate");

  const Key key{trans_a, trans_b, M, N, K, lda, ldb, ldc, static_cast<std::int64_t>(c_dtype), alignment(a),
                alignment(b), alignment(c)};
  const cublasLtMatmulAlgo_t& algo = algorithm(key, d.op, d.a, d.b, d.c);
  check(cublasLtMatmul(handle_, d.op, &alpha, b, d.a, a, d.b, &beta, c, d.c, c, d.c, &algo, workspace_,
                       kWorkspaceBytes, stream_),
        "cublasLtMatmul");
}

const cublasLtMatmulAlgo_t& Gemm::algorithm(const Key& key, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                            cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c) {
  if (auto found = algorithms_.find(key); found != algorithms_.end()) return found->second;
  Descriptors owner;  // only the preference is created here
  check(cublasLtMatmulPreferenceCreate(&owner.preference), "cublasLtMatmulPreferenceCreate");
  const std::size_t workspace = kWorkspaceBytes;
  check(cublasLtMatmulPreferenceSetAttribute(owner.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                             sizeof workspace),
        "cublasLtMatmulPreferenceSetAttribute");
  // Operand alignments (cuBLASLt's A is our b): column slices of wider matrices may start off 16 bytes.
  const std::uint32_t align_a = static_cast<std::uint32_t>(key[10]), align_b = static_cast<std::uint32_t>(key[9]),
                      align_c = static_cast<std::uint32_t>(key[11]);
  const std::pair<cublasLtMatmulPreferenceAttributes_t, std::uint32_t> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c}};
  for (const auto& [attribute, value] : alignments)
    check(cublasLtMatmulPreferenceSetAttribute(owner.preference, attribute, &value, sizeof value),
          "cublasLtMatmulPreferenceSetAttribute");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  check(cublasLtMatmulAlgoGetHeuristic(handle_, op, a, b, c, c, owner.preference, 1, &result, &found),
        "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0) {
    throw Failure("cublasLtMatmulAlgoGetHeuristic found no algorithm for the product [" + std::to_string(key[2]) +
                  ", " + std::to_string(key[4]) + "] x [" + std::to_string(key[4]) + ", " + std::to_string(key[3]) +
                  "]");
  }
  return algorithms_.emplace(key, result.algo).first->second;
}

}  // namespace deltatrain::model::cuda
