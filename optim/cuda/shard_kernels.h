// The CUDA side of shard_math.h: the same operations as kernels, enqueued on `stream`.
// Without CUDA, cuda/not_built.cpp defines them to raise Unavailable.
#pragma once

#include <cstdint>

#include "shard_math.h"

namespace deltatrain::optim {

void cuda_sum_squares(const float* values, std::int64_t n, double* out, double* scratch, void* stream);
void cuda_sum_in_order(const double* values, int n, double* out, void* stream);
void cuda_adamw_update(const ShardUpdate& shard, const double* summed_sum_squares,
                       const AdamWCoefficients& coefficients, void* stream);
void cuda_cast_main_to_model(const float* main, void* model, DType model_dtype, std::int64_t n, void* stream);
void cuda_cast_model_to_main(const void* model, DType model_dtype, float* main, std::int64_t n, void* stream);

}  // namespace deltatrain::optim
