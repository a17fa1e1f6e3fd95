// log softmax(row)[token] of a bfloat16 row in float64 on a GPU, by one block of kLogSoftmaxThreads threads: the
// one formula the GPU model's loss (in batch-invariant mode, ModelOptions::batch_invariant) and the rollout's
// sampler (untempered log-probabilities) share, so that the trainer's log-probability of a sampled token and
// the rollout's are the same number. The GPU counterpart of log_softmax.h; the two differ only in summation
// order (a block's strided partial sums here, index order there).
#pragma once

#include <cub/block/block_reduce.cuh>

#include <cstdint>

namespace deltatrain::model {

// The block size every caller launches with: the partial sums, and so the rounding, depend on it.
constexpr int kLogSoftmaxThreads = 1024;

struct DeviceLogSumExp {
  double max;
  double log_sum;  // log sum_c exp(row[c] - max)
  __device__ double log_prob(double logit) const { return (logit - max) - log_sum; }
};

using LogSoftmaxReduce = cub::BlockReduce<double, kLogSoftmaxThreads>;

// Shared memory one call needs; a caller may overlay it with its own once the call has returned.
struct LogSoftmaxStorage {
  LogSoftmaxReduce::TempStorage reduce;
  double broadcast;
};

__device__ __forceinline__ double bf16_bits_to_double(std::uint16_t bits) {
  return static_cast<double>(__uint_as_float(static_cast<unsigned>(bits) << 16));
}

// Every thread of the block calls it and gets the row's result. Thread i sums elements i, i + T, ... in order,
// then the block combines the partial sums in cub's fixed tree.
__device__ inline DeviceLogSumExp row_log_sum_exp(const std::uint16_t* row, long long n, LogSoftmaxStorage& storage) {
  double max = -__longlong_as_double(0x7FF0000000000000LL);  // -inf
  for (long long c = threadIdx.x; c < n; c += kLogSoftmaxThreads) max = fmax(max, bf16_bits_to_double(row[c]));
  max = LogSoftmaxReduce(storage.reduce).Reduce(max, [](double a, double b) { return fmax(a, b); });
  if (threadIdx.x == 0) storage.broadcast = max;
  __syncthreads();
  max = storage.broadcast;
  double sum = 0;
  for (long long c = threadIdx.x; c < n; c += kLogSoftmaxThreads) sum += exp(bf16_bits_to_double(row[c]) - max);
  __syncthreads();  // storage.reduce is reused
  sum = LogSoftmaxReduce(storage.reduce).Sum(sum);
  if (threadIdx.x == 0) storage.broadcast = log(sum);
  __syncthreads();
  const double log_sum = storage.broadcast;
  __syncthreads();  // the storage is the caller's again
  return {max, log_sum};
}

}  // namespace deltatrain::model
