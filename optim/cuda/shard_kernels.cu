#include "cuda/shard_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "deltatrain/core/cuda_check.h"

namespace deltatrain::optim {

namespace {

constexpr int kThreads = 256;

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

int blocks_for(std::int64_t n, int cap) {
  return static_cast<int>(std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, cap));
}

// Tree reduction of one block's values in shared memory: a fixed order, so results are reproducible.
__device__ double block_sum(double value) {
  __shared__ double partial[kThreads];
  partial[threadIdx.x] = value;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  return partial[0];
}

// The grid size depends on n alone, so the partition of the sum (and its rounding) is fixed.
__global__ void sum_squares_blocks(const float* values, std::int64_t n, double* partials) {
  double sum = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    sum += static_cast<double>(values[i]) * values[i];
  }
  const double total = block_sum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void sum_block(const double* values, int n, double* out) {
  double sum = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) sum += values[i];
  const double total = block_sum(sum);
  if (threadIdx.x == 0) *out = total;
}

__global__ void sum_serial(const double* values, int n, double* out) {
  double total = 0;
  for (int i = 0; i < n; ++i) total += values[i];
  *out = total;
}

template <class Model>
__global__ void adamw_kernel(ShardUpdate shard, const double* summed_sum_squares, AdamWCoefficients c) {
  const float scale = gradient_scale(*summed_sum_squares, c);
  auto* model = static_cast<Model*>(shard.model);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x; i < shard.numel;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    float param = shard.main[i], exp_avg = shard.exp_avg[i], exp_avg_sq = shard.exp_avg_sq[i];
    adamw_element(param, exp_avg, exp_avg_sq, shard.grad[i] * scale, c);
    shard.main[i] = param;
    shard.exp_avg[i] = exp_avg;
    shard.exp_avg_sq[i] = exp_avg_sq;
    model[i] = from_float<Model>(param);
  }
}

template <class Model>
__global__ void main_to_model_kernel(const float* main, Model* model, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    model[i] = from_float<Model>(main[i]);
  }
}

template <class Model>
__global__ void model_to_main_kernel(const Model* model, float* main, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    main[i] = to_float(model[i]);
  }
}

// Enough blocks to fill an H200 several times over; elementwise kernels stride beyond that.
constexpr int kElementwiseBlocks = 4096;

void check_launch(const char* kernel) { cuda_check(cudaGetLastError(), kernel); }

}  // namespace

void cuda_sum_squares(const float* values, std::int64_t n, double* out, double* scratch, void* stream) {
  const int blocks = blocks_for(n, kSumSquaresScratch);
  sum_squares_blocks<<<blocks, kThreads, 0, as_stream(stream)>>>(values, n, scratch);
  check_launch("sum_squares_blocks");
  sum_block<<<1, kThreads, 0, as_stream(stream)>>>(scratch, blocks, out);
  check_launch("sum_block");
}

void cuda_sum_in_order(const double* values, int n, double* out, void* stream) {
  sum_serial<<<1, 1, 0, as_stream(stream)>>>(values, n, out);
  check_launch("sum_serial");
}

void cuda_adamw_update(const ShardUpdate& shard, const double* summed_sum_squares,
                       const AdamWCoefficients& coefficients, void* stream) {
  const int blocks = blocks_for(shard.numel, kElementwiseBlocks);
  if (shard.model_dtype == DType::bf16) {
    adamw_kernel<Bf16><<<blocks, kThreads, 0, as_stream(stream)>>>(shard, summed_sum_squares, coefficients);
  } else {
    adamw_kernel<float><<<blocks, kThreads, 0, as_stream(stream)>>>(shard, summed_sum_squares, coefficients);
  }
  check_launch("adamw_kernel");
}

void cuda_cast_main_to_model(const float* main, void* model, DType model_dtype, std::int64_t n, void* stream) {
  const int blocks = blocks_for(n, kElementwiseBlocks);
  if (model_dtype == DType::bf16) {
    main_to_model_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(main, static_cast<Bf16*>(model), n);
  } else {
    main_to_model_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(main, static_cast<float*>(model), n);
  }
  check_launch("main_to_model_kernel");
}

void cuda_cast_model_to_main(const void* model, DType model_dtype, float* main, std::int64_t n, void* stream) {
  const int blocks = blocks_for(n, kElementwiseBlocks);
  if (model_dtype == DType::bf16) {
    model_to_main_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(static_cast<const Bf16*>(model), main, n);
  } else {
    model_to_main_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(static_cast<const float*>(model), main, n);
  }
  check_launch("model_to_main_kernel");
}

}  // namespace deltatrain::optim
