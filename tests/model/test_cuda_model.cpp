// The model on a GPU (bfloat16, cuBLASLt, the cuda GDN backend, the CUDA kernels of model/cuda/) against the CPU
// model in float32 on the same bfloat16 weights: loss, logits and every parameter gradient, within what
// bfloat16 activations allow; and bitwise the same twice. Every test skips (not passes) without a usable GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "deltatrain/core/bfloat16.h"
#include "deltatrain/core/system.h"
#include "deltatrain/model/model.h"
#include "deltatrain/model/params.h"
#include "model_testing.h"

namespace deltatrain::model {
namespace {

#define SKIP_WITHOUT_GPU()                                                      \
  do {                                                                          \
    if (!cuda_info().usable()) GTEST_SKIP() << cuda_info().unavailable_reason;  \
  } while (0)

class CudaModelTest : public testing::SeededTest {
 protected:
  // The tiny preset with a smaller vocabulary: GDN and attention head dims 64 (what the GPU kernels take).
  static Config config() {
    Config c = preset("tiny");
    c.vocab_size = 1000;
    return c;
  }


};

// A float32 store holding exactly the bfloat16 store's values (and so the same model).
void widen(const ParamStore& bf16, const ParamStore& f32) {
  const TensorView from = bf16.param_buffer(), to = f32.param_buffer();
  for (std::int64_t i = 0; i < from.numel(); ++i) to.ptr<float>()[i] = bf16_to_float(from.ptr<std::uint16_t>()[i]);
}

// max |a - b| / max |b| over one gradient tensor.
double relative_error(const TensorView& a, const TensorView& b) {
  double error = 0, scale = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    error = std::max(error, double(std::abs(a.ptr<float>()[i] - b.ptr<float>()[i])));
    scale = std::max(scale, double(std::abs(b.ptr<float>()[i])));
  }
  return scale > 0 ? error / scale : error;
}

TEST_F(CudaModelTest, MatchesTheCpuModelInFloat32OnTheSameWeights) {
  SKIP_WITHOUT_GPU();
  const Config c = config();
  ParamStore bf16(c, DType::bf16), f32(c, DType::f32), gpu_grads(c, DType::bf16);
  bf16.init(0.05, seed_);  // wider than HF's 0.02, so that layers change what passes through them
  widen(bf16, f32);
  const std::vector<std::int32_t> cu{0, 100, 101, 230, 300};  // chunks of 64 crossed, a one-token sequence
  const std::vector<std::int32_t> tokens = testing::random_tokens(rng_, cu.back(), c.vocab_size);

  Model cpu(c, {.dtype = DType::f32});
  cpu.bind(f32.params(), f32.grads());
  f32.zero_grads();
  const double cpu_loss = cpu.forward({tokens, cu});
  cpu.backward();

  const Device gpu{DeviceType::cuda, 0};
  DeviceParams device(bf16, gpu);
  device.upload(bf16);
  device.zero_grads();
  Model model(c, {.device = gpu, .dtype = DType::bf16});
  model.bind(device.params(), device.grads());
  const double gpu_loss = model.forward({tokens, cu});
  model.backward();
  device.download_grads(gpu_grads);

  std::printf("loss: cpu float32 %.6f, gpu bfloat16 %.6f (relative %.2e)\n", cpu_loss, gpu_loss,
              std::abs(gpu_loss - cpu_loss) / cpu_loss);
  EXPECT_NEAR(gpu_loss, cpu_loss, 1e-2 * cpu_loss);
  double worst = 0;
  std::string worst_name;
  for (const ParamInfo& info : f32.infos()) {
    const double e = relative_error(gpu_grads.grad(info.name), f32.grad(info.name));
    if (e > worst) worst = e, worst_name = info.name;
    EXPECT_LT(e, 0.1) << info.name;
  }
  std::printf("gradients: worst relative error %.2e (%s)\n", worst, worst_name.c_str());
}

TEST_F(CudaModelTest, IsBitwiseDeterministic) {
  SKIP_WITHOUT_GPU();
  const Config c = config();
  ParamStore bf16(c, DType::bf16), first(c, DType::bf16), second(c, DType::bf16);
  bf16.init(0.05, seed_);
  const std::vector<std::int32_t> cu{0, 200, 333};
  const std::vector<std::int32_t> tokens = testing::random_tokens(rng_, cu.back(), c.vocab_size);
  const Device gpu{DeviceType::cuda, 0};
  DeviceParams device(bf16, gpu);
  device.upload(bf16);
  Model model(c, {.device = gpu, .dtype = DType::bf16});
  model.bind(device.params(), device.grads());
  double losses[2];
  for (int run = 0; run < 2; ++run) {
    device.zero_grads();
    losses[run] = model.forward({tokens, cu});
    model.backward();
    device.download_grads(run == 0 ? first : second);
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(std::memcmp(first.grad_buffer().data, second.grad_buffer().data, first.grad_buffer().nbytes()), 0);
}

}  // namespace
}  // namespace deltatrain::model
