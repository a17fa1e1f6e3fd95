// This build has no CUDA: optimizer state on a GPU is unavailable, with the reason.
#include "cuda/shard_kernels.h"
#include "cuda_calls.h"
#include "deltatrain/core/error.h"

namespace deltatrain::optim {

namespace {
[[noreturn]] void unavailable() {
  throw Unavailable("optimizer state on a GPU", "this build of deltatrain has no CUDA support");
}
}  // namespace

void* cuda_alloc(int, std::size_t) { unavailable(); }
void cuda_free(void*) noexcept {}
void cuda_copy(void*, const void*, std::size_t, void*) { unavailable(); }
void cuda_copy_async(void*, const void*, std::size_t, void*) { unavailable(); }
void cuda_zero(void*, std::size_t, void*) { unavailable(); }
void cuda_synchronize(void*) { unavailable(); }
void* cuda_host_alloc(std::size_t) noexcept { return nullptr; }
void cuda_host_free(void*) noexcept {}
void cuda_sum_squares(const float*, std::int64_t, double*, double*, void*) { unavailable(); }
void cuda_sum_in_order(const double*, int, double*, void*) { unavailable(); }
void cuda_adamw_update(const ShardUpdate&, const double*, const AdamWCoefficients&, void*) { unavailable(); }
void cuda_cast_main_to_model(const float*, void*, DType, std::int64_t, void*) { unavailable(); }
void cuda_cast_model_to_main(const void*, DType, float*, std::int64_t, void*) { unavailable(); }

}  // namespace deltatrain::optim
