// The GPU implementation of the model's kernels (model/ops.h): every argument is validated on the host (here,
// and for the shared checks in ops.cpp) before anything is launched; the launchers (kernels.h) and the products
// (gemm.h, attention.h) then run on the object's stream without synchronising the host.
//
// Dtypes: bfloat16 parameters and activations, float32 statistics (rstd, lse), gates (g, beta), loss
// weights and log-probabilities, and float32 weight gradients; computation in float32.
// Determinism: no floating-point atomics anywhere (cuDNN's attention backward runs its deterministic
// algorithm); weight gradients are sums over fixed blocks of rows added in block order (common.cuh), the
// embedding's by runs of sorted tokens (embedding.cu).
// Batch invariance (ModelOptions::batch_invariant): the products' algorithms do not depend on the number of rows
// (gemm.h's row_invariant; attention's inner products need not), attention runs decode's kernel over the
// batch's own keys (row_attention), and log-probabilities come in float64 from the formula the rollout's
// sampler uses (log_softmax.cuh); every other kernel computes a row from that row alone already.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <string>

#include "attention.h"
#include "attention_plan.h"
#include "cudnn_attention.h"
#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "gemm.h"
#include "kernels.h"
#include "ops.h"

namespace deltatrain::model {
namespace {

using cuda::Index;
using cuda::Matrix;
using cuda::MatrixParts;

constexpr Index kAny = kAnyExtent;
constexpr DType bf16 = DType::bf16, f32 = DType::f32;

class CudaOps final : public Ops {
 public:
  CudaOps(Device device, cudaStream_t stream, bool batch_invariant)
      : device_(device), stream_(stream), batch_invariant_(batch_invariant), gemm_(stream), workspace_(stream) {
    const CudaDeviceGuard guard(device_.index);
    cuda::prepare_cached_attention();
  }

  void gemm(bool trans_a, bool trans_b, double alpha, const TensorView& a, const TensorView& b, double beta,
            const TensorView& c) override {
    product(trans_a, trans_b, alpha, a, b, beta, nullptr, c, "c", false);
  }

  void gemm_add(bool trans_a, bool trans_b, double alpha, const TensorView& a, const TensorView& b,
                const TensorView& c, const TensorView& d) override {
    product_add(trans_a, trans_b, alpha, a, b, c, d, false);
  }

  void linear(const TensorView& y, const TensorView& x, const TensorView& w, const TensorView* residual) override {
    if (residual != nullptr) return product_add(false, true, 1, x, w, *residual, y, true);
    product(false, true, 1, x, w, 0, nullptr, y, "y", true);
  }

  void embedding_forward(const TensorView& out, const IndexArray& tokens, const TensorView& table) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix tab = matrix(table, "table", bf16);
    const Matrix o = matrix(out, "out", bf16, static_cast<Index>(tokens.size()), tab.cols);
    cuda::embedding_forward(o, token_ids(tokens, tab.rows), tab, stream_);
  }

  void embedding_backward(const TensorView& dtable, const IndexArray& tokens, const TensorView& dout) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix tab = matrix(dtable, "dtable", f32);
    const Matrix d = matrix(dout, "dout", bf16, static_cast<Index>(tokens.size()), tab.cols);
    cuda::embedding_backward(tab, token_ids(tokens, tab.rows), d, workspace_, stream_);
  }

  void rmsnorm_forward(const TensorView& out, const TensorView& rstd, const TensorView& x, const TensorView& weight,
                       double eps, bool zero_centred) override {
    norm_forward(out, rstd, x, nullptr, weight, eps, zero_centred);
  }

  void add_rmsnorm_forward(const TensorView& out, const TensorView& rstd, const TensorView& x,
                           const TensorView& residual, const TensorView& weight, double eps,
                           bool zero_centred) override {
    norm_forward(out, rstd, x, &residual, weight, eps, zero_centred);
  }

  void rmsnorm_backward(const TensorView& dx, const TensorView& dweight, const TensorView& dout, const TensorView& x,
                        const TensorView& rstd, const TensorView& weight, bool zero_centred,
                        bool accumulate_dx) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix xm = matrix(x, "x", bf16);
    const Index R = xm.rows, C = xm.cols;
    check_positive(C, "x's columns");
    cuda::rmsnorm_backward(matrix(dx, "dx", bf16, R, C), vector<float>(dweight, "dweight", f32, C),
                           matrix(dout, "dout", bf16, R, C), xm, vector<const float>(rstd, "rstd", f32, R),
                           vector<const void>(weight, "weight", bf16, C), zero_centred, accumulate_dx, workspace_,
                           stream_);
  }

  void gated_rmsnorm_forward(const TensorView& out, const TensorView& rstd, const TensorView& x, const TensorView& z,
                             const TensorView& weight, double eps) override {
    const CudaDeviceGuard guard(device_.index);
    const GatedNormLayout l = check_gated_rmsnorm(x, weight);
    const Index T = l.tokens, C = l.heads * l.width;
    cuda::gated_rmsnorm_forward(matrix(out, "out", bf16, T, C), vector<float>(rstd, "rstd", f32, T * l.heads),
                                matrix(x, "x", bf16, T, C), matrix(z, "z", bf16, T, C), l.heads,
                                vector<const void>(weight, "weight", bf16, l.width), static_cast<float>(eps), stream_);
  }

  void gated_rmsnorm_backward(const TensorView& dx, const TensorView& dz, const TensorView& dweight,
                              const TensorView& dout, const TensorView& x, const TensorView& z, const TensorView& rstd,
                              const TensorView& weight) override {
    const CudaDeviceGuard guard(device_.index);
    const GatedNormLayout l = check_gated_rmsnorm(x, weight);
    const Index T = l.tokens, C = l.heads * l.width;
    cuda::gated_rmsnorm_backward(matrix(dx, "dx", bf16, T, C), matrix(dz, "dz", bf16, T, C),
                                 vector<float>(dweight, "dweight", f32, l.width), matrix(dout, "dout", bf16, T, C),
                                 matrix(x, "x", bf16, T, C), matrix(z, "z", bf16, T, C), l.heads,
                                 vector<const float>(rstd, "rstd", f32, T * l.heads),
                                 vector<const void>(weight, "weight", bf16, l.width), workspace_, stream_);
  }

  void conv1d_silu_forward(const ColumnParts& out, const TensorView& x, const TensorView& weight,
                           const IndexArray& cu_seqlens) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix xm = matrix(x, "x", bf16);
    const Matrix w = matrix(weight, "weight", bf16, xm.cols, kAny);
    check_positive(w.cols, "weight's width");
    cuda::conv1d_silu_forward(matrix_parts(out, "out", bf16, xm.rows, xm.cols), xm, w,
                              sequences(cu_seqlens, xm.rows), stream_);
  }

  void conv1d_silu_backward(const TensorView& dx, const TensorView& dweight, const ColumnParts& dout,
                            const TensorView& x, const TensorView& weight, const IndexArray& cu_seqlens) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix xm = matrix(x, "x", bf16);
    const Matrix w = matrix(weight, "weight", bf16, xm.cols, kAny);
    check_positive(w.cols, "weight's width");
    const Matrix dw = matrix(dweight, "dweight", f32, w.rows, w.cols);
    if (dw.rows > 1 && dw.ld != dw.cols) throw InvalidArgument("dweight", "must be contiguous");
    cuda::conv1d_silu_backward(matrix(dx, "dx", bf16, xm.rows, xm.cols), dw,
                               matrix_parts(dout, "dout", bf16, xm.rows, xm.cols), xm, w,
                               sequences(cu_seqlens, xm.rows), workspace_, stream_);
  }

  void gdn_gates_forward(const TensorView& g, const TensorView& beta, const TensorView& a, const TensorView& b,
                         const TensorView& a_log, const TensorView& dt_bias) override {
    const CudaDeviceGuard guard(device_.index);
    cuda::gdn_gates_forward(gates_forward({g, beta, a, b, a_log, dt_bias}), stream_);
  }

  void gdn_gates_backward(const TensorView& da, const TensorView& db, const TensorView& da_log,
                          const TensorView& ddt_bias, const TensorView& dg, const TensorView& dbeta,
                          const TensorView& a, const TensorView& b, const TensorView& a_log,
                          const TensorView& dt_bias) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix am = matrix(a, "a", bf16);
    const Index R = am.rows, H = am.cols;
    cuda::gdn_gates_backward(matrix(da, "da", bf16, R, H), matrix(db, "db", bf16, R, H),
                             vector<float>(da_log, "da_log", f32, H), vector<float>(ddt_bias, "ddt_bias", f32, H),
                             matrix(dg, "dg", f32, R, H), matrix(dbeta, "dbeta", f32, R, H), am,
                             matrix(b, "b", bf16, R, H), vector<const void>(a_log, "a_log", bf16, H),
                             vector<const void>(dt_bias, "dt_bias", bf16, H), workspace_, stream_);
  }

  void rope(const TensorView& x, int heads, int head_dim, int rotary_dim, double theta, const IndexArray& cu_seqlens,
            bool inverse) override {
    const CudaDeviceGuard guard(device_.index);
    check_rope(heads, head_dim, rotary_dim, theta);
    const Matrix xm = matrix(x, "x", bf16, kAny, Index{heads} * head_dim);
    cuda::rope(xm, heads, head_dim, rotary_dim, static_cast<float>(theta), sequences(cu_seqlens, xm.rows), inverse,
               stream_);
  }

  void attention_forward(const TensorView& o, const TensorView& lse, const TensorView& q, const TensorView& k,
                         const TensorView& v, int q_heads, int kv_heads, int head_dim, double scale,
                         const IndexArray& cu_seqlens) override {
    const CudaDeviceGuard guard(device_.index);
    const cuda::AttentionShape s = attention_shape(q_heads, kv_heads, head_dim, scale);
    const Matrix qm = matrix(q, "q", bf16, kAny, Index{q_heads} * head_dim);
    const Index R = qm.rows, kv_cols = Index{kv_heads} * head_dim;
    const cuda::Sequences seq = sequences(cu_seqlens, R);
    const Matrix om = matrix(o, "o", bf16, R, qm.cols), lm = matrix(lse, "lse", f32, q_heads, R);
    const Matrix km = matrix(k, "k", bf16, R, kv_cols), vm = matrix(v, "v", bf16, R, kv_cols);
    switch (attention_kernels(false, head_dim, {om, qm, km, vm})) {
      case cuda::AttentionKernels::rows:
        check_cached_head_dim(head_dim, "attention_forward (batch-invariant: cached_attention's kernel)");
        cuda::row_attention(om, lm, qm, km, vm, q_heads, kv_heads, head_dim, s.scale, seq, stream_);
        return;
      case cuda::AttentionKernels::cudnn:
        cudnn_attention().forward(workspace_, om, lm, qm, km, vm, s, cu_seqlens.host, seq, stream_);
        return;
      case cuda::AttentionKernels::unfused:
        cuda::unfused_attention_forward(gemm_, workspace_, om, lm, qm, km, vm, s, cu_seqlens.host, stream_);
        return;
    }
  }

  void attention_backward(const TensorView& dq, const TensorView& dk, const TensorView& dv, const TensorView& dout,
                          const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                          const TensorView& lse, int q_heads, int kv_heads, int head_dim, double scale,
                          const IndexArray& cu_seqlens) override {
    const CudaDeviceGuard guard(device_.index);
    const cuda::AttentionShape s = attention_shape(q_heads, kv_heads, head_dim, scale);
    const Matrix qm = matrix(q, "q", bf16, kAny, Index{q_heads} * head_dim);
    const Index R = qm.rows, q_cols = qm.cols, kv_cols = Index{kv_heads} * head_dim;
    const cuda::Sequences seq = sequences(cu_seqlens, R);
    const Matrix dqm = matrix(dq, "dq", bf16, R, q_cols), dkm = matrix(dk, "dk", bf16, R, kv_cols);
    const Matrix dvm = matrix(dv, "dv", bf16, R, kv_cols), doutm = matrix(dout, "dout", bf16, R, q_cols);
    const Matrix km = matrix(k, "k", bf16, R, kv_cols), vm = matrix(v, "v", bf16, R, kv_cols);
    const Matrix om = matrix(o, "o", bf16, R, q_cols), lm = matrix(lse, "lse", f32, q_heads, R);
    if (attention_kernels(true, head_dim, {dqm, dkm, dvm, doutm, qm, km, vm, om}) == cuda::AttentionKernels::cudnn) {
      cudnn_attention().backward(workspace_, dqm, dkm, dvm, doutm, qm, km, vm, om, lm, s, cu_seqlens.host, seq,
                                 stream_);
    } else {
      cuda::unfused_attention_backward(gemm_, workspace_, dqm, dkm, dvm, doutm, qm, km, vm, om, lm, s,
                                       cu_seqlens.host, stream_);
    }
  }

  void sigmoid_gate_forward(const TensorView& out, const TensorView& x, const TensorView& gate) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix xm = matrix(x, "x", bf16);
    cuda::sigmoid_gate_forward(matrix(out, "out", bf16, xm.rows, xm.cols), xm,
                               matrix(gate, "gate", bf16, xm.rows, xm.cols), stream_);
  }

  void sigmoid_gate_backward(const TensorView& dx, const TensorView& dgate, const TensorView& dout, const TensorView& x,
                             const TensorView& gate) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix xm = matrix(x, "x", bf16);
    const Index R = xm.rows, C = xm.cols;
    cuda::sigmoid_gate_backward(matrix(dx, "dx", bf16, R, C), matrix(dgate, "dgate", bf16, R, C),
                                matrix(dout, "dout", bf16, R, C), xm, matrix(gate, "gate", bf16, R, C), stream_);
  }

  void swiglu_forward(const TensorView& out, const TensorView& gate, const TensorView& up) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix gm = matrix(gate, "gate", bf16);
    cuda::swiglu_forward(matrix(out, "out", bf16, gm.rows, gm.cols), gm, matrix(up, "up", bf16, gm.rows, gm.cols),
                         stream_);
  }

  void swiglu_backward(const TensorView& dgate, const TensorView& dup, const TensorView& dout, const TensorView& gate,
                       const TensorView& up) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix gm = matrix(gate, "gate", bf16);
    const Index R = gm.rows, C = gm.cols;
    cuda::swiglu_backward(matrix(dgate, "dgate", bf16, R, C), matrix(dup, "dup", bf16, R, C),
                          matrix(dout, "dout", bf16, R, C), gm, matrix(up, "up", bf16, R, C), stream_);
  }

  void add(const TensorView& y, const TensorView& x) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix ym = matrix(y, "y", bf16);
    cuda::add(ym, matrix(x, "x", bf16, ym.rows, ym.cols), stream_);
  }

  // copy and fill_zero take any dtype: they move bytes (cudaMemcpy2DAsync / cudaMemset2DAsync, strided rows).
  void copy(const TensorView& dst, const TensorView& src) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix d = matrix(dst, "dst", dst.dtype);
    copy_matrix(d, matrix(src, "src", dst.dtype, d.rows, d.cols), dst.dtype);
  }

  void fill_zero(const TensorView& x) override {
    const CudaDeviceGuard guard(device_.index);
    zero(matrix(x, "x", x.dtype), x.dtype);
  }

  // Inference: ops.cpp checks the shapes and index values; here the devices, dtypes and the indices' device copies.
  void copy_rows(const TensorView& dst, const IndexArray& dst_rows, const TensorView& src,
                 const IndexArray& src_rows) override {
    const CudaDeviceGuard guard(device_.index);
    check_copy_rows(dst, dst_rows, src, src_rows);
    const Index n = static_cast<Index>(dst_rows.size());
    cuda::copy_rows(matrix(dst, "dst", dst.dtype), indices(dst_rows, "dst_rows", n), matrix(src, "src", dst.dtype),
                    indices(src_rows, "src_rows", n), n, dtype_size(dst.dtype), stream_);
  }

  void conv1d_silu_step(const ColumnParts& out, const TensorView& x, const TensorView& weight,
                        const TensorView& state, const IndexArray& slots) override {
    conv_step(out, x, weight, state, slots, cuda::GatesForward{});
  }

  void gdn_inputs_step(const ColumnParts& out, const TensorView& x, const TensorView& weight, const TensorView& state,
                       const IndexArray& slots, const GdnGates& gates) override {
    conv_step(out, x, weight, state, slots, gates_forward(gates));
  }

  void rope_at_positions(const TensorView& x, int heads, int head_dim, int rotary_dim, double theta,
                         const IndexArray& positions) override {
    const CudaDeviceGuard guard(device_.index);
    check_rope_at_positions(x, heads, head_dim, rotary_dim, theta, positions);
    const Matrix xm = matrix(x, "x", bf16);
    cuda::rope_at_positions(xm, heads, head_dim, rotary_dim, static_cast<float>(theta),
                            indices(positions, "positions", xm.rows), stream_);
  }

  void attention_inputs_step(const AttentionInputs& x, const IndexArray& positions, const TensorView& k_cache,
                             const TensorView& v_cache, const IndexArray& cache_rows,
                             const IndexArray& batch_rows) override {
    const CudaDeviceGuard guard(device_.index);
    const CacheLayout layout = check_attention_inputs_step(x, positions, k_cache, v_cache, cache_rows, batch_rows);
    const Index T = x.qg.shape[0], D = x.head_dim;
    cuda::AttentionInputsStep p;
    p.qg = matrix(x.qg, "qg", bf16);
    p.k_raw = matrix(x.k_raw, "k_raw", bf16);
    p.v = matrix(x.v, "v", bf16);
    p.q = matrix(x.q, "q", bf16);
    p.k = matrix(x.k, "k", bf16);
    p.gate = matrix(x.gate, "gate", bf16);
    p.k_cache = this->cache_rows(k_cache, "k_cache", bf16, layout);
    p.v_cache = this->cache_rows(v_cache, "v_cache", bf16, layout);
    p.q_rstd = vector<float>(x.q_rstd, "q_rstd", f32, T * x.q_heads);
    p.k_rstd = vector<float>(x.k_rstd, "k_rstd", f32, T * x.kv_heads);
    p.q_norm = vector<const void>(x.q_norm, "q_norm", bf16, D);
    p.k_norm = vector<const void>(x.k_norm, "k_norm", bf16, D);
    const bool aligned = rows_aligned({p.qg, p.k_raw, p.v, p.q, p.k, p.gate, p.k_cache, p.v_cache,
                                       Matrix{const_cast<void*>(p.q_norm), 1, D, D},
                                       Matrix{const_cast<void*>(p.k_norm), 1, D, D}});
    if (!cuda::fuse_attention_inputs(x.q_heads, x.kv_heads, x.head_dim, x.rotary_dim, aligned))
      return Ops::attention_inputs_step(x, positions, k_cache, v_cache, cache_rows, batch_rows);
    p.positions = indices(positions, "positions", T);
    p.cache_rows = indices(cache_rows, "cache_rows", T);
    p.batch_rows = indices(batch_rows, "batch_rows", T);
    p.q_heads = x.q_heads;
    p.kv_heads = x.kv_heads;
    p.head_dim = x.head_dim;
    p.rotary_dim = x.rotary_dim;
    p.theta = static_cast<float>(x.theta);
    p.eps = static_cast<float>(x.eps);
    cuda::attention_inputs_step(p, T, stream_);
  }

  void cached_attention(const TensorView& o, const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                        int q_heads, int kv_heads, int head_dim, double scale, const IndexArray& cu_seqlens,
                        const IndexArray& slots, const IndexArray& lengths) override {
    const CudaDeviceGuard guard(device_.index);
    const CacheLayout layout =
        check_cached_attention(o, q, k_cache, v_cache, q_heads, kv_heads, head_dim, cu_seqlens, slots, lengths);
    check_cached_head_dim(head_dim, "cached_attention");
    const Matrix qm = matrix(q, "q", bf16);
    const Index N = static_cast<Index>(slots.size());
    cuda::cached_attention(matrix(o, "o", bf16), qm, cache_rows(k_cache, "k_cache", bf16, layout),
                           cache_rows(v_cache, "v_cache", bf16, layout), layout.slot_rows, q_heads, kv_heads, head_dim,
                           static_cast<float>(scale), sequences(cu_seqlens, qm.rows), indices(slots, "slots", N),
                           indices(lengths, "lengths", N), stream_);
  }

  void cross_entropy(const TensorView& logits, const IndexArray& targets, const TensorView& weights,
                     const TensorView& logprob, bool want_grad) override {
    const CudaDeviceGuard guard(device_.index);
    const Matrix l = matrix(logits, "logits", bf16);
    const Index R = l.rows;
    const std::int32_t* target_ids = indices(targets, "targets", R);
    for (const std::int32_t target : targets.host)
      if (target >= l.cols)
        throw InvalidArgument("targets", "must be < the vocabulary " + std::to_string(l.cols) +
                                             " (or negative: ignored), got " + std::to_string(target));
    const float* w = want_grad ? vector<const float>(weights, "weights", f32, R) : nullptr;
    if (logprob.dtype == DType::f64) {
      // Read before the gradient overwrites the rows.
      cuda::token_logprobs(l, target_ids, vector<double>(logprob, "logprob", DType::f64, R), stream_);
      if (want_grad) cuda::cross_entropy(l, target_ids, w, nullptr, true, stream_);
      return;
    }
    cuda::cross_entropy(l, target_ids, w, vector<float>(logprob, "logprob", f32, R), want_grad, stream_);
  }

 private:
  void check_device(const TensorView& v, const char* name) const {
    if (!(v.device == device_))
      throw InvalidArgument(name, "must be on " + device_name(device_) + ", got " + device_name(v.device));
  }

  static void check_dtype(const TensorView& v, const char* name, DType dtype) {
    if (v.dtype != dtype)
      throw InvalidArgument(name, std::string("must be ") + dtype_name(dtype) + ", got " + dtype_name(v.dtype));
  }

  // c = alpha op(a) op(b) + beta (addend, or c when null; the same layout as c); c_name names c in errors (gemm_add's
  // result is its d). b_is_weight: Gemm::run's.
  void product(bool trans_a, bool trans_b, double alpha, const TensorView& a, const TensorView& b, double beta,
               const void* addend, const TensorView& c, const char* c_name, bool b_is_weight) {
    const CudaDeviceGuard guard(device_.index);
    if (c.dtype != bf16 && c.dtype != f32)
      throw InvalidArgument(c_name, std::string("must be bfloat16 or float32, got ") + dtype_name(c.dtype));
    const Matrix cm = matrix(c, c_name, c.dtype);
    const Index M = cm.rows, N = cm.cols;
    const Matrix am = trans_a ? matrix(a, "a", bf16, kAny, M) : matrix(a, "a", bf16, M, kAny);
    const Index K = trans_a ? am.rows : am.cols;
    const Matrix bm = trans_b ? matrix(b, "b", bf16, N, K) : matrix(b, "b", bf16, K, N);
    if (M == 0 || N == 0) return;
    if (K == 0) {  // op(a) op(b) is zero: c = beta c
      if (beta != 0 && beta != 1)
        throw InvalidArgument("beta", "must be 0 or 1 when the inner dimension is empty, got " + std::to_string(beta));
      if (beta == 0) {
        zero(cm, c.dtype);
      } else if (addend != nullptr && addend != cm.data) {
        copy_matrix(cm, Matrix{const_cast<void*>(addend), M, N, cm.ld}, c.dtype);
      }
      return;
    }
    // The rows of a product with a not transposed are tokens (ops.h): those must not depend on the batch.
    gemm_.run(trans_a, trans_b, M, N, K, static_cast<float>(alpha), am.data, am.ld, bm.data, bm.ld,
              static_cast<float>(beta), cm.data, cm.ld, c.dtype, batch_invariant_ && !trans_a, addend, b_is_weight);
  }

  // d = alpha op(a) op(b) + c in one product (gemm_add).
  void product_add(bool trans_a, bool trans_b, double alpha, const TensorView& a, const TensorView& b,
                   const TensorView& c, const TensorView& d, bool b_is_weight) {
    check_device(c, "c");
    if (c.dtype != d.dtype)
      throw InvalidArgument("c", std::string("must have d's dtype ") + dtype_name(d.dtype) + ", got " + dtype_name(c.dtype));
    const MatrixLayout dl = matrix_layout(d, "d");
    const MatrixLayout cl = matrix_layout(c, "c", dl.rows, dl.cols);
    // cuBLASLt's C and D share one layout here: a residual of another row stride is copied into d first, and the
    // product then accumulates onto d.
    const bool same_layout = cl.row_stride == dl.row_stride;
    if (!same_layout && c.data != d.data) copy(d, c);
    product(trans_a, trans_b, alpha, a, b, 1, same_layout ? c.data : nullptr, d, "d", b_is_weight);
  }

  Matrix matrix(const TensorView& v, const char* name, DType dtype, Index rows = kAny, Index cols = kAny) const {
    check_device(v, name);
    check_dtype(v, name, dtype);
    const MatrixLayout m = matrix_layout(v, name, rows, cols);
    return {v.data, m.rows, m.cols, m.row_stride};
  }

  // rmsnorm_forward, after x += *residual when given (one kernel).
  void norm_forward(const TensorView& out, const TensorView& rstd, const TensorView& x, const TensorView* residual,
                    const TensorView& weight, double eps, bool zero_centred) {
    const CudaDeviceGuard guard(device_.index);
    const Matrix xm = matrix(x, "x", bf16);
    check_positive(xm.cols, "x's columns");
    cuda::rmsnorm_forward(matrix(out, "out", bf16, xm.rows, xm.cols), vector<float>(rstd, "rstd", f32, xm.rows), xm,
                          residual ? matrix(*residual, "residual", bf16, xm.rows, xm.cols) : Matrix{},
                          vector<void>(weight, "weight", bf16, xm.cols), static_cast<float>(eps), zero_centred,
                          stream_);
  }

  MatrixParts matrix_parts(const ColumnParts& v, const char* name, DType dtype, Index rows, Index cols) const {
    static_assert(ColumnParts::kMaxParts == MatrixParts::kMaxParts);
    check_column_parts(v, name, rows, cols);
    MatrixParts parts;
    parts.count = v.count;
    for (int p = 0; p < v.count; ++p) parts.part[p] = matrix(v.part[p], name, dtype, rows);
    return parts;
  }

  // A cache checked by ops.cpp as the matrix of its S * L rows.
  Matrix cache_rows(const TensorView& v, const char* name, DType dtype, const CacheLayout& layout) const {
    check_device(v, name);
    check_dtype(v, name, dtype);
    return {v.data, layout.rows(), layout.cols, std::max<Index>(layout.cols, 1)};
  }

  template <class T>
  T* vector(const TensorView& v, const char* name, DType dtype, Index n) const {
    check_device(v, name);
    check_dtype(v, name, dtype);
    if (v.ndim != 1 || v.shape[0] != n)
      throw InvalidArgument(name, "must have shape [" + std::to_string(n) + "], got " + v.shape_string());
    if (n > 1 && v.strides[0] != 1)
      throw InvalidArgument(name, "must be contiguous, got stride " + std::to_string(v.strides[0]));
    if (v.data == nullptr && n > 0) throw InvalidArgument(name, "has no data");
    return static_cast<T*>(v.data);
  }

  static const std::int32_t* indices(const IndexArray& values, const char* name, Index n) {
    if (static_cast<Index>(values.size()) != n)
      throw InvalidArgument(name, "must hold " + std::to_string(n) + " values, got " + std::to_string(values.size()));
    if (values.device == nullptr && n > 0) throw InvalidArgument(name, "must have a device copy for GPU kernels");
    return values.device;
  }

  // Token ids index a table of `rows` rows; the host copy is checked, the device copy used.
  static const std::int32_t* token_ids(const IndexArray& tokens, Index rows) {
    for (const std::int32_t token : tokens.host)
      if (token < 0 || token >= rows)
        throw InvalidArgument("tokens", "must lie in [0, " + std::to_string(rows) + "), got " + std::to_string(token));
    return indices(tokens, "tokens", static_cast<Index>(tokens.size()));
  }

  static cuda::Sequences sequences(const IndexArray& cu, Index tokens) {
    check_cu_seqlens(cu.host, tokens);
    return {indices(cu, "cu_seqlens", static_cast<Index>(cu.size())), static_cast<int>(cu.size()) - 1};
  }

  void check_cached_head_dim(int head_dim, const char* op) const {
    if (head_dim > cuda::kMaxCachedHeadDim)
      throw Unavailable(std::string(op) + " on " + device_name(device_),
                        "head_dim " + std::to_string(head_dim) + " is over the " +
                            std::to_string(cuda::kMaxCachedHeadDim) + " its kernel holds in registers");
  }

  // attention_plan.h's choice for this call; `rows` are its bfloat16 matrices.
  cuda::AttentionKernels attention_kernels(bool backward, int head_dim, std::initializer_list<Matrix> rows) const {
    static const char* const cudnn_setting = std::getenv("DELTATRAIN_CUDNN_ATTENTION");  // read once
    cuda::AttentionPlanInputs in;
    in.backward = backward;
    in.batch_invariant = batch_invariant_;
    in.cudnn_built = cuda::CudnnAttention::built();
    in.cudnn_allowed = switch_setting("DELTATRAIN_CUDNN_ATTENTION", cudnn_setting);
    in.head_dim = head_dim;
    in.rows_aligned = rows_aligned(rows);
    return cuda::plan_attention(in);
  }

  // Every row of every bfloat16 matrix starts on 16 bytes: the kernels' 16-byte accesses.
  static bool rows_aligned(std::initializer_list<Matrix> rows) {
    return std::all_of(rows.begin(), rows.end(), [](const Matrix& m) {
      return reinterpret_cast<std::uintptr_t>(m.data) % 16 == 0 && m.ld % 8 == 0;
    });
  }

  // Made on first use: a cuDNN handle costs memory that models without attention layers need not spend.
  cuda::CudnnAttention& cudnn_attention() {
    if (!cudnn_attention_) cudnn_attention_ = std::make_unique<cuda::CudnnAttention>();
    return *cudnn_attention_;
  }

  static cuda::AttentionShape attention_shape(int q_heads, int kv_heads, int head_dim, double scale) {
    check_attention_heads(q_heads, kv_heads, head_dim);
    return {q_heads, kv_heads, head_dim, static_cast<float>(scale)};
  }

  void copy_matrix(const Matrix& dst, const Matrix& src, DType dtype) const {
    if (dst.rows == 0 || dst.cols == 0) return;
    const std::size_t size = dtype_size(dtype);
    cuda_check(cudaMemcpy2DAsync(dst.data, dst.ld * size, src.data, src.ld * size, dst.cols * size, dst.rows,
                                 cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpy2DAsync");
  }

  // The gates' arguments validated (gdn_gates_forward's checks), for the launchers.
  cuda::GatesForward gates_forward(const GdnGates& gates) const {
    const Matrix am = matrix(gates.a, "a", bf16);
    const Index R = am.rows, H = am.cols;
    return {matrix(gates.g, "g", f32, R, H), matrix(gates.beta, "beta", f32, R, H), am,
            matrix(gates.b, "b", bf16, R, H), vector<const void>(gates.a_log, "a_log", bf16, H),
            vector<const void>(gates.dt_bias, "dt_bias", bf16, H)};
  }

  // conv1d_silu_step, with `gates` in the same launch unless empty.
  void conv_step(const ColumnParts& out, const TensorView& x, const TensorView& weight, const TensorView& state,
                 const IndexArray& slots, const cuda::GatesForward& gates) {
    const CudaDeviceGuard guard(device_.index);
    const CacheLayout layout = check_conv1d_silu_step(out, x, weight, state, slots);
    const Matrix xm = matrix(x, "x", bf16);
    cuda::conv1d_silu_step(matrix_parts(out, "out", bf16, xm.rows, xm.cols), xm, matrix(weight, "weight", bf16),
                           cache_rows(state, "state", bf16, layout), indices(slots, "slots", xm.rows), gates, stream_);
  }

  void zero(const Matrix& m, DType dtype) const {
    if (m.rows == 0 || m.cols == 0) return;
    const std::size_t size = dtype_size(dtype);
    cuda_check(cudaMemset2DAsync(m.data, m.ld * size, 0, m.cols * size, m.rows, stream_), "cudaMemset2DAsync");
  }

  Device device_;
  cudaStream_t stream_;
  bool batch_invariant_;
  cuda::Gemm gemm_;
  cuda::Workspace workspace_;
  std::unique_ptr<cuda::CudnnAttention> cudnn_attention_;
};

}  // namespace

std::unique_ptr<Ops> make_cuda_ops(Device device, void* stream, bool batch_invariant) {
  if (device.type != DeviceType::cuda)
    throw InvalidArgument("device", "must be a CUDA device, got " + device_name(device));
  const CudaInfo& info = cuda_info();
  if (!info.usable()) throw Unavailable("the model on " + device_name(device), info.unavailable_reason);
  if (device.index < 0 || device.index >= static_cast<int>(info.gpus.size()))
    throw InvalidArgument("device", "no such GPU: " + device_name(device) + " (" + std::to_string(info.gpus.size()) +
                                        " visible)");
  const GpuInfo& gpu = info.gpus[device.index];
  if (gpu.cc_major < 8)  // bfloat16 tensor-core products and the kernels' build targets start at sm_80
    throw Unavailable("the model on " + device_name(device), "needs compute capability 8.0 or newer, " + gpu.name +
                                                                 " has " + std::to_string(gpu.cc_major) + "." +
                                                                 std::to_string(gpu.cc_minor));
  const CudaDeviceGuard guard(device.index);
  return std::make_unique<CudaOps>(device, static_cast<cudaStream_t>(stream), batch_invariant);
}

}  // namespace deltatrain::model
