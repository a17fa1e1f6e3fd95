// The arithmetic of one optimizer step on a rank's shard, written once for the CPU loops and the
// CUDA kernels (the element functions below compile for both), with a dispatch on the device.
#pragma once

#include <math.h>
#include <cstdint>
#include <cstring>

#include "deltatrain/core/tensor.h"

#if defined(__CUDACC__)
#define DELTATRAIN_HD __host__ __device__ __forceinline__
#else
#define DELTATRAIN_HD inline
#endif

namespace deltatrain::optim {

// A bfloat16 in memory: the high half of a float32.
struct Bf16 {
  std::uint16_t bits;
};

DELTATRAIN_HD std::uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

DELTATRAIN_HD float bits_float(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

// Round to nearest even, as torch and __float2bfloat16_rn do; NaN stays a (quiet) NaN.
DELTATRAIN_HD Bf16 to_bf16(float value) {
  const std::uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return {static_cast<std::uint16_t>((bits >> 16) | 0x0040u)};
  return {static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16)};
}

DELTATRAIN_HD float to_float(Bf16 value) { return bits_float(static_cast<std::uint32_t>(value.bits) << 16); }
DELTATRAIN_HD float to_float(float value) { return value; }

template <class T>
DELTATRAIN_HD T from_float(float value);
template <>
DELTATRAIN_HD float from_float<float>(float value) {
  return value;
}
template <>
DELTATRAIN_HD Bf16 from_float<Bf16>(float value) {
  return to_bf16(value);
}

// Per-step constants, computed once on the host in double from the integer step.
struct AdamWCoefficients {
  float beta1 = 0, beta2 = 0;
  float one_minus_beta1 = 0, one_minus_beta2 = 0;
  float decay = 1;         // 1 - lr * weight_decay (decoupled weight decay)
  float step_size = 0;     // lr / (1 - beta1^step)
  float inv_sqrt_bc2 = 0;  // 1 / sqrt(1 - beta2^step)
  float eps = 0;
  double max_grad_norm = 0;  // 0: no clipping
  double inv_dp = 1;         // gradients are summed across ranks, then averaged
};

// The factor applied to every summed gradient: the mean over ranks, times the clipping coefficient
// of torch.nn.utils.clip_grad_norm_ (max_norm / (norm + 1e-6), when that is below 1).
DELTATRAIN_HD float gradient_scale(double summed_sum_squares, const AdamWCoefficients& c) {
  const double norm = sqrt(summed_sum_squares) * c.inv_dp;
  double scale = c.inv_dp;
  if (c.max_grad_norm > 0) {
    const double clip = c.max_grad_norm / (norm + 1e-6);
    if (clip < 1) scale *= clip;
  }
  return static_cast<float>(scale);
}

// torch.optim.AdamW's update of one element (amsgrad off), in float32.
DELTATRAIN_HD void adamw_element(float& param, float& exp_avg, float& exp_avg_sq, float grad,
                                 const AdamWCoefficients& c) {
  param *= c.decay;
  exp_avg = c.beta1 * exp_avg + c.one_minus_beta1 * grad;
  exp_avg_sq = c.beta2 * exp_avg_sq + c.one_minus_beta2 * grad * grad;
  const float denom = sqrtf(exp_avg_sq) * c.inv_sqrt_bc2 + c.eps;
  param -= c.step_size * (exp_avg / denom);
}

// One bucket's shard on one rank: its state, its summed gradients and its model parameters.
struct ShardUpdate {
  float* main = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const float* grad = nullptr;
  void* model = nullptr;  // the rank's shard inside the model-parameter buffer
  DType model_dtype = DType::f32;
  std::int64_t numel = 0;
};

// Scratch doubles that sum_squares may use on a GPU (partial sums of its blocks).
inline constexpr int kSumSquaresScratch = 1024;

// out = sum of values[i]^2 in double, in an order fixed by n alone (so the result is reproducible).
void sum_squares(Device device, const float* values, std::int64_t n, double* out, double* scratch, void* stream);
// out = values[0] + ... + values[n-1], in that order.
void sum_in_order(Device device, const double* values, int n, double* out, void* stream);
// AdamW on the shard, gradients scaled by gradient_scale(*summed_sum_squares); writes the model shard.
void adamw_update(Device device, const ShardUpdate& shard, const double* summed_sum_squares,
                  const AdamWCoefficients& coefficients, void* stream);
void cast_main_to_model(Device device, const float* main, void* model, DType model_dtype, std::int64_t n,
                        void* stream);
void cast_model_to_main(Device device, const void* model, DType model_dtype, float* main, std::int64_t n,
                        void* stream);

}  // namespace deltatrain::optim
