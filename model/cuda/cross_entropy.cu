// Cross-entropy over rows of bfloat16 logits, in place: one block per row, an online maximum and sum of
// exponentials in float32 per thread merged across the block, then (with want_grad) the row rewritten as
// weights[r] * (softmax - onehot(target)). And the targets' log-probabilities in float64 by the formula the
// rollout's sampler shares (log_softmax.cuh), for batch-invariant mode.
#include "common.cuh"
#include "deltatrain/model/log_softmax.cuh"

namespace deltatrain::model::cuda {
namespace {

constexpr int kThreads = 512;

template <bool V>
__global__ void cross_entropy_kernel(Matrix logits, const std::int32_t* targets, const float* weights,
                                     float* logprob, bool want_grad) {
  const Index r = blockIdx.x, cols = logits.cols, step = static_cast<Index>(blockDim.x) * kVector;
  bf16* row = row_of<bf16>(logits, r);
  const std::int32_t target = targets[r];
  if (target < 0) {
    if (threadIdx.x == 0 && logprob != nullptr) logprob[r] = 0.f;
    if (!want_grad) return;
    const float zeros[kVector] = {};
    for (Index c0 = threadIdx.x * kVector; c0 < cols; c0 += step) store8<V>(row, c0, cols, zeros);
    return;
  }
  // Read before the reduction's barriers: after them the row is overwritten.
  const float target_logit = to_float(row[target]);
  MaxSum partial;
  for (Index c0 = threadIdx.x * kVector; c0 < cols; c0 += step) {
    float x[kVector];
    load8<V>(row, c0, cols, x);
    if constexpr (!V) {
#pragma unroll
      for (int k = 0; k < kVector; ++k)
        if (c0 + k >= cols) x[k] = -INFINITY;
    }
    partial.add_n(x);
  }
  const MaxSum total = block_max_sum(partial);
  const float lse = total.max + logf(total.sum);
  if (threadIdx.x == 0 && logprob != nullptr) logprob[r] = target_logit - lse;
  if (!want_grad) return;
  const float weight = weights[r];
  const float shift = lse * kLog2e;
  for (Index c0 = threadIdx.x * kVector; c0 < cols; c0 += step) {
    float x[kVector];
    load8<V>(row, c0, cols, x);
#pragma unroll
    for (int k = 0; k < kVector; ++k) {
      const float p = exp2f(fmaf(x[k], kLog2e, -shift));
      x[k] = weight * (c0 + k == target ? p - 1.f : p);
    }
    store8<V>(row, c0, cols, x);
  }
}

__global__ void __launch_bounds__(kLogSoftmaxThreads) token_logprobs_kernel(Matrix logits, const std::int32_t* targets,
                                                                            double* logprob) {
  __shared__ LogSoftmaxStorage storage;
  const Index r = blockIdx.x;
  const std::int32_t target = targets[r];
  if (target < 0) {
    if (threadIdx.x == 0) logprob[r] = 0;
    return;
  }
  const auto* row = row_of<const std::uint16_t>(logits, r);
  const DeviceLogSumExp s = row_log_sum_exp(row, logits.cols, storage);
  if (threadIdx.x == 0) logprob[r] = s.log_prob(bf16_bits_to_double(row[target]));
}

}  // namespace

void token_logprobs(Matrix logits, const std::int32_t* targets, double* logprob, cudaStream_t stream) {
  if (logits.rows == 0) return;
  token_logprobs_kernel<<<static_cast<unsigned>(logits.rows), kLogSoftmaxThreads, 0, stream>>>(logits, targets, logprob);
  check_launch("token_logprobs");
}

void cross_entropy(Matrix logits, const std::int32_t* targets, const float* weights, float* logprob, bool want_grad,
                   cudaStream_t stream) {
  if (logits.rows == 0) return;
  const auto blocks = static_cast<unsigned>(logits.rows);
  if (vectorizable(logits)) {
    cross_entropy_kernel<true><<<blocks, kThreads, 0, stream>>>(logits, targets, weights, logprob, want_grad);
  } else {
    cross_entropy_kernel<false><<<blocks, kThreads, 0, stream>>>(logits, targets, weights, logprob, want_grad);
  }
  check_launch("cross_entropy");
}

}  // namespace deltatrain::model::cuda
