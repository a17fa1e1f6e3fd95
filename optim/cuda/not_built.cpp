// This build has no CUDA: optimizer state on a GPU is unavailable, with the reason.
#include "cuda/shard_kernels.h"
#include "deltatrain/core/error.h"

namespace deltatrain::optim {

namespace {
[[noreturn]] void unavailable() {
  throw Unavailable("optimizer state on a GPU", "this build of deltatrain has no CUDA support");
}
}  // namespace

void cuda_sum_squares(const float*, std::int64_t, double*, double*, void*) { unavailable(); }
void cuda_sum_in_order(const double*, int, double*, void*) { unavailable(); }
void cuda_adamw_update(const ShardUpdate&, const double*, const AdamWCoefficients&, void*) { unavailable(); }
void cuda_cast_main_to_model(const float*, void*, DType, std::int64_t, void*) { unavailable(); }
void cuda_cast_model_to_main(const void*, DType, float*, std::int64_t, void*) { unavailable(); }

}  // namespace deltatrain::optim
