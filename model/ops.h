// The model's kernels: every operation of the hybrid model's forward and backward except the GDN core
// (which is the gdn operator). The model's step (model.cpp) is written once over this interface; each
// device implements it (cpu/cpu_ops.cpp: OpenMP + OpenBLAS, float32 and float64).
//
// Conventions, the same for every operation:
// - Matrices are 2-D TensorViews [rows, cols], row-major with unit column stride; the row stride
//   (strides[0]) may exceed cols, so a slice of columns of a wider matrix is passed without a copy.
// - Dtypes are each implementation's to check: the CPU kernels take one dtype for every tensor of a call
//   (float32 or float64); the GPU kernels take bfloat16 activations and weights with float32 statistics
//   (rstd, lse) and float32 weight gradients.
// - Token ids, targets and sequence offsets are IndexArrays: int32 values in host memory and, for GPU
//   kernels, the same values on the device.
// - A gradient argument named d<x> is overwritten unless the operation says it accumulates; weight
//   gradients (d<weight>) always accumulate (+=), so that gradient accumulation over micro-batches and
//   the tied embedding's two uses need no extra buffer.
// - Packed sequences: cu_seqlens holds N + 1 offsets of the sequences in the T packed rows; operations
//   that mix tokens (convolution, RoPE positions, attention) never cross a sequence boundary.
// - Results are bitwise identical whatever the thread count: every reduction over rows (weight gradients,
//   GQA sums) runs in a fixed order of fixed-size blocks.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>

#include "deltatrain/core/tensor.h"

namespace deltatrain::model {

// int32 values of the batch (token ids, targets, cu_seqlens): always in host memory (CPU kernels and
// validation read them there), and on the GPU for GPU kernels (null for CPU kernels).
struct IndexArray {
  std::span<const std::int32_t> host;
  const std::int32_t* device = nullptr;

  IndexArray() = default;
  IndexArray(std::span<const std::int32_t> values, const std::int32_t* on_device = nullptr)  // NOLINT: a span is one
      : host(values), device(on_device) {}
  template <class Range>
    requires std::convertible_to<const Range&, std::span<const std::int32_t>>
  IndexArray(const Range& values) : host(values) {}  // NOLINT: vectors and arrays of host values
  std::size_t size() const { return host.size(); }
  // Elements [offset, offset + count), on both sides.
  IndexArray slice(std::size_t offset, std::size_t count) const {
    return {host.subspan(offset, count), device ? device + offset : nullptr};
  }
};

// A 2-D view's layout as kernels walk it.
struct MatrixLayout {
  std::int64_t rows = 0, cols = 0, row_stride = 0;
};
inline constexpr std::int64_t kAnyExtent = -1;  // an extent matrix_layout does not check

// Checks a view against the conventions above (2-D, shape [rows, cols] where given, unit column stride, row
// stride >= cols, data present) and returns its layout; InvalidArgument naming `name`. Each implementation
// adds its own device and dtype checks.
MatrixLayout matrix_layout(const TensorView& v, const char* name, std::int64_t rows = kAnyExtent,
                           std::int64_t cols = kAnyExtent);

// A [rows, cols] operand held as up to kMaxParts matrices side by side: part p holds the next cols_p columns
// as a [rows, cols_p] matrix of its own, parts in column order. The conv1d writes its outputs (reads their
// gradients) in this form, so that q, k and v are the GDN operator's dense tensors with no copy in between.
// A single matrix converts to one part.
struct ColumnParts {
  static constexpr int kMaxParts = 3;
  std::array<TensorView, kMaxParts> part{};
  int count = 0;

  ColumnParts(const TensorView& whole) : part{whole}, count(1) {}  // NOLINT: a matrix is one part
  ColumnParts(std::initializer_list<TensorView> parts);             // InvalidArgument past kMaxParts
};

// Checks each part as a matrix of `rows` rows (matrix_layout), their widths adding up to `cols`; InvalidArgument
// naming `name`.
void check_column_parts(const ColumnParts& parts, const char* name, std::int64_t rows, std::int64_t cols);

// The other checks every implementation shares: extents, index values and offsets, which do not depend on the
// device. InvalidArgument names the argument; each implementation adds its own device and dtype checks.

// A count or extent that must be at least 1.
void check_positive(std::int64_t value, const char* name);
// cu_seqlens over `rows` packed rows: from 0 to rows, non-decreasing.
void check_cu_seqlens(std::span<const std::int32_t> cu_seqlens, std::int64_t rows);
// RoPE's extents: heads and head_dim positive, rotary_dim even in [2, head_dim], theta positive.
void check_rope(int heads, int head_dim, int rotary_dim, double theta);

// The gated norm's x [tokens, heads * width] against its weight [width]: the heads a token's row holds.
struct GatedNormLayout {
  std::int64_t tokens, heads, width;
};
GatedNormLayout check_gated_rmsnorm(const TensorView& x, const TensorView& weight);

// A cache [S, L, C] as kernels walk it: the matrix of its S * L contiguous rows of C values.
struct CacheLayout {
  std::int64_t slots = 0, slot_rows = 0, cols = 0;
  std::int64_t rows() const { return slots * slot_rows; }
};

// The arguments of the inference operations below (shapes, cache layouts, index values, lengths), before
// any kernel reads an index.
void check_copy_rows(const TensorView& dst, const IndexArray& dst_rows, const TensorView& src,
                     const IndexArray& src_rows);
CacheLayout check_conv1d_silu_step(const ColumnParts& out, const TensorView& x, const TensorView& weight,
                                   const TensorView& state, const IndexArray& slots);  // the state's layout
void check_rope_at_positions(const TensorView& x, int heads, int head_dim, int rotary_dim, double theta,
                             const IndexArray& positions);
// The attention block's inputs for one inference step (Ops::attention_inputs_step): the projections' outputs, the
// q and k norms' weights, and what the step writes. The matrices holding heads (all but v) have contiguous rows.
struct AttentionInputs {
  TensorView qg;            // q_proj's output, per head [query | gate] [T, Hq * 2 * D]
  TensorView k_raw, v;      // k_proj's and v_proj's outputs [T, Hkv * D]
  TensorView q_norm, k_norm;  // [D], zero-centred
  TensorView q, k;          // written: normed and rotated [T, Hq * D], [T, Hkv * D]
  TensorView gate;          // written: qg's gate halves [T, Hq * D], for sigmoid_gate_forward
  TensorView q_rstd, k_rstd;  // written: the norms' rstd [T * Hq], [T * Hkv] (token-major)
  int q_heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
  double theta = 0, eps = 0;
};

// Ops::gdn_gates_forward's arguments, for the operations that take them with others.
struct GdnGates {
  TensorView g, beta;       // written [T, HV]
  TensorView a, b;          // the projections' [T, HV]
  TensorView a_log, dt_bias;  // [HV]
};

// Attention's head counts: each positive, q_heads a multiple of kv_heads (GQA).
void check_attention_heads(int q_heads, int kv_heads, int head_dim);
CacheLayout check_attention_inputs_step(const AttentionInputs& x, const IndexArray& positions,
                                        const TensorView& k_cache, const TensorView& v_cache,
                                        const IndexArray& cache_rows, const IndexArray& batch_rows);  // k_cache's layout
CacheLayout check_cached_attention(const TensorView& o, const TensorView& q, const TensorView& k_cache,
                                   const TensorView& v_cache, int q_heads, int kv_heads, int head_dim,
                                   const IndexArray& cu_seqlens, const IndexArray& slots,
                                   const IndexArray& lengths);  // the caches' layout

class Ops {
 public:
  virtual ~Ops() = default;

  // c = alpha * op(a) op(b) + beta * c, op(x) = x^T when trans_x. Shapes after op: a [M, K], b [K, N], c [M, N].
  // Linear layers store weights [out, in] (HF's layout): y = x w^T is gemm(false, true, 1, x, w, 0, y);
  // dx = dy w is gemm(false, false, ...); dw += dy^T x is gemm(true, false, 1, dy, x, 1, dw).
  virtual void gemm(bool trans_a, bool trans_b, double alpha, const TensorView& a, const TensorView& b, double beta,
                    const TensorView& c) = 0;
  // d = alpha op(a) op(b) + c, c and d of one shape (d may be c): a product with the residual stream's add in it,
  // which a GPU runs as one launch (cuBLASLt reads c apart from d) instead of a product and an add. The sum is
  // rounded once, where gemm then add rounds the product first.
  virtual void gemm_add(bool trans_a, bool trans_b, double alpha, const TensorView& a, const TensorView& b,
                        const TensorView& c, const TensorView& d) {
    if (c.data != d.data) copy(d, c);
    gemm(trans_a, trans_b, alpha, a, b, 1, d);
  }

  // y = x w^T, plus the residual where given (rounded once, as gemm_add), for a layer's weight w [out, in]: the
  // model's forward products. The work queued just before on the device does not write w, so a GPU may start
  // reading it while that work ends.
  virtual void linear(const TensorView& y, const TensorView& x, const TensorView& w, const TensorView* residual) {
    if (residual != nullptr) return gemm_add(false, true, 1, x, w, *residual, y);
    gemm(false, true, 1, x, w, 0, y);
  }

  // out [T, H] = table[tokens[t]]. dtable [V, H] += dout rows scattered by token (accumulates).
  virtual void embedding_forward(const TensorView& out, const IndexArray& tokens,
                                 const TensorView& table) = 0;
  virtual void embedding_backward(const TensorView& dtable, const IndexArray& tokens,
                                  const TensorView& dout) = 0;

  // RMSNorm over each row of x [R, C]: out = x * rstd * (1 + w) when zero_centred (Qwen's RMSNorm, w zeros at
  // init), else x * rstd * w; rstd [R] = 1 / sqrt(mean(x^2) + eps) is saved for the backward. out may be x itself.
  // Backward: dx (overwritten, or += when accumulate_dx) and dweight (+=) from dout.
  virtual void rmsnorm_forward(const TensorView& out, const TensorView& rstd, const TensorView& x,
                               const TensorView& weight, double eps, bool zero_centred) = 0;
  // x += residual, then rmsnorm_forward of x: the residual stream's add and the norm after it, which a GPU runs as
  // one kernel (a launch and a pass over x fewer). Results equal the two operations'.
  virtual void add_rmsnorm_forward(const TensorView& out, const TensorView& rstd, const TensorView& x,
                                   const TensorView& residual, const TensorView& weight, double eps,
                                   bool zero_centred) {
    add(x, residual);
    rmsnorm_forward(out, rstd, x, weight, eps, zero_centred);
  }
  virtual void rmsnorm_backward(const TensorView& dx, const TensorView& dweight, const TensorView& dout,
                                const TensorView& x, const TensorView& rstd, const TensorView& weight,
                                bool zero_centred, bool accumulate_dx) = 0;

  // The GDN block's output norm, per head: x, z, out [T, heads * dv] with dv = weight's length (any row stride, so
  // that z may be a column block of the fused input projection), each token's dv-wide column groups normalised
  // on their own: out = w * (x * rstd) * silu(z), rstd [T * heads] (token-major) saved. Backward: dx, dz
  // (overwritten), dweight (+=).
  virtual void gated_rmsnorm_forward(const TensorView& out, const TensorView& rstd, const TensorView& x,
                                     const TensorView& z, const TensorView& weight, double eps) = 0;
  virtual void gated_rmsnorm_backward(const TensorView& dx, const TensorView& dz, const TensorView& dweight,
                                      const TensorView& dout, const TensorView& x, const TensorView& z,
                                      const TensorView& rstd, const TensorView& weight) = 0;

  // Causal depthwise convolution over time with SiLU, per packed sequence (zero history at each start):
  // pre[t, c] = sum_{j < W} w[c, j] * x[t - (W - 1) + j, c] (terms before the sequence start are 0),
  // out = silu(pre). x, out [T, C] (out in column parts); weight [C, W] (HF's conv1d.weight [C, 1, W] without the
  // middle axis). Backward: dx (overwritten) and dweight (+=) from dout (in column parts), recomputing pre from x.
  virtual void conv1d_silu_forward(const ColumnParts& out, const TensorView& x, const TensorView& weight,
                                   const IndexArray& cu_seqlens) = 0;
  virtual void conv1d_silu_backward(const TensorView& dx, const TensorView& dweight, const ColumnParts& dout,
                                    const TensorView& x, const TensorView& weight,
                                    const IndexArray& cu_seqlens) = 0;

  // The GDN gates, per token and value head, a and b [T, HV] from the projections, A_log and dt_bias [HV]:
  // g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).
  // Backward: da, db (overwritten), dA_log, ddt_bias (+=) from dg and dbeta.
  virtual void gdn_gates_forward(const TensorView& g, const TensorView& beta, const TensorView& a,
                                 const TensorView& b, const TensorView& a_log, const TensorView& dt_bias) = 0;
  virtual void gdn_gates_backward(const TensorView& da, const TensorView& db, const TensorView& da_log,
                                  const TensorView& ddt_bias, const TensorView& dg, const TensorView& dbeta,
                                  const TensorView& a, const TensorView& b, const TensorView& a_log,
                                  const TensorView& dt_bias) = 0;

  // Partial NeoX RoPE in place on x [T, heads * head_dim]: the first rotary_dim elements of each head are
  // rotated by rotate_half (pairs i and i + rotary_dim / 2) with angle p * theta^(-2i / rotary_dim), p the
  // token's position inside its packed sequence (0 at each start). inverse rotates by -angle: the backward.
  virtual void rope(const TensorView& x, int heads, int head_dim, int rotary_dim, double theta,
                    const IndexArray& cu_seqlens, bool inverse) = 0;

  // Causal attention per packed sequence with GQA: q [T, Hq * D], k and v [T, Hkv * D], query head h reads
  // kv head h / (Hq / Hkv); o [T, Hq * D]; lse [Hq, T] (log-sum-exp of each query's scaled scores) saved.
  // Backward: dq, dk, dv (overwritten) from dout, with o and lse from the forward.
  virtual void attention_forward(const TensorView& o, const TensorView& lse, const TensorView& q,
                                 const TensorView& k, const TensorView& v, int q_heads, int kv_heads,
                                 int head_dim, double scale, const IndexArray& cu_seqlens) = 0;
  virtual void attention_backward(const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                  const TensorView& dout, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse, int q_heads,
                                  int kv_heads, int head_dim, double scale,
                                  const IndexArray& cu_seqlens) = 0;

  // out = x * sigmoid(gate) elementwise ([R, C] each). Backward: dx, dgate (overwritten).
  virtual void sigmoid_gate_forward(const TensorView& out, const TensorView& x, const TensorView& gate) = 0;
  virtual void sigmoid_gate_backward(const TensorView& dx, const TensorView& dgate, const TensorView& dout,
                                     const TensorView& x, const TensorView& gate) = 0;

  // SwiGLU: out = silu(gate) * up ([R, C] each). Backward: dgate, dup (overwritten).
  virtual void swiglu_forward(const TensorView& out, const TensorView& gate, const TensorView& up) = 0;
  virtual void swiglu_backward(const TensorView& dgate, const TensorView& dup, const TensorView& dout,
                               const TensorView& gate, const TensorView& up) = 0;

  // y += x (same shapes): residual adds and gradient sums.
  virtual void add(const TensorView& y, const TensorView& x) = 0;
  // dst = src (same shapes, any row strides): splitting and joining column blocks.
  virtual void copy(const TensorView& dst, const TensorView& src) = 0;
  virtual void fill_zero(const TensorView& x) = 0;

  // Cross-entropy over a chunk of logits [R, V] in place. For each row with targets[r] >= 0:
  // logprob[r] = logits[r, targets[r]] - logsumexp(logits[r]) and, when want_grad, the row is replaced by
  // d(sum_r weights[r] * -logprob[r]) / dlogits = weights[r] * (softmax(logits[r]) - onehot(targets[r])).
  // Rows with a negative target get logprob 0 and, with want_grad, a zero gradient row.
  // weights and logprob are [R] vectors on the kernels' device: float64 on the CPU, float32 on the GPU, where a
  // float64 logprob is computed by log_softmax.cuh's formula (the rollout sampler's); weights is read only with
  // want_grad.
  virtual void cross_entropy(const TensorView& logits, const IndexArray& targets, const TensorView& weights,
                             const TensorView& logprob, bool want_grad) = 0;

  // Inference (rollout): prefill and decode with per-slot caches (deltatrain/model/inference.h). Caches are 3-D
  // contiguous tensors [S, L, C]: S slots of L rows of C values.

  // dst[dst_rows[i]] = src[src_rows[i]] for every i, rows of C values (dst [Rd, C], src [Rs, C], any row
  // strides, any dtype; the dst rows distinct): the K/V and state rows that go into and come out of cache slots.
  virtual void copy_rows(const TensorView& dst, const IndexArray& dst_rows, const TensorView& src,
                         const IndexArray& src_rows) = 0;

  // One token per sequence through conv1d_silu_forward, its history in a cache: x, out [N, C] (out in column
  // parts); sequence n in slot slots[n] of state [S, W - 1, C], which holds its last W - 1 inputs oldest first
  // (zeros before its start). pre[n, c] = sum_{j < W - 1} w[c, j] state[slot, j, c] + w[c, W - 1] x[n, c],
  // out = silu(pre), and the state shifts by one row with x[n] as its newest.
  virtual void conv1d_silu_step(const ColumnParts& out, const TensorView& x, const TensorView& weight,
                                const TensorView& state, const IndexArray& slots) = 0;

  // Decode's GDN inputs: conv1d_silu_step and gdn_gates_forward(gates), which this default runs in turn; a GPU
  // runs them as one kernel (a launch a layer fewer).
  virtual void gdn_inputs_step(const ColumnParts& out, const TensorView& x, const TensorView& weight,
                               const TensorView& state, const IndexArray& slots, const GdnGates& gates);

  // rope (forward) with each row's position given instead of derived from sequence starts: positions [T].
  virtual void rope_at_positions(const TensorView& x, int heads, int head_dim, int rotary_dim, double theta,
                                 const IndexArray& positions) = 0;

  // Decode's attention inputs: q = rope(q_norm(query)) and k = rope(k_norm(k_raw)) per head at the rows' positions
  // [T], then row batch_rows[i] of k and of v into row cache_rows[i] of k_cache and v_cache [S, L, Hkv * D] seen as
  // [S * L] rows (batch_rows: each of the T rows once), and qg's gates into `gate`. qg, k_raw and v may have any row
  // stride (decode's q, k and v are one product's column blocks). Results equal copies of the heads, rmsnorm_forward
  // (zero-centred, in place), rope_at_positions and copy_rows in turn, which this default runs; a GPU runs them as one
  // kernel (a launch a layer, not eight).
  virtual void attention_inputs_step(const AttentionInputs& x, const IndexArray& positions, const TensorView& k_cache,
                                     const TensorView& v_cache, const IndexArray& cache_rows,
                                     const IndexArray& batch_rows);

  // Attention of new query rows over cached keys and values: q, o [R, Hq * D] hold N sequences' new rows
  // (cu_seqlens [N + 1]); sequence n lives in slot slots[n] of k_cache and v_cache [S, L, Hkv * D], which hold
  // its lengths[n] positions, the new rows' keys and values last. Its i-th of m new rows sits at position
  // lengths[n] - m + i and attends to cache positions [0, that position] (GQA as attention_forward).
  virtual void cached_attention(const TensorView& o, const TensorView& q, const TensorView& k_cache,
                                const TensorView& v_cache, int q_heads, int kv_heads, int head_dim, double scale,
                                const IndexArray& cu_seqlens, const IndexArray& slots,
                                const IndexArray& lengths) = 0;
};

// OpenMP threads (0: all available) over OpenBLAS for the products.
// batch_invariant: products whose rows do not depend on the other rows (ModelOptions::batch_invariant).
std::unique_ptr<Ops> make_cpu_ops(int threads, bool batch_invariant = false);
// CUDA kernels and cuBLASLt on `device`, every call ordered on `stream` (a cudaStream_t); Unavailable in a build
// without CUDA. batch_invariant: as make_cpu_ops' (cuda_ops.cpp says how).
std::unique_ptr<Ops> make_cuda_ops(Device device, void* stream, bool batch_invariant = false);

}  // namespace deltatrain::model
