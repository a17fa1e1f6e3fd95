#include "gemm.h"

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"

namespace deltatrain::model::cuda {
namespace {

constexpr std::size_t kWorkspaceBytes = 32u << 20;
// The row count a row-invariant product's algorithm is chosen for (gemm.h): a training batch's order.
constexpr std::int64_t kInvariantRows = 4096;
// Heuristic results a row-invariant choice looks through for one that does not split K.
constexpr int kInvariantCandidates = 16;

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

// The operation and layouts of the product `key` describes, at M rows. Row-major c = op(a) op(b) is
// column-major c^T = op(b)^T op(a)^T, and a row-major matrix with row stride ld is the column-major transpose
// with leading dimension ld: so cuBLASLt multiplies (b, a) with the same transposition flags and m = N, n = M.
void describe(Descriptors& d, const std::array<std::int64_t, 12>& key, std::int64_t M) {
  const bool trans_a = key[0] != 0, trans_b = key[1] != 0;
  const std::int64_t N = key[3], K = key[4], lda = key[5], ldb = key[6], ldc = key[7];
  const cudaDataType_t c_type = key[8] == static_cast<std::int64_t>(DType::f32) ? CUDA_R_32F : CUDA_R_16BF;
  const cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our b
  const cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
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
}

std::uint32_t config_attribute(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute) {
  std::uint32_t value = 0;
  std::size_t written = 0;
  check(cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof value, &written),
        "cublasLtMatmulAlgoConfigGetAttribute");
  return value;
}

}  // namespace

Gemm::Gemm(cudaStream_t stream) : stream_(stream) {
  static const char* const stream_setting = std::getenv("DELTATRAIN_STREAM_GEMM");  // read once
  stream_gemm_allowed_ = switch_setting("DELTATRAIN_STREAM_GEMM", stream_setting);
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  stream_gemm_ready_ = prepare_stream_gemm();
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

namespace {

// What a product's algorithm choice depends on (Gemm::Key): the problem (M = -1: row-invariant) and the operands'
// alignments.
std::array<std::int64_t, 12> key_of(bool trans_a, bool trans_b, Index M, Index N, Index K, const void* a, Index lda,
                                    const void* b, Index ldb, const void* c, Index ldc, DType c_dtype, bool row_invariant) {
  return {trans_a, trans_b, row_invariant ? -1 : M, N, K, lda, ldb, ldc, static_cast<std::int64_t>(c_dtype),
          alignment(a), alignment(b), alignment(c)};
}

std::string product_name(std::int64_t M, const std::array<std::int64_t, 12>& key) {
  return "[" + std::to_string(M) + ", " + std::to_string(key[4]) + "] x [" + std::to_string(key[4]) + ", " +
         std::to_string(key[3]) + "]";
}

}  // namespace

void Gemm::run(bool trans_a, bool trans_b, Index M, Index N, Index K, float alpha, const void* a, Index lda,
               const void* b, Index ldb, float beta, void* c, Index ldc, DType c_dtype, bool row_invariant,
               const void* addend, bool b_is_weight) {
  if (addend == nullptr) addend = c;
  StreamGemmProblem problem;
  problem.trans_a = trans_a;
  problem.trans_b = trans_b;
  problem.M = M;
  problem.N = N;
  problem.K = K;
  problem.lda = lda;
  problem.ldb = ldb;
  problem.align_a = alignment(a);
  problem.align_b = alignment(b);
  problem.row_invariant = row_invariant;
  problem.device_ready = stream_gemm_ready_;
  problem.allowed = stream_gemm_allowed_;
  if (const std::optional<StreamGemmPlan> plan = plan_stream_gemm(problem, multiprocessors_)) {
    stream_gemm(*plan,
                {M, N, K, alpha, a, lda, b, ldb, beta, addend, c, ldc, c_dtype == DType::f32, b_is_weight},
                stream_);
    return;
  }
  // The algorithm must take both c and the addend: the key holds the lesser alignment of the two.
  const void* aligned_c = alignment(addend) < alignment(c) ? addend : c;
  const cublasLtMatmulAlgo_t& algo =
      algorithm(key_of(trans_a, trans_b, M, N, K, a, lda, b, ldb, aligned_c, ldc, c_dtype, row_invariant));
  run_with(algo, trans_a, trans_b, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc, c_dtype, addend);
}

void Gemm::run_with(const cublasLtMatmulAlgo_t& algo, bool trans_a, bool trans_b, Index M, Index N, Index K,
                    float alpha, const void* a, Index lda, const void* b, Index ldb, float beta, void* c, Index ldc,
                    DType c_dtype, const void* addend) {
  if (addend == nullptr) addend = c;
  Descriptors d;
  describe(d, key_of(trans_a, trans_b, M, N, K, a, lda, b, ldb, c, ldc, c_dtype, false), M);
  check(cublasLtMatmul(handle_, d.op, &alpha, b, d.a, a, d.b, &beta, addend, d.c, c, d.c, &algo, workspace_,
                       kWorkspaceBytes, stream_),
        "cublasLtMatmul");
}

std::vector<Gemm::Candidate> Gemm::candidates(bool trans_a, bool trans_b, Index M, Index N, Index K, const void* a,
                                              Index lda, const void* b, Index ldb, void* c, Index ldc,
                                              DType c_dtype, int count, const std::vector<std::uint32_t>& split_k) {
  const Key key = key_of(trans_a, trans_b, M, N, K, a, lda, b, ldb, c, ldc, c_dtype, false);
  std::vector<Candidate> out;
  const auto add = [&](const cublasLtMatmulAlgo_t& algo, int rank) {
    out.push_back({algo, config_attribute(algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                   config_attribute(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                   config_attribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                   config_attribute(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME), rank});
  };
  int rank = 0;
  for (const cublasLtMatmulHeuristicResult_t& result : heuristic(key, M, count)) {
    add(result.algo, rank);
    for (const std::uint32_t parts : split_k)
      if (const std::optional<cublasLtMatmulAlgo_t> variant = split(result.algo, key, M, parts)) add(*variant, rank);
    ++rank;
  }
  return out;
}

std::optional<cublasLtMatmulAlgo_t> Gemm::split(const cublasLtMatmulAlgo_t& algo, const Key& key, std::int64_t M,
                                                std::uint32_t parts) {
  cublasLtMatmulAlgo_t variant = algo;
  const std::uint32_t reduction = parts > 1 ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE : CUBLASLT_REDUCTION_SCHEME_NONE;
  check(cublasLtMatmulAlgoConfigSetAttribute(&variant, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &parts, sizeof parts),
        "cublasLtMatmulAlgoConfigSetAttribute");
  check(cublasLtMatmulAlgoConfigSetAttribute(&variant, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                             sizeof reduction),
        "cublasLtMatmulAlgoConfigSetAttribute");
  Descriptors d;
  describe(d, key, M);
  cublasLtMatmulHeuristicResult_t checked{};
  if (cublasLtMatmulAlgoCheck(handle_, d.op, d.a, d.b, d.c, d.c, &variant, &checked) != CUBLAS_STATUS_SUCCESS ||
      checked.workspaceSize > kWorkspaceBytes)
    return std::nullopt;
  return variant;
}

std::vector<cublasLtMatmulHeuristicResult_t> Gemm::heuristic(const Key& key, std::int64_t M, int count) {
  Descriptors d;
  describe(d, key, M);
  check(cublasLtMatmulPreferenceCreate(&d.preference), "cublasLtMatmulPreferenceCreate");
  const std::size_t workspace = kWorkspaceBytes;
  check(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
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
    check(cublasLtMatmulPreferenceSetAttribute(d.preference, attribute, &value, sizeof value),
          "cublasLtMatmulPreferenceSetAttribute");
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<std::size_t>(count));
  int found = 0;
  check(cublasLtMatmulAlgoGetHeuristic(handle_, d.op, d.a, d.b, d.c, d.c, d.preference, count, results.data(), &found),
        "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0)
    throw Failure("cublasLtMatmulAlgoGetHeuristic found no algorithm for the product " + product_name(M, key));
  results.resize(static_cast<std::size_t>(found));
  return results;
}

const cublasLtMatmulAlgo_t& Gemm::algorithm(const Key& key) {
  if (auto found = algorithms_.find(key); found != algorithms_.end()) return found->second;
  if (key[2] >= 0) return algorithms_.emplace(key, heuristic(key, key[2], 1).front().algo).first->second;
  // Row-invariant: chosen at kInvariantRows rows, whatever the call's M.
  const std::vector<cublasLtMatmulHeuristicResult_t> results = heuristic(key, kInvariantRows, kInvariantCandidates);
  for (const cublasLtMatmulHeuristicResult_t& result : results)
    if (config_attribute(result.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) <= 1)
      return algorithms_.emplace(key, result.algo).first->second;
  const std::optional<cublasLtMatmulAlgo_t> unsplit = split(results.front().algo, key, kInvariantRows, 1);
  if (!unsplit)
    throw Failure("cuBLASLt has no algorithm for the row-invariant product " + product_name(kInvariantRows, key) +
                  " that does not split K");
  return algorithms_.emplace(key, *unsplit).first->second;
}

}  // namespace deltatrain::model::cuda
