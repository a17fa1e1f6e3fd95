#include "shard_math.h"

#include <algorithm>
#include <vector>

#include "cuda/shard_kernels.h"

namespace deltatrain::optim {

namespace {

// Fixed-size chunks summed separately, then in chunk order: the same result for any thread count.
constexpr std::int64_t kChunk = 4096;

template <class Model>
void host_adamw(const ShardUpdate& shard, float scale, const AdamWCoefficients& c) {
  auto* model = static_cast<Model*>(shard.model);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < shard.numel; ++i) {
    adamw_element(shard.main[i], shard.exp_avg[i], shard.exp_avg_sq[i], shard.grad[i] * scale, c);
    model[i] = from_float<Model>(shard.main[i]);
  }
}

template <class Model>
void host_main_to_model(const float* main, void* model, std::int64_t n) {
  auto* out = static_cast<Model*>(model);
  for (std::int64_t i = 0; i < n; ++i) out[i] = from_float<Model>(main[i]);
}

template <class Model>
void host_model_to_main(const void* model, float* main, std::int64_t n) {
  const auto* in = static_cast<const Model*>(model);
  for (std::int64_t i = 0; i < n; ++i) main[i] = to_float(in[i]);
}

bool on_host(Device device) { return device.type == DeviceType::cpu; }

}  // namespace

void sum_squares(Device device, const float* values, std::int64_t n, double* out, double* scratch, void* stream) {
  if (!on_host(device)) return cuda_sum_squares(values, n, out, scratch, stream);
  std::vector<double> partial((n + kChunk - 1) / kChunk, 0.0);
#pragma omp parallel for schedule(static)
  for (std::int64_t chunk = 0; chunk < static_cast<std::int64_t>(partial.size()); ++chunk) {
    double sum = 0;
    for (std::int64_t i = chunk * kChunk; i < std::min(n, (chunk + 1) * kChunk); ++i) {
      sum += static_cast<double>(values[i]) * values[i];
    }
    partial[chunk] = sum;
  }
  double total = 0;
  for (double p : partial) total += p;
  *out = total;
}

void sum_in_order(Device device, const double* values, int n, double* out, void* stream) {
  if (!on_host(device)) return cuda_sum_in_order(values, n, out, stream);
  double total = 0;
  for (int i = 0; i < n; ++i) total += values[i];
  *out = total;
}

void adamw_update(Device device, const ShardUpdate& shard, const double* summed_sum_squares,
                  const AdamWCoefficients& coefficients, void* stream) {
  if (!on_host(device)) return cuda_adamw_update(shard, summed_sum_squares, coefficients, stream);
  const float scale = gradient_scale(*summed_sum_squares, coefficients);
  if (shard.model_dtype == DType::bf16) {
    host_adamw<Bf16>(shard, scale, coefficients);
  } else {
    host_adamw<float>(shard, scale, coefficients);
  }
}

void cast_main_to_model(Device device, const float* main, void* model, DType model_dtype, std::int64_t n,
                        void* stream) {
  if (!on_host(device)) return cuda_cast_main_to_model(main, model, model_dtype, n, stream);
  if (model_dtype == DType::bf16) {
    host_main_to_model<Bf16>(main, model, n);
  } else {
    host_main_to_model<float>(main, model, n);
  }
}

void cast_model_to_main(Device device, const void* model, DType model_dtype, float* main, std::int64_t n,
                        void* stream) {
  if (!on_host(device)) return cuda_cast_model_to_main(model, model_dtype, main, n, stream);
  if (model_dtype == DType::bf16) {
    host_model_to_main<Bf16>(model, main, n);
  } else {
    host_model_to_main<float>(model, main, n);
  }
}

}  // namespace deltatrain::optim
