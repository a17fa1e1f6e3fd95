// The GPU model's kernel launchers (one .cu file per kind of op), called by cuda_ops.cpp after it has
// validated every argument: they take plain device pointers and extents, launch on `stream` and never
// synchronise the host. A launch error is a Failure.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "stream_gemm_plan.h"

namespace deltatrain::model::cuda {

using Index = std::int64_t;

// A validated device matrix: rows x cols elements, row r at data + r * ld (elements of the call's dtype).
struct Matrix {
  void* data = nullptr;
  Index rows = 0, cols = 0, ld = 0;
};

// Matrices side by side by columns (ops.h's ColumnParts): part p holds the next part[p].cols columns.
struct MatrixParts {
  static constexpr int kMaxParts = 3;
  Matrix part[kMaxParts] = {};
  int count = 0;
};

// Packed-sequence offsets: `count` + 1 int32 values on the device.
struct Sequences {
  const std::int32_t* cu = nullptr;
  int count = 0;
};

// Device memory for temporaries (two-pass partial sums, the embedding sort, attention's score matrices):
// one buffer per Ops object, grown stream-ordered when a call needs more than it holds, so that after a
// first step of the largest shapes nothing is allocated and calls can be captured in a CUDA graph.
class Workspace {
 public:
  explicit Workspace(cudaStream_t stream) : stream_(stream) {}
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  // At least `bytes` bytes, 256-byte aligned, valid until the next reserve; the contents are undefined.
  std::byte* reserve(std::size_t bytes);

 private:
  cudaStream_t stream_;
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Carves 256-byte aligned regions out of one reservation: first count the sizes, then take the pointers
// in the same order from the reserved base.
class Carver {
 public:
  template <class T>
  void add(Index count) {
    bytes_ += round_up(static_cast<std::size_t>(count) * sizeof(T));
  }
  std::size_t bytes() const { return bytes_; }

  explicit Carver(std::byte* base = nullptr) : base_(base) {}
  template <class T>
  T* take(Index count) {
    T* p = reinterpret_cast<T*>(base_ + offset_);
    offset_ += round_up(static_cast<std::size_t>(count) * sizeof(T));
    return p;
  }

 private:
  static std::size_t round_up(std::size_t n) { return (n + 255) / 256 * 256; }
  std::byte* base_;
  std::size_t bytes_ = 0, offset_ = 0;
};

// Throws Failure naming the kernel when its launch failed.
void check_launch(const char* kernel);
// The current device's shared memory a CTA may opt in to.
int shared_memory_per_block();
// Unavailable naming `kernel` when the `bytes` of shared memory a CTA that `what` needs exceed
// shared_memory_per_block().
void require_shared_memory(const char* kernel, std::size_t bytes, const std::string& what);

// ---- elementwise.cu (bfloat16 matrices of one shape) ----
void sigmoid_gate_forward(Matrix out, Matrix x, Matrix gate, cudaStream_t stream);
void sigmoid_gate_backward(Matrix dx, Matrix dgate, Matrix dout, Matrix x, Matrix gate, cudaStream_t stream);
void swiglu_forward(Matrix out, Matrix gate, Matrix up, cudaStream_t stream);
void swiglu_backward(Matrix dgate, Matrix dup, Matrix dout, Matrix gate, Matrix up, cudaStream_t stream);
void add(Matrix y, Matrix x, cudaStream_t stream);

// ---- embedding.cu: table, out, dout bfloat16; dtable float32 ----
void embedding_forward(Matrix out, const std::int32_t* tokens, Matrix table, cudaStream_t stream);
void embedding_backward(Matrix dtable, const std::int32_t* tokens, Matrix dout, Workspace& workspace,
                        cudaStream_t stream);

// ---- norms.cu: x, z, out, dx, dz, dout, weight bfloat16; rstd float32; dweight float32 (+=) ----
// With residual.data: x += residual first (ops.h's add_rmsnorm_forward).
void rmsnorm_forward(Matrix out, float* rstd, Matrix x, Matrix residual, const void* weight, float eps,
                     bool zero_centred, cudaStream_t stream);
void rmsnorm_backward(Matrix dx, float* dweight, Matrix dout, Matrix x, const float* rstd, const void* weight,
                      bool zero_centred, bool accumulate_dx, Workspace& workspace, cudaStream_t stream);
// The gated norm over x, z, out [T, heads * width] (width = x.cols / heads), each head's columns on their own.
void gated_rmsnorm_forward(Matrix out, float* rstd, Matrix x, Matrix z, Index heads, const void* weight, float eps,
                           cudaStream_t stream);
void gated_rmsnorm_backward(Matrix dx, Matrix dz, float* dweight, Matrix dout, Matrix x, Matrix z, Index heads,
                            const float* rstd, const void* weight, Workspace& workspace, cudaStream_t stream);

// ---- sequence.cu: ops along packed sequences. x, out, dx, dout, weight bfloat16; dweight float32 (+=) ----
// out and dout in column parts (x.cols columns in all).
void conv1d_silu_forward(MatrixParts out, Matrix x, Matrix weight, Sequences sequences, cudaStream_t stream);
void conv1d_silu_backward(Matrix dx, Matrix dweight, MatrixParts dout, Matrix x, Matrix weight, Sequences sequences,
                          Workspace& workspace, cudaStream_t stream);
void rope(Matrix x, int heads, int head_dim, int rotary_dim, float theta, Sequences sequences, bool inverse,
          cudaStream_t stream);
// The decode forms (ops.h): rope at the given positions [x.rows]; the conv over each sequence's history in
// `state`, the matrix of the cache's S * (W - 1) rows, slot slots[n] for row n of x.
void rope_at_positions(Matrix x, int heads, int head_dim, int rotary_dim, float theta, const std::int32_t* positions,
                       cudaStream_t stream);
// The GDN gates' forward over a, b [rows, H] (gates.cu says the formula): g, beta float32; a, b, a_log and dt_bias
// [H] bfloat16. Empty (a.rows == 0) where a launch has none to compute.
struct GatesForward {
  Matrix g, beta, a, b;
  const void* a_log = nullptr;
  const void* dt_bias = nullptr;
};
// `gates` are computed by the same launch (ops.h's gdn_inputs_step) unless empty.
void conv1d_silu_step(MatrixParts out, Matrix x, Matrix weight, Matrix state, const std::int32_t* slots,
                      const GatesForward& gates, cudaStream_t stream);

// ---- decode.cu: the rest of the inference ops ----
// dst row dst_rows[i] = src row src_rows[i] for i < count, rows of dst.cols elements of `element_size` bytes
// (any dtype: the bytes move).
void copy_rows(Matrix dst, const std::int32_t* dst_rows, Matrix src, const std::int32_t* src_rows, Index count,
               std::size_t element_size, cudaStream_t stream);
// ops.h's attention_inputs_step as one kernel, where attention_plan.h's fuse_attention_inputs takes it: the matrices
// bfloat16 (the caches as the matrices of their rows), rstd float32, the norms' weights bfloat16 [head_dim].
struct AttentionInputsStep {
  Matrix qg, k_raw, v, q, k, gate, k_cache, v_cache;
  float* q_rstd = nullptr;
  float* k_rstd = nullptr;
  const void* q_norm = nullptr;
  const void* k_norm = nullptr;
  const std::int32_t* positions = nullptr;   // [rows]
  const std::int32_t* cache_rows = nullptr;  // [rows], with batch_rows
  const std::int32_t* batch_rows = nullptr;
  int q_heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
  float theta = 0.f, eps = 0.f;
};
void attention_inputs_step(const AttentionInputsStep& p, Index rows, cudaStream_t stream);
// Attention of q's rows (bfloat16 [R, Hq * D]) over the caches' rows (the matrices of their S * slot_rows rows of
// Hkv * D), per ops.h's cached_attention; float32 scores and softmax, o bfloat16. head_dim <= kMaxCachedHeadDim.
inline constexpr int kMaxCachedHeadDim = 512;
// prepare_cached_attention: raises the kernel's shared-memory limit on the current device (once per Ops).
void prepare_cached_attention();
void cached_attention(Matrix o, Matrix q, Matrix k_cache, Matrix v_cache, Index slot_rows, int q_heads, int kv_heads,
                      int head_dim, float scale, Sequences sequences, const std::int32_t* slots,
                      const std::int32_t* lengths, cudaStream_t stream);
// Causal attention per packed sequence (ops.h's attention_forward, lse [Hq, R] float32) by cached_attention's
// kernel over the batch's own keys: each row computed exactly as a decode step computes it (batch-invariant mode).
void row_attention(Matrix o, Matrix lse, Matrix q, Matrix k, Matrix v, int q_heads, int kv_heads, int head_dim,
                   float scale, Sequences sequences, cudaStream_t stream);

// ---- gates.cu: a, b, da, db, a_log, dt_bias bfloat16; g, beta, dg, dbeta float32; da_log, ddt_bias float32 (+=)
void gdn_gates_forward(const GatesForward& gates, cudaStream_t stream);
void gdn_gates_backward(Matrix da, Matrix db, float* da_log, float* ddt_bias, Matrix dg, Matrix dbeta, Matrix a,
                        Matrix b, const void* a_log, const void* dt_bias, Workspace& workspace,
                        cudaStream_t stream);

// ---- cross_entropy.cu: logits bfloat16 (in place), weights and logprob float32 (logprob may be null) ----
void cross_entropy(Matrix logits, const std::int32_t* targets, const float* weights, float* logprob, bool want_grad,
                   cudaStream_t stream);
// logprob [R] float64 = log softmax(logits[r])[targets[r]] by log_softmax.cuh's formula (0 where targets[r] < 0).
void token_logprobs(Matrix logits, const std::int32_t* targets, double* logprob, cudaStream_t stream);

// ---- attention.cu: the row kernels of the unfused attention (attention.cpp sequences them) ----
// Rows r of a [groups * length, length] score block: query i = r % length of head j = r / length, whose lse
// is at lse[j * lse_ld + i]. Keys after i are masked.
struct ScoreRows {
  Index length = 0, groups = 0;
  float* lse = nullptr;
  Index lse_ld = 0;
};
// P = softmax(S) row by row (S already scaled), writing P (bfloat16, zero where masked) and lse.
void causal_softmax(void* p, const float* s, ScoreRows rows, cudaStream_t stream);
// P = exp(S - lse) (bfloat16, zero where masked), from the forward's lse.
void causal_probabilities(void* p, const float* s, ScoreRows rows, cudaStream_t stream);
// dS = P * (dP - delta[r]) in place over P (bfloat16).
void softmax_backward(void* p_to_ds, const float* dp, const float* delta, ScoreRows rows,
                      cudaStream_t stream);
// Head columns [head * head_dim, (head + 1) * head_dim) of `groups` consecutive heads of a [length, *] matrix
// to and from a contiguous [groups, length, head_dim] block.
void gather_heads(void* dst, Matrix src, int groups, int head_dim, cudaStream_t stream);
void scatter_heads(Matrix dst, const void* src, int groups, int head_dim, cudaStream_t stream);
// delta[j * length + i] = sum_d dout[i, j * head_dim + d] * o[i, j * head_dim + d] for `groups` heads.
void attention_delta(float* delta, Matrix dout, Matrix o, int groups, int head_dim, cudaStream_t stream);

// ---- attention.cu: around cuDNN's fused attention (cudnn_attention.cpp) ----
// cuDNN's ragged offsets in elements for up to kMaxRaggedTensors packed tensors of row stride ld[j]:
// offsets[j * (batch + 1) + n] = cu[min(n, count)] * ld[j]; lengths[n] = sequence n's length, 0 for the
// padding sequences count <= n < batch. One block; the values must fit int32 (the caller checks).
inline constexpr int kMaxRaggedTensors = 8;
struct RaggedStrides {
  Index ld[kMaxRaggedTensors] = {};
  int tensors = 0;
};
void ragged_offsets(std::int32_t* offsets, std::int32_t* lengths, RaggedStrides strides, Sequences sequences, int batch,
                    cudaStream_t stream);
// cuDNN's statistics [batch, Hq, length] (float32, the log-sum-exp of each query's scaled scores) to and from
// lse [Hq, T] (Hq = lse.rows): lse[h, cu[n] + s] <-> stats[(n Hq + h) length + s] for s below n's length.
void lse_from_stats(Matrix lse, const float* stats, Sequences sequences, Index length, cudaStream_t stream);
void stats_from_lse(float* stats, Matrix lse, Sequences sequences, Index length, cudaStream_t stream);

// ---- stream_gemm.cu: decode's products, as plan_stream_gemm divides them.
// y [M, N] = alpha x [M, K] w [N, K]^T + beta c, x and w bfloat16, y bfloat16 or float32; c is y's layout and dtype
// (y itself where null; not read where beta is 0), the sum rounded once. weight_settled: the caller's promise that
// the kernel before this one on the stream does not write w, so that the product may start loading it while that
// kernel ends (a layer's weight in a forward; never an activation). prepare_stream_gemm: whether the kernel is
// built for the current device, and if so its shared memory allowed there (once per device, before stream_gemm
// runs on it).
struct StreamGemmCall {
  Index M, N, K;
  float alpha;
  const void* x;
  Index ldx;
  const void* w;
  Index ldw;
  float beta;
  const void* c;
  void* y;
  Index ldy;
  bool y_float;
  bool weight_settled;
};
bool prepare_stream_gemm();
void stream_gemm(const StreamGemmPlan& plan, const StreamGemmCall& call, cudaStream_t stream);

}  // namespace deltatrain::model::cuda
