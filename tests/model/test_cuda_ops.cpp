// Tests of the GPU model kernels (model/cuda/) against the CPU kernels (make_cpu_ops), which are tested
// against float64 evaluations and finite differences in test_ops.cpp. Each tensor is one Both object: the
// same values (rounded to the GPU dtype, bfloat16 or float32) in host memory as float32 for the CPU kernels
// and on the GPU for the CUDA ones, each side writing its own copy; the GPU's result is then compared with
// the CPU's relative to the largest CPU value: ~1e-2 for bfloat16 outputs, tighter for float32 statistics
// and weight gradients. Matrices are also views into wider rows whose padding must survive untouched.
// Fresh random data each run (the seed is printed on failure; DELTATRAIN_TEST_SEED=<seed> replays it).
// Every GPU test skips, with the reason, where no usable GPU is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "deltatrain/core/bfloat16.h"
#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "cuda/attention_plan.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "cuda/norm_plan.h"
#include "cuda/stream_gemm_plan.h"
#include "model_testing.h"
#include "ops.h"
#include "tensors.h"

namespace deltatrain::model {
namespace {

using testing::columns_of;

using Index = std::int64_t;
using Values = std::vector<float>;
using Offsets = std::vector<std::int32_t>;

constexpr DType bf16 = DType::bf16, f32 = DType::f32;
constexpr Device kGpu{DeviceType::cuda, 0};
constexpr double kBf16Tolerance = 1e-2;  // bfloat16 outputs: a few units of bfloat16 rounding of the largest value
constexpr double kF32Tolerance = 1e-4;   // float32 statistics and weight gradients, summed in float32
constexpr double kAttentionGradTolerance = 2e-2;  // dq, dk: see AttentionForwardAndBackward
const float kNaN = std::numeric_limits<float>::quiet_NaN();

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DevicePtr = std::unique_ptr<void, CudaFree>;

DevicePtr device_alloc(std::size_t bytes) {
  void* p = nullptr;
  cuda_check(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
  return DevicePtr(p);
}

enum class Side { cpu, gpu };

// One tensor on both sides: float32 host values for the CPU kernels, `dtype` on the GPU, rows cols + pad
// apart with a sentinel in the padding (a vector is one row).
class Both {
 public:
  Both(DType dtype, Index rows, Index cols, Index pad = 0, bool vector = false)
      : dtype_(dtype), vector_(vector), rows_(rows), cols_(cols), ld_(cols + pad),
        host_(static_cast<std::size_t>(rows * ld_), kSentinel), device_(device_alloc(host_.size() * dtype_size(dtype))) {
    set(Values(static_cast<std::size_t>(rows * cols), 0.f));
  }

  Index size() const { return rows_ * cols_; }

  // Stores the values, rounded to the GPU dtype, on both sides.
  Both& set(const Values& values) {
    for (Index i = 0; i < size(); ++i) host_[slot(i)] = round(values[i]);
    upload();
    return *this;
  }

  TensorView view(Side side) const {
    TensorView v;
    v.data = side == Side::cpu ? static_cast<void*>(host_.data()) : device_.get();
    v.dtype = side == Side::cpu ? f32 : dtype_;
    v.device = side == Side::cpu ? Device{} : kGpu;
    if (vector_) {
      v.ndim = 1;
      v.shape[0] = cols_;
      v.strides[0] = 1;
    } else {
      v.ndim = 2;
      v.shape = {rows_, cols_};
      v.strides = {ld_, 1};
    }
    return v;
  }

  Values expected() const {  // the CPU side's values
    Values out(static_cast<std::size_t>(size()));
    for (Index i = 0; i < size(); ++i) out[i] = host_[slot(i)];
    return out;
  }

  Values actual() const {  // the GPU side's values
    const Values all = download();
    Values out(static_cast<std::size_t>(size()));
    for (Index i = 0; i < size(); ++i) out[i] = all[slot(i)];
    return out;
  }

  std::vector<std::uint8_t> bytes() const {
    std::vector<std::uint8_t> out(host_.size() * dtype_size(dtype_));
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cuda_check(cudaMemcpy(out.data(), device_.get(), out.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return out;
  }

  bool padding_intact() const {
    const Values all = download();
    for (Index r = 0; r < rows_; ++r)
      for (Index c = cols_; c < ld_; ++c)
        if (all[r * ld_ + c] != kSentinel || host_[r * ld_ + c] != kSentinel) return false;
    return true;
  }

 private:
  static constexpr float kSentinel = 7.25f;  // exact in bfloat16
  std::size_t slot(Index i) const { return static_cast<std::size_t>((i / cols_) * ld_ + i % cols_); }
  float round(float v) const { return dtype_ == bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

  void upload() const {
    std::vector<std::uint8_t> raw(host_.size() * dtype_size(dtype_));
    for (std::size_t i = 0; i < host_.size(); ++i) {
      if (dtype_ == bf16) {
        const std::uint16_t bits = float_to_bf16(host_[i]);
        std::memcpy(raw.data() + 2 * i, &bits, 2);
      } else {
        std::memcpy(raw.data() + 4 * i, &host_[i], 4);
      }
    }
    cuda_check(cudaMemcpy(device_.get(), raw.data(), raw.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
  }

  Values download() const {
    const std::vector<std::uint8_t> raw = bytes();
    Values out(host_.size());
    for (std::size_t i = 0; i < host_.size(); ++i) {
      if (dtype_ == bf16) {
        std::uint16_t bits;
        std::memcpy(&bits, raw.data() + 2 * i, 2);
        out[i] = bf16_to_float(bits);
      } else {
        std::memcpy(&out[i], raw.data() + 4 * i, 4);
      }
    }
    return out;
  }

  DType dtype_;
  bool vector_;
  Index rows_, cols_, ld_;
  mutable std::vector<float> host_;  // a view hands out a writable pointer
  DevicePtr device_;
};

// int32 values on the host and the device.
class Indices {
 public:
  explicit Indices(std::vector<std::int32_t> values)
      : host_(std::move(values)), device_(device_alloc(host_.size() * sizeof(std::int32_t))) {
    cuda_check(cudaMemcpy(device_.get(), host_.data(), host_.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice),
               "cudaMemcpy");
  }
  IndexArray array() const { return IndexArray(std::span<const std::int32_t>(host_), static_cast<const std::int32_t*>(device_.get())); }

 private:
  std::vector<std::int32_t> host_;
  DevicePtr device_;
};

Offsets offsets(const std::vector<Index>& lengths) {
  Offsets cu{0};
  for (const Index n : lengths) cu.push_back(static_cast<std::int32_t>(cu.back() + n));
  return cu;
}

// max |actual - expected| / max |expected| (infinite when anything is not finite).
double relative_error(const Values& actual, const Values& expected) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i]) || !std::isfinite(expected[i])) return INFINITY;
    diff = std::max(diff, std::abs(double(actual[i]) - expected[i]));
    scale = std::max(scale, std::abs(double(expected[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

std::string short_number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", x);
  return text;
}

// The GPU's copy of `t` against the CPU's, and the padding of both untouched.
::testing::AssertionResult matches(const std::string& what, const Both& t, double tolerance) {
  const double error = relative_error(t.actual(), t.expected());
  // Every error goes into the XML report (--gtest_output=xml), numbered: the accuracy on record.
  static int recorded = 0;
  ::testing::Test::RecordProperty(what + " #" + std::to_string(++recorded), short_number(error));
  if (error > tolerance)
    return ::testing::AssertionFailure() << what << ": relative error " << error << " > " << tolerance;
  if (!t.padding_intact()) return ::testing::AssertionFailure() << what << ": a kernel wrote into the row padding";
  return ::testing::AssertionSuccess();
}

unsigned test_seed() {
  const char* fixed = std::getenv("DELTATRAIN_TEST_SEED");
  return fixed ? static_cast<unsigned>(std::strtoul(fixed, nullptr, 10)) : std::random_device{}();
}

// Why the GPU tests cannot run here, or empty.
std::string gpu_unusable() {
  if (!cuda_info().usable()) return "no usable GPU: " + cuda_info().unavailable_reason;
  if (cuda_info().gpus.front().cc_major < 8) return "the GPU model needs compute capability 8.0 or newer";
  return "";
}

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = gpu_unusable(); !why.empty()) GTEST_SKIP() << why;
    gpu_ = make_cuda_ops(kGpu, nullptr);
  }

  // The same call on the CPU kernels and on the GPU kernels, each with its side's views.
  template <class Call>
  void on_both(const Call& call) {
    call(*cpu_, Side::cpu);
    call(*gpu_, Side::gpu);
  }

  Values uniform(Index n, double lo = -1, double hi = 1) {
    std::uniform_real_distribution<double> dist(lo, hi);
    Values v(static_cast<std::size_t>(n));
    for (float& x : v) x = static_cast<float>(dist(rng_));
    return v;
  }
  Both random(DType dtype, Index rows, Index cols, Index pad = 0, double lo = -1, double hi = 1) {
    Both t(dtype, rows, cols, pad);
    t.set(uniform(rows * cols, lo, hi));
    return t;
  }
  Both random_vec(DType dtype, Index n, double lo = -1, double hi = 1) {
    Both t(dtype, 1, n, 0, true);
    t.set(uniform(n, lo, hi));
    return t;
  }
  // An output that must be overwritten: NaN on both sides.
  static Both unset(DType dtype, Index rows, Index cols, Index pad = 0) {
    Both t(dtype, rows, cols, pad);
    t.set(Values(static_cast<std::size_t>(rows * cols), kNaN));
    return t;
  }
  static Both unset_vec(DType dtype, Index n) {
    Both t(dtype, 1, n, 0, true);
    t.set(Values(static_cast<std::size_t>(n), kNaN));
    return t;
  }
  std::vector<std::int32_t> random_ints(Index n, int lo, int hi) {
    std::uniform_int_distribution<int> dist(lo, hi);
    std::vector<std::int32_t> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = dist(rng_);
    return v;
  }

  unsigned seed_ = test_seed();
  ::testing::ScopedTrace trace_{
      __FILE__, __LINE__,
      "random seed " + std::to_string(seed_) + ": replay with DELTATRAIN_TEST_SEED=" + std::to_string(seed_)};
  std::mt19937 rng_{seed_};
  std::unique_ptr<Ops> cpu_ = make_cpu_ops(0), gpu_;
};

// Row layouts of the elementwise and row-wise tests: 16-byte accesses (cols and row stride multiples of 8),
// the same with a wider row stride, and element-by-element with an odd row stride.
struct Layout {
  Index cols, pad;
};
// Rows of a warp's 32 lanes and of half a warp (at most 128 columns), 16-byte accesses or (37) element ones; and
// wider rows that the norms' forward holds in 2 and 4 steps (384, 1000) or walks by the column loops (1100).
const Layout kLayouts[] = {{256, 0}, {128, 8}, {64, 24}, {37, 3}, {384, 8}, {1000, 0}, {1100, 4}};

// ---------------------------------------------------------------------------------------------------------

TEST(CudaOpsAvailability, UnavailableWithoutGpu) {
  if (gpu_unusable().empty()) GTEST_SKIP() << "a usable GPU is present; the other tests cover it";
  EXPECT_THROW(make_cuda_ops(kGpu, nullptr), Unavailable);
}

// The norms' row layout (norm_plan.h): pure, so it runs without a GPU. Over every width up to past the widest held
// row: half a warp exactly up to 128 columns, and the fewest held steps that cover the row, none past 4.
TEST(NormRowPlan, HalfAWarpForNarrowRowsAndTheFewestStepsThatHoldARow) {
  for (Index cols = 1; cols <= 1300; ++cols) {
    SCOPED_TRACE("cols " + std::to_string(cols));
    const cuda::NormRowPlan plan = cuda::plan_norm_row(cols);
    EXPECT_EQ(plan.lanes, cols <= 128 ? 16 : 32);
    const Index per_step = Index{plan.lanes} * cuda::kNormVector;
    if (plan.held_steps == 0) {
      EXPECT_GT(cols, cuda::kNormMaxHeldSteps * per_step) << "a row that fits is held";
      continue;
    }
    EXPECT_TRUE(plan.held_steps == 1 || plan.held_steps == 2 || plan.held_steps == 4);
    EXPECT_LE(cols, plan.held_steps * per_step) << "the steps hold the row";
    if (plan.held_steps > 1) {
      EXPECT_GT(cols, plan.held_steps / 2 * per_step) << "fewer steps would hold it";
    }
  }
}

// The attention kernels' choice (attention_plan.h): pure, so it runs without a GPU.
TEST(AttentionPlan, CudnnWhereItAppliesTheUnfusedKernelsElsewhere) {
  using cuda::AttentionKernels;
  cuda::AttentionPlanInputs qwen;  // Qwen3.5's heads in a build with cuDNN
  qwen.cudnn_built = true;
  qwen.head_dim = 256;
  qwen.rows_aligned = true;
  EXPECT_EQ(cuda::plan_attention(qwen), AttentionKernels::cudnn);
  const auto with = [&](auto change) {
    cuda::AttentionPlanInputs in = qwen;
    change(in);
    return cuda::plan_attention(in);
  };
  EXPECT_EQ(with([](auto& in) { in.backward = true; }), AttentionKernels::cudnn);
  EXPECT_EQ(with([](auto& in) { in.head_dim = 64; }), AttentionKernels::cudnn);
  for (const int head_dim : {68, 264, 512})
    EXPECT_EQ(with([&](auto& in) { in.head_dim = head_dim; }), AttentionKernels::unfused) << head_dim;
  EXPECT_EQ(with([](auto& in) { in.rows_aligned = false; }), AttentionKernels::unfused);
  EXPECT_EQ(with([](auto& in) { in.cudnn_built = false; }), AttentionKernels::unfused);
  EXPECT_EQ(with([](auto& in) { in.cudnn_allowed = false; }), AttentionKernels::unfused);
  // Batch invariance binds the forward (the log-probabilities) only.
  EXPECT_EQ(with([](auto& in) { in.batch_invariant = true; }), AttentionKernels::rows);
  EXPECT_EQ(with([](auto& in) { in.batch_invariant = true, in.head_dim = 68; }), AttentionKernels::rows);
  EXPECT_EQ(with([](auto& in) { in.batch_invariant = true, in.backward = true; }), AttentionKernels::cudnn);
}

// The cached attention's plan (attention_plan.h) on random GQA shapes: tensor cores exactly for aligned head dims
// 64, 128, 256; heads a CTA a divisor of the group within the kernel's limit (8 heads, or 4 heads x 256-element
// chunks), and no larger one of 8, 4, 2 that would fit.
TEST(AttentionPlan, CachedAttentionTakesTheWidestHeadBlockThatFits) {
  std::mt19937 rng(test_seed());
  std::uniform_int_distribution<int> groups(1, 16), head_dims(1, cuda::kMaxCachedHeadDim);
  const cuda::CachedAttentionPlan qwen = cuda::plan_cached_attention(4, 256, true);  // Qwen3.5's attention layers
  EXPECT_TRUE(qwen.tensor_cores);
  EXPECT_EQ(qwen.heads, 4);
  for (int trial = 0; trial < 1000; ++trial) {
    const int group = groups(rng), head_dim = trial % 4 == 0 ? 64 << (trial / 4 % 3) : head_dims(rng);
    const bool aligned = trial % 3 != 0;
    const cuda::CachedAttentionPlan plan = cuda::plan_cached_attention(group, head_dim, aligned);
    SCOPED_TRACE("group " + std::to_string(group) + ", head_dim " + std::to_string(head_dim) + ", aligned " +
                 std::to_string(aligned));
    EXPECT_EQ(plan.tensor_cores, aligned && (head_dim == 64 || head_dim == 128 || head_dim == 256));
    const int most = plan.tensor_cores ? 8 : head_dim <= 256 ? 4 : 2;
    ASSERT_TRUE(plan.heads == 1 || plan.heads == 2 || plan.heads == 4 || plan.heads == 8) << plan.heads;
    EXPECT_EQ(group % plan.heads, 0);
    EXPECT_LE(plan.heads, most);
    for (const int wider : {2, 4, 8}) {
      if (wider > plan.heads) {
        EXPECT_FALSE(group % wider == 0 && wider <= most) << wider << " would fit";
      }
    }
  }
}

// Decode's attention inputs run as one kernel exactly where its warp-a-head form holds them (attention_plan.h).
TEST(AttentionPlan, AttentionInputsFuseWhereAWarpHoldsAHead) {
  EXPECT_TRUE(cuda::fuse_attention_inputs(8, 2, 256, 64, true));    // Qwen3.5
  EXPECT_TRUE(cuda::fuse_attention_inputs(16, 2, 256, 64, true));   // Qwen3-Next
  EXPECT_TRUE(cuda::fuse_attention_inputs(2, 1, 64, 32, true));     // half a warp's row
  EXPECT_TRUE(cuda::fuse_attention_inputs(24, 8, 96, 96, true));    // 32 warps, a head of 12 lanes
  EXPECT_FALSE(cuda::fuse_attention_inputs(8, 2, 256, 64, false)) << "rows not 16-byte aligned";
  EXPECT_FALSE(cuda::fuse_attention_inputs(8, 2, 264, 64, true)) << "a head wider than a warp's 256 elements";
  EXPECT_FALSE(cuda::fuse_attention_inputs(8, 2, 68, 32, true)) << "a head not in 16-byte accesses";
  EXPECT_FALSE(cuda::fuse_attention_inputs(8, 2, 256, 8, true)) << "rotated pairs 4 elements apart: within a lane";
  EXPECT_FALSE(cuda::fuse_attention_inputs(8, 2, 256, 40, true)) << "rotated pairs 20 elements apart";
  EXPECT_FALSE(cuda::fuse_attention_inputs(32, 1, 128, 64, true)) << "33 warps a CTA";
}

// The weight-streaming product's plan (stream_gemm_plan.h): pure, so it runs without a GPU.
cuda::StreamGemmProblem decode_product(Index M, Index N, Index K) {
  cuda::StreamGemmProblem p;
  p.M = M;
  p.N = N;
  p.K = K;
  p.lda = K;
  p.ldb = K;
  p.align_a = 256;
  p.align_b = 256;
  p.device_ready = true;
  return p;
}

TEST(StreamGemmPlan, TakesOnlyFewRowsTimesANarrowAlignedWeight) {
  ASSERT_TRUE(cuda::plan_stream_gemm(decode_product(16, 1024, 3584), 132).has_value());
  const std::pair<const char*, void (*)(cuda::StreamGemmProblem&)> refusals[] = {
      {"a transposed", [](auto& p) { p.trans_a = true; }},
      {"b not transposed", [](auto& p) { p.trans_b = false; }},
      {"65 rows", [](auto& p) { p.M = 65; }},
      {"no rows", [](auto& p) { p.M = 0; }},
      {"K not a multiple of the chunk", [](auto& p) { p.K = 3584 + 32; }},
      {"a 8-byte aligned", [](auto& p) { p.align_a = 8; }},
      {"b 8-byte aligned", [](auto& p) { p.align_b = 8; }},
      {"a's row stride odd", [](auto& p) { p.lda = 3585; }},
      {"b's row stride not 16 bytes", [](auto& p) { p.ldb = 3588; }},
      {"more feature tiles than 8 splits of each fill in one wave", [](auto& p) { p.N = 64 * 33 + 1; }},
      {"row-invariant", [](auto& p) { p.row_invariant = true; }},
      {"not built for the device", [](auto& p) { p.device_ready = false; }},
      {"switched off", [](auto& p) { p.allowed = false; }},
  };
  for (const auto& [why, change] : refusals) {
    cuda::StreamGemmProblem p = decode_product(16, 1024, 3584);
    change(p);
    EXPECT_FALSE(cuda::plan_stream_gemm(p, 132).has_value()) << why;
  }
  EXPECT_TRUE(cuda::plan_stream_gemm(decode_product(16, 64 * 33, 1024), 132).has_value()) << "one whole wave";
}

TEST(StreamGemmPlan, RulesOverRandomShapesAndDevices) {
  std::mt19937 rng(test_seed());
  std::uniform_int_distribution<Index> rows(1, cuda::kStreamMaxRows), chunks(1, 128);
  // From the smallest device on which a narrow product fills a wave with eight splits.
  std::uniform_int_distribution<int> sms(cuda::kStreamMaxSplits / cuda::kStreamCtasPerSm, 200);
  for (int trial = 0; trial < 2000; ++trial) {
    const int multiprocessors = sms(rng);
    const Index one_wave = Index{cuda::kStreamCtasPerSm} * multiprocessors;
    const Index M = rows(rng), K = cuda::kStreamChunk * chunks(rng);
    const Index N =
        std::uniform_int_distribution<Index>(1, cuda::kStreamFeatures * (one_wave / cuda::kStreamMaxSplits))(rng);
    SCOPED_TRACE("M " + std::to_string(M) + ", N " + std::to_string(N) + ", K " + std::to_string(K) + ", SMs " +
                 std::to_string(multiprocessors));
    const std::optional<cuda::StreamGemmPlan> plan = cuda::plan_stream_gemm(decode_product(M, N, K), multiprocessors);
    ASSERT_TRUE(plan.has_value());
    // Every feature in exactly one tile; splits a power of two up to a cluster, each with two chunks or more, and
    // split only while the CTAs stay within one wave.
    EXPECT_EQ(plan->feature_tiles, (N + cuda::kStreamFeatures - 1) / cuda::kStreamFeatures);
    EXPECT_TRUE(plan->splits == 1 || plan->splits == 2 || plan->splits == 4 || plan->splits == 8) << plan->splits;
    EXPECT_LE(plan->splits, cuda::kStreamMaxSplits);
    if (plan->splits > 1) {
      EXPECT_LE(plan->feature_tiles * plan->splits, one_wave);
      EXPECT_GE(K / cuda::kStreamChunk, 2 * plan->splits);
    }
    // As far as the rule allows: one more doubling would overflow the wave, the cluster or the chunks.
    EXPECT_TRUE(plan->splits == cuda::kStreamMaxSplits || plan->feature_tiles * plan->splits * 2 > one_wave ||
                K / cuda::kStreamChunk < 4 * plan->splits);
    // Nothing depends on M: a row's result is computed the same way at every batch size.
    for (const Index other : {Index{1}, Index{cuda::kStreamMaxRows}}) {
      EXPECT_EQ(cuda::plan_stream_gemm(decode_product(other, N, K), multiprocessors), plan);
    }
  }
}

TEST(StreamGemmPlan, TheDecodeProductsOfQwen35On132Sms) {
  const auto plan = [](Index N, Index K) { return cuda::plan_stream_gemm(decode_product(16, N, K), 132); };
  EXPECT_EQ(plan(1024, 3584)->splits, 8);  // the MLP's down: 16 tiles of 56 chunks
  EXPECT_EQ(plan(1024, 2048)->splits, 8);  // out_proj and o_proj
  EXPECT_EQ(plan(512, 1024)->splits, 8);   // k or v: 8 tiles of 16 chunks, two a split
  // cuBLASLt's: the stacked GDN input projections (129 tiles), the MLP's gate and up (112), attention's q and gate
  // (64), the lm_head (3880); and every product past 64 rows.
  for (const Index N : {8224, 7168, 4096, 248320}) EXPECT_FALSE(plan(N, 1024).has_value()) << N;
  EXPECT_EQ(cuda::plan_stream_gemm(decode_product(64, 1024, 3584), 132), plan(1024, 3584));
  EXPECT_FALSE(cuda::plan_stream_gemm(decode_product(65, 1024, 3584), 132).has_value());
}

TEST_F(CudaOpsTest, GemmMatchesCpuForEveryTranspositionAndOutputType) {
  const Index M = 37, N = 53, K = 70;
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      SCOPED_TRACE("trans_a " + std::to_string(ta) + ", trans_b " + std::to_string(tb));
      const Both a = ta ? random(bf16, K, M, 5) : random(bf16, M, K, 6);
      const Both b = tb ? random(bf16, N, K, 8) : random(bf16, K, N, 3);
      // Activations: bfloat16, overwritten and accumulated; weight gradients: float32 accumulated.
      const Both c_new = unset(bf16, M, N, 11), c_acc = random(bf16, M, N, 0), c_f32 = random(f32, M, N, 2);
      on_both([&](Ops& ops, Side s) {
        ops.gemm(ta, tb, 0.5, a.view(s), b.view(s), 0, c_new.view(s));
        ops.gemm(ta, tb, 1, a.view(s), b.view(s), 1, c_acc.view(s));
        ops.gemm(ta, tb, 1, a.view(s), b.view(s), 1, c_f32.view(s));
      });
      EXPECT_TRUE(matches("c (bfloat16, beta 0)", c_new, kBf16Tolerance));
      EXPECT_TRUE(matches("c (bfloat16, beta 1)", c_acc, kBf16Tolerance));
      EXPECT_TRUE(matches("c (float32, beta 1)", c_f32, 1e-5));
    }
  }
}

// gemm_add: the product with the residual added (cuBLASLt reading c apart from d, or in place), against the CPU's
// float32, for bfloat16 and float32 results; a residual of another row stride takes the copy-then-accumulate path.
TEST_F(CudaOpsTest, GemmAddIsTheProductPlusTheResidual) {
  const Index M = 45, N = 72, K = 96;
  const Both a = random(bf16, M, K, 8), b = random(bf16, N, K, 0);
  for (const DType dtype : {bf16, f32}) {
    SCOPED_TRACE(dtype_name(dtype));
    const double tolerance = dtype == bf16 ? kBf16Tolerance : 1e-5;
    const Both c = random(dtype, M, N, 8, -4, 4), d = unset(dtype, M, N, 8);
    const Both c_other_stride = random(dtype, M, N, 0, -4, 4), d_apart = unset(dtype, M, N, 8);
    const Both in_place = random(dtype, M, N, 8, -4, 4);
    on_both([&](Ops& ops, Side s) {
      ops.gemm_add(false, true, 0.5, a.view(s), b.view(s), c.view(s), d.view(s));
      ops.gemm_add(false, true, 1, a.view(s), b.view(s), c_other_stride.view(s), d_apart.view(s));
      ops.gemm_add(false, true, 1, a.view(s), b.view(s), in_place.view(s), in_place.view(s));
    });
    EXPECT_TRUE(matches("d", d, tolerance));
    EXPECT_TRUE(matches("d (residual of another row stride)", d_apart, tolerance));
    EXPECT_TRUE(matches("d (in place)", in_place, tolerance));
    EXPECT_TRUE(matches("c (read only)", c, 0));
  }
}

TEST_F(CudaOpsTest, GemmSingleRowAndColumnSliceOperands) {
  // x [1, K] times a column slice of a wider weight: the row stride of b exceeds its columns.
  const Both x = random(bf16, 1, 96), w = random(bf16, 40, 96, 32), y = unset(bf16, 1, 40);
  on_both([&](Ops& ops, Side s) { ops.gemm(false, true, 1, x.view(s), w.view(s), 0, y.view(s)); });
  EXPECT_TRUE(matches("y", y, kBf16Tolerance));
}

TEST_F(CudaOpsTest, EmbeddingForwardAndDeterministicBackward) {
  const Index V = 300, H = 72, T = 200;
  // Few distinct tokens, so most table rows collect several positions.
  const Indices tokens(random_ints(T, 0, 40));
  const Both table = random(bf16, V, H, 8), out = unset(bf16, T, H, 0);
  const Both dout = random(bf16, T, H, 0), dtable = random(f32, V, H, 0);
  on_both([&](Ops& ops, Side s) {
    ops.embedding_forward(out.view(s), tokens.array(), table.view(s));
    ops.embedding_backward(dtable.view(s), tokens.array(), dout.view(s));
  });
  EXPECT_TRUE(matches("out", out, 0));
  EXPECT_TRUE(matches("dtable", dtable, 1e-5));
}

// Odd row counts: with half a warp per row, the last warp holds a row and a group past the last row.
TEST_F(CudaOpsTest, RmsnormForwardAndBackward) {
  const Index R = 151;
  for (const Layout& l : kLayouts) {
    for (const bool zc : {true, false}) {
      SCOPED_TRACE("cols " + std::to_string(l.cols) + ", pad " + std::to_string(l.pad) + ", zero_centred " +
                   std::to_string(zc));
      const Both x = random(bf16, R, l.cols, l.pad, -2, 2), w = random_vec(bf16, l.cols);
      const Both out = unset(bf16, R, l.cols, l.pad), rstd = unset_vec(f32, R);
      on_both([&](Ops& ops, Side s) { ops.rmsnorm_forward(out.view(s), rstd.view(s), x.view(s), w.view(s), 1e-6, zc); });
      EXPECT_TRUE(matches("out", out, kBf16Tolerance));
      EXPECT_TRUE(matches("rstd", rstd, 1e-5));

      // The backward on the CPU's rstd; dx both overwritten and accumulated.
      Both saved = Both(f32, 1, R, 0, true);
      saved.set(rstd.expected());
      const Both dout = random(bf16, R, l.cols, l.pad), dweight = random_vec(f32, l.cols);
      const Both dx = unset(bf16, R, l.cols, l.pad), dx_acc = random(bf16, R, l.cols, l.pad);
      on_both([&](Ops& ops, Side s) {
        ops.rmsnorm_backward(dx.view(s), dweight.view(s), dout.view(s), x.view(s), saved.view(s), w.view(s), zc,
                             false);
        ops.rmsnorm_backward(dx_acc.view(s), dweight.view(s), dout.view(s), x.view(s), saved.view(s), w.view(s), zc,
                             true);
      });
      EXPECT_TRUE(matches("dx", dx, kBf16Tolerance));
      EXPECT_TRUE(matches("dx (accumulated)", dx_acc, kBf16Tolerance));
      EXPECT_TRUE(matches("dweight", dweight, kF32Tolerance));
    }
  }
}

// The residual add fused into the norm: on the GPU bitwise the add, then the norm (the sum stored in bfloat16
// before its norm), and within bfloat16 of the CPU; over every layout (16-byte groups and element by element).
TEST_F(CudaOpsTest, AddRmsnormEqualsTheAddThenTheNorm) {
  const Index R = 77;
  for (const Layout& l : kLayouts) {
    SCOPED_TRACE("cols " + std::to_string(l.cols) + ", pad " + std::to_string(l.pad));
    const Values x0 = random(bf16, R, l.cols, l.pad, -2, 2).expected();
    const Both residual = random(bf16, R, l.cols, l.pad, -2, 2), w = random_vec(bf16, l.cols);
    Both fused_x(bf16, R, l.cols, l.pad), apart_x(bf16, R, l.cols, l.pad);
    fused_x.set(x0);
    apart_x.set(x0);
    const Both fused = unset(bf16, R, l.cols, l.pad), apart = unset(bf16, R, l.cols, l.pad);
    const Both fused_rstd = unset_vec(f32, R), apart_rstd = unset_vec(f32, R);
    on_both([&](Ops& ops, Side s) {
      ops.add_rmsnorm_forward(fused.view(s), fused_rstd.view(s), fused_x.view(s), residual.view(s), w.view(s), 1e-6,
                              true);
      ops.add(apart_x.view(s), residual.view(s));
      ops.rmsnorm_forward(apart.view(s), apart_rstd.view(s), apart_x.view(s), w.view(s), 1e-6, true);
    });
    EXPECT_EQ(fused_x.actual(), apart_x.actual());
    EXPECT_EQ(fused.actual(), apart.actual());
    EXPECT_EQ(fused_rstd.actual(), apart_rstd.actual());
    EXPECT_TRUE(matches("x + residual", fused_x, kBf16Tolerance));
    EXPECT_TRUE(matches("out", fused, kBf16Tolerance));
    EXPECT_TRUE(fused_x.padding_intact() && fused.padding_intact());
  }
}

TEST_F(CudaOpsTest, RmsnormOnHalfRows) {
  // q_norm reads the first half of each row of q_proj's output seen as [T * heads, 2 * width] (tensors.h's
  // interleaved_half): rows 2 * width apart.
  const Index rows = 90, width = 64;
  const Both qg = random(bf16, rows, 2 * width, 0, -2, 2);
  TensorView halves[2];
  for (const Side s : {Side::cpu, Side::gpu}) {
    TensorView v = qg.view(s);
    v.strides[0] = 2 * width;
    v.shape[1] = width;
    halves[s == Side::gpu] = v;
  }
  const Both w = random_vec(bf16, width), out = unset(bf16, rows, width), rstd = unset_vec(f32, rows);
  on_both([&](Ops& ops, Side s) {
    ops.rmsnorm_forward(out.view(s), rstd.view(s), halves[s == Side::gpu], w.view(s), 1e-6, true);
  });
  EXPECT_TRUE(matches("out", out, kBf16Tolerance));
  EXPECT_TRUE(matches("rstd", rstd, 1e-5));
}

// Rows of 3 heads, each normalised on its own, z and the outputs with row strides of their own.
TEST_F(CudaOpsTest, GatedRmsnormForwardAndBackward) {
  const Index R = 121, heads = 3;
  for (const Layout& l : kLayouts) {
    SCOPED_TRACE("head width " + std::to_string(l.cols) + ", pad " + std::to_string(l.pad));
    const Index cols = heads * l.cols;
    const Both x = random(bf16, R, cols, l.pad, -2, 2), z = random(bf16, R, cols, 2 * l.pad, -3, 3);
    const Both w = random_vec(bf16, l.cols, 0.5, 1.5);
    const Both out = unset(bf16, R, cols, l.pad), rstd = unset_vec(f32, R * heads);
    on_both([&](Ops& ops, Side s) {
      ops.gated_rmsnorm_forward(out.view(s), rstd.view(s), x.view(s), z.view(s), w.view(s), 1e-6);
    });
    EXPECT_TRUE(matches("out", out, kBf16Tolerance));
    EXPECT_TRUE(matches("rstd", rstd, 1e-5));

    Both saved = Both(f32, 1, R * heads, 0, true);
    saved.set(rstd.expected());
    const Both dout = random(bf16, R, cols, l.pad), dweight = random_vec(f32, l.cols);
    const Both dx = unset(bf16, R, cols, l.pad), dz = unset(bf16, R, cols, 3 * l.pad);
    on_both([&](Ops& ops, Side s) {
      ops.gated_rmsnorm_backward(dx.view(s), dz.view(s), dweight.view(s), dout.view(s), x.view(s), z.view(s),
                                 saved.view(s), w.view(s));
    });
    EXPECT_TRUE(matches("dx", dx, kBf16Tolerance));
    EXPECT_TRUE(matches("dz", dz, kBf16Tolerance));
    EXPECT_TRUE(matches("dweight", dweight, kF32Tolerance));
  }
}

// Sequences shorter than the kernel, empty ones, and sequences across the kernels' strips of 64 rows; channels in
// 16-byte groups (136 = 17 x 8, rows 8-aligned) and element by element (40 channels, unaligned rows).
TEST_F(CudaOpsTest, Conv1dSiluOverPackedSequences) {
  const Offsets cu = offsets({1, 5, 70, 0, 13, 3, 200, 2, 300});
  const Index T = cu.back();
  const Indices sequences(cu);
  struct Channels {
    Index count, x_pad, out_pad, dx_pad;
  };
  for (const Channels c : {Channels{40, 2, 6, 1}, Channels{136, 8, 0, 16}}) {
    for (const Index W : {4, 3}) {
      SCOPED_TRACE("channels " + std::to_string(c.count) + ", conv width " + std::to_string(W));
      const Index C = c.count;
      const Both x = random(bf16, T, C, c.x_pad, -2, 2), w = random(bf16, C, W, 0);
      const Both out = unset(bf16, T, C, c.out_pad);
      const Both dout = random(bf16, T, C, 0), dx = unset(bf16, T, C, c.dx_pad), dweight = random(f32, C, W, 0);
      on_both([&](Ops& ops, Side s) {
        ops.conv1d_silu_forward(out.view(s), x.view(s), w.view(s), sequences.array());
        ops.conv1d_silu_backward(dx.view(s), dweight.view(s), dout.view(s), x.view(s), w.view(s), sequences.array());
      });
      EXPECT_TRUE(matches("out", out, kBf16Tolerance));
      EXPECT_TRUE(matches("dx", dx, kBf16Tolerance));
      EXPECT_TRUE(matches("dweight", dweight, kF32Tolerance));
    }
  }
}

TEST_F(CudaOpsTest, GdnGatesForwardAndBackward) {
  const Index T = 150, H = 12;
  // a + dt_bias spans softplus's threshold of 20.
  const Both a = random(bf16, T, H, 4, -6, 24), b = random(bf16, T, H, 0, -6, 6);
  const Both a_log = random_vec(bf16, H, -1, 1), dt_bias = random_vec(bf16, H, -1, 1);
  const Both g = unset(f32, T, H, 0), beta = unset(f32, T, H, 0);
  const Both dg = random(f32, T, H, 0), dbeta = random(f32, T, H, 0);
  const Both da = unset(bf16, T, H, 0), db = unset(bf16, T, H, 0);
  const Both da_log = random_vec(f32, H), ddt_bias = random_vec(f32, H);
  on_both([&](Ops& ops, Side s) {
    ops.gdn_gates_forward(g.view(s), beta.view(s), a.view(s), b.view(s), a_log.view(s), dt_bias.view(s));
    ops.gdn_gates_backward(da.view(s), db.view(s), da_log.view(s), ddt_bias.view(s), dg.view(s), dbeta.view(s),
                           a.view(s), b.view(s), a_log.view(s), dt_bias.view(s));
  });
  EXPECT_TRUE(matches("g", g, 1e-5));
  EXPECT_TRUE(matches("beta", beta, 1e-5));
  EXPECT_TRUE(matches("da", da, kBf16Tolerance));
  EXPECT_TRUE(matches("db", db, kBf16Tolerance));
  EXPECT_TRUE(matches("dA_log", da_log, kF32Tolerance));
  EXPECT_TRUE(matches("ddt_bias", ddt_bias, kF32Tolerance));
}

TEST_F(CudaOpsTest, RopeFullAndPartialForwardAndInverse) {
  const Offsets cu = offsets({1, 70, 130, 0, 9});
  const Indices sequences(cu);
  const Index T = cu.back();
  const int heads = 3, head_dim = 64;
  for (const int rotary_dim : {16, 64}) {
    for (const bool inverse : {false, true}) {
      for (const double theta : {10000.0, 1e7}) {
        SCOPED_TRACE("rotary_dim " + std::to_string(rotary_dim) + ", inverse " + std::to_string(inverse) +
                     ", theta " + std::to_string(theta));
        const Both x = random(bf16, T, heads * head_dim, 8);
        on_both([&](Ops& ops, Side s) {
          ops.rope(x.view(s), heads, head_dim, rotary_dim, theta, sequences.array(), inverse);
        });
        EXPECT_TRUE(matches("x", x, kBf16Tolerance));
      }
    }
  }
}

struct AttentionCase {
  int q_heads, kv_heads, head_dim;
  std::vector<Index> lengths;
  Index q_pad, kv_pad;
};

TEST_F(CudaOpsTest, AttentionForwardAndBackward) {
  const AttentionCase cases[] = {
      {4, 2, 64, {1, 70, 33, 0, 129}, 8, 16},  // GQA, lengths around 64, an empty and a 1-token sequence
      {2, 2, 128, {65, 3}, 0, 0},              // MHA
      {4, 1, 256, {40, 17}, 0, 8},             // one kv head for the group, the largest head dim
      {3, 1, 68, {50}, 0, 0},                  // a head dim off multiples of 8: element-by-element head moves
      {8, 2, 256, {1024}, 0, 0},               // Qwen3.5's attention heads on a longer sequence
  };
  for (const AttentionCase& c : cases) {
    SCOPED_TRACE("q_heads " + std::to_string(c.q_heads) + ", kv_heads " + std::to_string(c.kv_heads) +
                 ", head_dim " + std::to_string(c.head_dim));
    const Offsets cu = offsets(c.lengths);
    const Indices sequences(cu);
    const Index T = cu.back(), q_cols = Index{c.q_heads} * c.head_dim, kv_cols = Index{c.kv_heads} * c.head_dim;
    const double scale = 1 / std::sqrt(double(c.head_dim));
    const Both q = random(bf16, T, q_cols, c.q_pad, -2, 2), k = random(bf16, T, kv_cols, c.kv_pad, -2, 2);
    const Both v = random(bf16, T, kv_cols, c.kv_pad);
    const Both o = unset(bf16, T, q_cols, c.q_pad), lse = unset(f32, c.q_heads, T, 0);
    on_both([&](Ops& ops, Side s) {
      ops.attention_forward(o.view(s), lse.view(s), q.view(s), k.view(s), v.view(s), c.q_heads, c.kv_heads,
                            c.head_dim, scale, sequences.array());
    });
    EXPECT_TRUE(matches("o", o, kBf16Tolerance));
    EXPECT_TRUE(matches("lse", lse, kF32Tolerance));

    // The backward on the CPU's forward results (o rounded to bfloat16), the same on both sides.
    Both o_saved(bf16, T, q_cols, c.q_pad), lse_saved(f32, c.q_heads, T, 0);
    o_saved.set(o.expected());
    lse_saved.set(lse.expected());
    const Both dout = random(bf16, T, q_cols, c.q_pad);
    const Both dq = unset(bf16, T, q_cols, c.q_pad), dk = unset(bf16, T, kv_cols, c.kv_pad);
    const Both dv = unset(bf16, T, kv_cols, c.kv_pad);
    on_both([&](Ops& ops, Side s) {
      ops.attention_backward(dq.view(s), dk.view(s), dv.view(s), dout.view(s), q.view(s), k.view(s), v.view(s),
                             o_saved.view(s), lse_saved.view(s), c.q_heads, c.kv_heads, c.head_dim, scale,
                             sequences.array());
    });
    // dS is rounded to bfloat16 before the products (as fused kernels do), and dq and dk are sums of terms
    // that largely cancel (each row of dS sums to zero): their error relative to the largest value is about
    // twice that of the other outputs (seen up to 7e-3).
    EXPECT_TRUE(matches("dq", dq, kAttentionGradTolerance));
    EXPECT_TRUE(matches("dk", dk, kAttentionGradTolerance));
    EXPECT_TRUE(matches("dv", dv, kBf16Tolerance));
  }
}

TEST_F(CudaOpsTest, ElementwiseOps) {
  const Index R = 70;
  for (const Layout& l : kLayouts) {
    SCOPED_TRACE("cols " + std::to_string(l.cols) + ", pad " + std::to_string(l.pad));
    const Index C = l.cols, P = l.pad;
    const Both x = random(bf16, R, C, P, -3, 3), gate = random(bf16, R, C, P, -6, 6), dout = random(bf16, R, C, P);
    const Both out = unset(bf16, R, C, P), dx = unset(bf16, R, C, P), dgate = unset(bf16, R, C, 0);
    const Both swi = unset(bf16, R, C, P), dg2 = unset(bf16, R, C, P), dup = unset(bf16, R, C, P);
    const Both y = random(bf16, R, C, P);
    on_both([&](Ops& ops, Side s) {
      ops.sigmoid_gate_forward(out.view(s), x.view(s), gate.view(s));
      ops.sigmoid_gate_backward(dx.view(s), dgate.view(s), dout.view(s), x.view(s), gate.view(s));
      ops.swiglu_forward(swi.view(s), gate.view(s), x.view(s));
      ops.swiglu_backward(dg2.view(s), dup.view(s), dout.view(s), gate.view(s), x.view(s));
      ops.add(y.view(s), x.view(s));
    });
    EXPECT_TRUE(matches("sigmoid_gate out", out, kBf16Tolerance));
    EXPECT_TRUE(matches("sigmoid_gate dx", dx, kBf16Tolerance));
    EXPECT_TRUE(matches("sigmoid_gate dgate", dgate, kBf16Tolerance));
    EXPECT_TRUE(matches("swiglu out", swi, kBf16Tolerance));
    EXPECT_TRUE(matches("swiglu dgate", dg2, kBf16Tolerance));
    EXPECT_TRUE(matches("swiglu dup", dup, kBf16Tolerance));
    EXPECT_TRUE(matches("add", y, kBf16Tolerance));
  }
}

TEST_F(CudaOpsTest, CopyAndFillZeroKeepTheirRows) {
  const Both src = random(bf16, 33, 40, 7), dst = unset(bf16, 33, 40, 5);
  const Both zeros16 = random(bf16, 20, 30, 3), zeros32 = random(f32, 20, 30, 9);
  on_both([&](Ops& ops, Side s) {
    ops.copy(dst.view(s), src.view(s));
    ops.fill_zero(zeros16.view(s));
    ops.fill_zero(zeros32.view(s));
  });
  EXPECT_TRUE(matches("copy", dst, 0));
  EXPECT_TRUE(matches("fill_zero (bfloat16)", zeros16, 0));
  EXPECT_TRUE(matches("fill_zero (float32)", zeros32, 0));
}

// Gemm's candidates (bench/gpu/gemm_candidates times them): the first is the algorithm run() takes, bit for bit,
// and every one computes the product, within bfloat16 rounding of the first. 64 rows: a decode step's batch.
// The weight-streaming kernel (decode's products, stream_gemm.cu) through Gemm::run, against the CPU's sgemm, on
// the shapes its plan takes: tails of N, one to 16 rows, one split to eight, bfloat16 and float32 results, as a
// plain product, accumulating (beta 1) and as the model's linear layer with a residual apart from y or in place
// (the weight requested before the kernel before it ends).
TEST_F(CudaOpsTest, StreamGemmMatchesCpu) {
  if (!cuda::prepare_stream_gemm()) GTEST_SKIP() << "the weight-streaming kernel is built for sm_90a only";
  struct Shape {
    Index M, N, K;
  };
  for (const Shape& shape : {Shape{1, 1024, 3584}, Shape{7, 1024, 2048}, Shape{16, 520, 256}, Shape{16, 2112, 1024},
                             Shape{3, 100, 128}, Shape{12, 1030, 2048}, Shape{41, 1030, 2048}, Shape{64, 520, 3584}}) {
    const auto [M, N, K] = shape;
    SCOPED_TRACE("M " + std::to_string(M) + ", N " + std::to_string(N) + ", K " + std::to_string(K));
    const Both x = random(bf16, M, K), w = random(bf16, N, K, 8);
    const Both y = unset(bf16, M, N, 8), y_f32 = unset(f32, M, N), accumulated = random(f32, M, N, 0, -4, 4);
    const Both residual = random(bf16, M, N, 0, -4, 4), with_residual = unset(bf16, M, N);
    const Both in_place = random(f32, M, N, 0, -4, 4);
    on_both([&](Ops& ops, Side s) {
      ops.gemm(false, true, 0.5, x.view(s), w.view(s), 0, y.view(s));
      ops.gemm(false, true, 1, x.view(s), w.view(s), 0, y_f32.view(s));
      ops.gemm(false, true, 1, x.view(s), w.view(s), 1, accumulated.view(s));
      const TensorView r = residual.view(s), y_in_place = in_place.view(s);
      ops.linear(with_residual.view(s), x.view(s), w.view(s), &r);
      ops.linear(y_in_place, x.view(s), w.view(s), &y_in_place);
    });
    EXPECT_TRUE(matches("y (bfloat16)", y, kBf16Tolerance));
    EXPECT_TRUE(matches("y (float32)", y_f32, 1e-5));
    EXPECT_TRUE(matches("y (float32, beta 1)", accumulated, 1e-5));
    EXPECT_TRUE(matches("y (linear, residual apart)", with_residual, kBf16Tolerance));
    EXPECT_TRUE(matches("y (linear, residual in place)", in_place, 1e-5));
    EXPECT_TRUE(matches("residual (read only)", residual, 0));
  }
}

// A linear layer's product requests its weight before the kernel before it ends, but must read the activation
// that kernel writes only after: decode's SwiGLU then the down product with the residual, on fresh activations
// each round, against the CPU.
TEST_F(CudaOpsTest, LinearReadsTheActivationOfTheKernelBeforeIt) {
  if (!cuda::prepare_stream_gemm()) GTEST_SKIP() << "the weight-streaming kernel is built for sm_90a only";
  const Index M = cuda::kStreamMaxRows, I = 3584, H = 1024;
  const Both w = random(bf16, H, I, 8);
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const Both gate = random(bf16, M, I, 0, -3, 3), up = random(bf16, M, I, 0, -3, 3), act = unset(bf16, M, I);
    const Both residual = random(bf16, M, H, 0, -4, 4), out = unset(bf16, M, H);
    on_both([&](Ops& ops, Side s) {
      ops.swiglu_forward(act.view(s), gate.view(s), up.view(s));
      const TensorView r = residual.view(s);
      ops.linear(out.view(s), act.view(s), w.view(s), &r);
    });
    EXPECT_TRUE(matches("out", out, kBf16Tolerance));
  }
}

// Run to run the same bits, and a row's result the same whatever the other rows, as the rollout's reproducibility
// and batch invariance need; up to the kernel's 64 rows, called directly, against float64.
TEST_F(CudaOpsTest, StreamGemmIsDeterministicRowInvariantAndTakes64Rows) {
  if (!cuda::prepare_stream_gemm()) GTEST_SKIP() << "the weight-streaming kernel is built for sm_90a only";
  const Index N = 1030, K = 3584;
  const Both x = random(bf16, 64, K), w = random(bf16, N, K);
  const auto data = [](const Both& t) { return t.view(Side::gpu).data; };
  const std::optional<cuda::StreamGemmPlan> plan =
      cuda::plan_stream_gemm(decode_product(1, N, K), cuda_info().gpus.front().multiprocessors);
  ASSERT_TRUE(plan.has_value());
  const auto product = [&](Index M) {
    Both y = unset(f32, M, N);
    cuda::stream_gemm(*plan, {M, N, K, 1.f, data(x), K, data(w), K, 0.f, nullptr, data(y), N, true, true}, nullptr);
    return y;
  };
  const Both all = product(64);
  EXPECT_EQ(product(64).bytes(), all.bytes());
  for (const Index M : {Index{1}, Index{16}, Index{37}}) {
    const std::vector<std::uint8_t> some = product(M).bytes(), everything = all.bytes();
    EXPECT_TRUE(std::equal(some.begin(), some.end(), everything.begin())) << "the first " << M << " rows differ";
  }
  Values expected(static_cast<std::size_t>(64 * N));
  const Values xs = x.actual(), ws = w.actual();
  for (Index r = 0; r < 64; ++r)
    for (Index n = 0; n < N; ++n) {
      double sum = 0;
      for (Index k = 0; k < K; ++k) sum += double(xs[r * K + k]) * ws[n * K + k];
      expected[r * N + n] = static_cast<float>(sum);
    }
  EXPECT_LT(relative_error(all.actual(), expected), 1e-5);
}

// At 80 rows, past the weight-streaming kernel's, run() takes cuBLASLt's first candidate; every candidate, and
// every variant splitting K that cuBLASLt accepts, computes the same product.
TEST_F(CudaOpsTest, GemmCandidatesComputeTheProductRunTakesTheFirst) {
  const Index M = 80, N = 520, K = 1024;
  const Both x = random(bf16, M, K), w = random(bf16, N, K), by_run = unset(bf16, M, N);
  const auto data = [](const Both& t) { return t.view(Side::gpu).data; };
  cuda::Gemm gemm(nullptr);  // the legacy default stream, which Both's downloads wait for
  gemm.run(false, true, M, N, K, 1.f, data(x), K, data(w), K, 0.f, data(by_run), N, DType::bf16);
  const std::vector<cuda::Gemm::Candidate> candidates =
      gemm.candidates(false, true, M, N, K, data(x), K, data(w), K, data(by_run), N, DType::bf16, 8, {2, 4});
  ASSERT_FALSE(candidates.empty());
  EXPECT_TRUE(std::any_of(candidates.begin(), candidates.end(), [](const auto& c) { return c.split_k == 4; }))
      << "no candidate split K into 4 parts";
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    SCOPED_TRACE("candidate " + std::to_string(i) + ": tile " + std::to_string(candidates[i].tile) + ", split-K " +
                 std::to_string(candidates[i].split_k));
    const Both y = unset(bf16, M, N);
    gemm.run_with(candidates[i].algo, false, true, M, N, K, 1.f, data(x), K, data(w), K, 0.f, data(y), N,
                  DType::bf16);
    if (i == 0) {
      EXPECT_EQ(y.bytes(), by_run.bytes());
    }
    EXPECT_LT(relative_error(y.actual(), by_run.actual()), kBf16Tolerance);
  }
}

TEST_F(CudaOpsTest, CrossEntropyWithIgnoredTargets) {
  const Index R = 9;
  // 16-byte rows, element by element, and Qwen3.5's vocabulary.
  for (const Index V : {Index{5000}, Index{5003}, Index{248320}}) {
    for (const bool want_grad : {false, true}) {
      SCOPED_TRACE("vocabulary " + std::to_string(V) + ", want_grad " + std::to_string(want_grad));
      std::vector<std::int32_t> target_values = random_ints(R, 0, static_cast<int>(V) - 1);
      target_values[1] = -1;
      target_values[4] = -1;
      target_values[2] = 0;
      target_values[3] = static_cast<std::int32_t>(V) - 1;
      const Indices targets(target_values);
      const Both logits = random(bf16, R, V, 8, -8, 8);
      // The CPU kernels take float64 host vectors, the GPU ones float32 device vectors.
      const Values weight_values = uniform(R, 0.1, 2);
      std::vector<double> cpu_weights(weight_values.begin(), weight_values.end()), cpu_logprob(R, kNaN);
      Both gpu_weights(f32, 1, R, 0, true), gpu_logprob = unset_vec(f32, R);
      gpu_weights.set(weight_values);
      cpu_->cross_entropy(logits.view(Side::cpu), targets.array(),
                          TensorView::contiguous(cpu_weights.data(), DType::f64, {R}),
                          TensorView::contiguous(cpu_logprob.data(), DType::f64, {R}), want_grad);
      gpu_->cross_entropy(logits.view(Side::gpu), targets.array(), gpu_weights.view(Side::gpu),
                          gpu_logprob.view(Side::gpu), want_grad);
      EXPECT_TRUE(matches("logits", logits, kBf16Tolerance));
      const Values logprob = gpu_logprob.actual();
      const double error = relative_error(logprob, Values(cpu_logprob.begin(), cpu_logprob.end()));
      RecordProperty("logprob V=" + std::to_string(V) + (want_grad ? " grad" : ""), short_number(error));
      EXPECT_LT(error, kF32Tolerance);
      EXPECT_EQ(logprob[1], 0.f);
      EXPECT_EQ(logprob[4], 0.f);
    }
  }
}

TEST_F(CudaOpsTest, RepeatedCallsAreBitwiseIdentical) {
  const Index T = 300, H = 96, V = 64;
  const Offsets cu = offsets({100, 1, 199});
  const Indices sequences(cu), tokens(random_ints(T, 0, static_cast<int>(V) - 1));
  const Both x = random(bf16, T, H, 0), w = random_vec(bf16, H), rstd = random_vec(f32, T, 0.5, 2);
  const Both dout = random(bf16, T, H), conv_w = random(bf16, H, 4);
  const Both q = random(bf16, T, 4 * 64, 0, -2, 2), k = random(bf16, T, 2 * 64, 0, -2, 2), v = random(bf16, T, 2 * 64);
  const Both a = random(bf16, T, 8, 0, -3, 3), dg = random(f32, T, 8), a_log = random_vec(bf16, 8);
  const Values dweight_start = uniform(H), dtable_start = uniform(V * H), dw_start = uniform(H * H);
  const Values logits_start = uniform(4 * 5000, -8, 8);

  // Every result of one pass over the deterministic-sensitive ops, as raw bytes.
  auto run = [&] {
    Both dx(bf16, T, H), dweight(f32, 1, H, 0, true), dtable(f32, V, H), conv_dx(bf16, T, H), conv_dw(f32, H, 4);
    Both gemm_dw(f32, H, H), o(bf16, T, 4 * 64), lse(f32, 4, T), dq(bf16, T, 4 * 64), dk(bf16, T, 2 * 64),
        dv(bf16, T, 2 * 64), da(bf16, T, 8), db(bf16, T, 8), da_log(f32, 1, 8, 0, true), ddt(f32, 1, 8, 0, true);
    Both logits(bf16, 4, 5000);
    logits.set(logits_start);
    dweight.set(dweight_start);
    dtable.set(dtable_start);
    gemm_dw.set(dw_start);
    Both logprob(f32, 1, 4, 0, true), weights(f32, 1, 4, 0, true);
    weights.set(Values(4, 0.25f));
    const Indices targets(std::vector<std::int32_t>{3, -1, 4999, 0});
    Ops& g = *gpu_;
    const Side s = Side::gpu;
    g.gemm(true, false, 1, dout.view(s), x.view(s), 1, gemm_dw.view(s));
    g.rmsnorm_backward(dx.view(s), dweight.view(s), dout.view(s), x.view(s), rstd.view(s), w.view(s), true, false);
    g.embedding_backward(dtable.view(s), tokens.array(), dout.view(s));
    g.conv1d_silu_backward(conv_dx.view(s), conv_dw.view(s), dout.view(s), x.view(s), conv_w.view(s),
                           sequences.array());
    g.gdn_gates_backward(da.view(s), db.view(s), da_log.view(s), ddt.view(s), dg.view(s), dg.view(s), a.view(s),
                         a.view(s), a_log.view(s), a_log.view(s));
    g.attention_forward(o.view(s), lse.view(s), q.view(s), k.view(s), v.view(s), 4, 2, 64, 0.125, sequences.array());
    g.attention_backward(dq.view(s), dk.view(s), dv.view(s), o.view(s), q.view(s), k.view(s), v.view(s), o.view(s),
                         lse.view(s), 4, 2, 64, 0.125, sequences.array());
    g.cross_entropy(logits.view(s), targets.array(), weights.view(s), logprob.view(s), true);
    std::vector<std::vector<std::uint8_t>> results;
    for (const Both* t : {&dx, &dweight, &dtable, &conv_dx, &conv_dw, &gemm_dw, &o, &lse, &dq, &dk, &dv, &da, &db,
                          &da_log, &ddt, &logprob, &logits})
      results.push_back(t->bytes());
    return results;
  };
  const auto first = run(), second = run();
  ASSERT_EQ(first.size(), second.size());
  for (std::size_t i = 0; i < first.size(); ++i)
    EXPECT_TRUE(first[i] == second[i]) << "result " << i << " differs between two identical passes";
}

// ---------------------------------------------------------------------------------------------------------
// Batch-invariant ops (make_cuda_ops(..., true)): each row's bits the same whatever the other rows, and the values
// those of the CPU ops.

// The first `rows` rows of a matrix's view.
TensorView first_rows(const Both& t, Side side, Index rows) {
  TensorView v = t.view(side);
  v.shape[0] = rows;
  return v;
}

// Bytes [row * row_bytes, (row + 1) * row_bytes) of a download: one row of a matrix without padding.
std::vector<std::uint8_t> row_bytes(const std::vector<std::uint8_t>& all, Index row, Index row_bytes) {
  return {all.begin() + row * row_bytes, all.begin() + (row + 1) * row_bytes};
}

TEST_F(CudaOpsTest, BatchInvariantProductsGiveARowTheSameBitsAtEveryRowCount) {
  const std::unique_ptr<Ops> invariant = make_cuda_ops(kGpu, nullptr, true);
  // The projections' shapes of the tiny and 0.8B configs, and an odd one.
  const struct { Index N, K; } shapes[] = {{1000, 256}, {6144, 1024}, {517, 344}};
  const Index counts[] = {1, 2, 7, 64, 257, 1500, 4500};
  const Index most = counts[std::size(counts) - 1];
  for (const auto& shape : shapes) {
    SCOPED_TRACE("N " + std::to_string(shape.N) + ", K " + std::to_string(shape.K));
    const Both x = random(bf16, most, shape.K), w = random(bf16, shape.N, shape.K);
    const Both all = unset(bf16, most, shape.N);
    invariant->gemm(false, true, 1, x.view(Side::gpu), w.view(Side::gpu), 0, all.view(Side::gpu));
    cpu_->gemm(false, true, 1, x.view(Side::cpu), w.view(Side::cpu), 0, all.view(Side::cpu));
    EXPECT_TRUE(matches("y", all, kBf16Tolerance));
    const std::vector<std::uint8_t> reference = all.bytes();
    for (const Index M : counts) {
      const Both y = unset(bf16, M, shape.N);
      invariant->gemm(false, true, 1, first_rows(x, Side::gpu, M), w.view(Side::gpu), 0, y.view(Side::gpu));
      const std::vector<std::uint8_t> bits = y.bytes();
      const Index bytes_per_row = shape.N * 2;
      Index differing = 0;
      for (Index r = 0; r < M; ++r) differing += row_bytes(bits, r, bytes_per_row) != row_bytes(reference, r, bytes_per_row);
      EXPECT_EQ(differing, 0) << "rows of a " << M << "-row product differ from the same rows of a " << most
                              << "-row one";
    }
  }
}

TEST_F(CudaOpsTest, BatchInvariantAttentionIsEachSequenceAloneAndMatchesCpu) {
  const std::unique_ptr<Ops> invariant = make_cuda_ops(kGpu, nullptr, true);
  const int q_heads = 8, kv_heads = 2, head_dim = 256;
  const std::vector<Index> lengths{1, 70, 0, 300, 33};
  const Offsets cu = offsets(lengths);
  const Indices sequences(cu);
  const Index T = cu.back(), q_cols = Index{q_heads} * head_dim, kv_cols = Index{kv_heads} * head_dim;
  const double scale = 1 / std::sqrt(double(head_dim));
  const Both q = random(bf16, T, q_cols, 0, -2, 2), k = random(bf16, T, kv_cols, 0, -2, 2), v = random(bf16, T, kv_cols);
  const Both o = unset(bf16, T, q_cols), lse = unset(f32, q_heads, T);
  invariant->attention_forward(o.view(Side::gpu), lse.view(Side::gpu), q.view(Side::gpu), k.view(Side::gpu),
                               v.view(Side::gpu), q_heads, kv_heads, head_dim, scale, sequences.array());
  cpu_->attention_forward(o.view(Side::cpu), lse.view(Side::cpu), q.view(Side::cpu), k.view(Side::cpu),
                          v.view(Side::cpu), q_heads, kv_heads, head_dim, scale, sequences.array());
  EXPECT_TRUE(matches("o", o, kBf16Tolerance));
  EXPECT_TRUE(matches("lse", lse, kF32Tolerance));
  // The longest sequence alone, as a batch of one: its rows' bits unchanged.
  const Index first = cu[3], length = lengths[3];
  auto rows_of = [&](const Both& t, Index cols) {
    TensorView view = t.view(Side::gpu);
    view.data = static_cast<std::uint16_t*>(view.data) + first * cols;
    view.shape[0] = length;
    return view;
  };
  const Indices alone(Offsets{0, static_cast<std::int32_t>(length)});
  const Both o_alone = unset(bf16, length, q_cols), lse_alone = unset(f32, q_heads, length);
  invariant->attention_forward(o_alone.view(Side::gpu), lse_alone.view(Side::gpu), rows_of(q, q_cols),
                               rows_of(k, kv_cols), rows_of(v, kv_cols), q_heads, kv_heads, head_dim, scale,
                               alone.array());
  const std::vector<std::uint8_t> batched = o.bytes(), single = o_alone.bytes();
  EXPECT_TRUE(std::equal(single.begin(), single.end(), batched.begin() + first * q_cols * 2))
      << "a sequence's attention differs alone and in a batch";
  const Values lse_batched = lse.actual(), lse_single = lse_alone.actual();
  for (int h = 0; h < q_heads; ++h)
    for (Index t = 0; t < length; ++t)
      ASSERT_EQ(lse_single[h * length + t], lse_batched[h * T + first + t]) << "head " << h << " row " << t;
}

TEST_F(CudaOpsTest, Float64LogprobsAreTheLogSoftmaxInFloat64) {
  const Index R = 6;
  for (const Index V : {Index{1}, Index{5003}, Index{248320}}) {
    SCOPED_TRACE("vocabulary " + std::to_string(V));
    std::vector<std::int32_t> target_values = random_ints(R, 0, static_cast<int>(V) - 1);
    target_values[2] = -1;
    const Indices targets(target_values);
    const Both logits = random(bf16, R, V, 0, -8, 8);
    const Values host = logits.expected();
    DevicePtr logprob = device_alloc(R * sizeof(double));
    for (const bool want_grad : {false, true}) {
      Both weights(f32, 1, R, 0, true);
      weights.set(Values(R, 0.5f));
      Both rows(bf16, R, V);
      rows.set(host);
      gpu_->cross_entropy(rows.view(Side::gpu), targets.array(), weights.view(Side::gpu),
                          TensorView::contiguous(logprob.get(), DType::f64, {R}, kGpu), want_grad);
      std::vector<double> got(R);
      cuda_check(cudaMemcpy(got.data(), logprob.get(), R * sizeof(double), cudaMemcpyDeviceToHost), "cudaMemcpy");
      for (Index r = 0; r < R; ++r) {
        if (target_values[r] < 0) {
          EXPECT_EQ(got[r], 0.0);
          continue;
        }
        double max = -INFINITY, sum = 0;
        for (Index c = 0; c < V; ++c) max = std::max(max, double(host[r * V + c]));
        for (Index c = 0; c < V; ++c) sum += std::exp(double(host[r * V + c]) - max);
        const double expected = (double(host[r * V + target_values[r]]) - max) - std::log(sum);
        EXPECT_NEAR(got[r], expected, model::testing::log_softmax_tolerance(V, expected)) << "row " << r;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Inference: rows into and out of cache slots, the conv decode step, RoPE at given positions, attention over a
// cache, each against the CPU op (itself tested against whole-sequence forms in test_ops.cpp).

// The rows [S * L, C] of a Both (no padding) as the contiguous cache [S, L, C].
TensorView cache_view(const Both& rows, Side side, Index slots) {
  TensorView v = rows.view(side);
  const Index slot_rows = v.shape[0] / slots, cols = v.shape[1];
  v.ndim = 3;
  v.shape = {slots, slot_rows, cols};
  v.strides = {slot_rows * cols, cols, 1};
  return v;
}

TEST_F(CudaOpsTest, CopyRowsMovesRowsOfEveryDtypeAndAlignment) {
  // K/V rows (bfloat16, 16-byte units, strided), bfloat16 rows of odd width (2-byte units), GDN state rows
  // (float32, 16-byte units) and float32 rows of odd width (4-byte units).
  struct Case {
    DType dtype;
    Index cols, dst_pad, src_pad;
  };
  for (const Case c : {Case{bf16, 64, 8, 0}, Case{bf16, 37, 3, 5}, Case{f32, 96, 0, 0}, Case{f32, 5, 2, 1}}) {
    SCOPED_TRACE(std::string(dtype_name(c.dtype)) + ", cols " + std::to_string(c.cols));
    const Index dst_rows = 40, src_rows = 30, count = 25;
    // Distinct destinations, sources with repeats; rows not named keep their values.
    std::vector<std::int32_t> to(dst_rows);
    std::iota(to.begin(), to.end(), 0);
    std::shuffle(to.begin(), to.end(), rng_);
    to.resize(count);
    const Indices dst_ids(to), src_ids(random_ints(count, 0, static_cast<int>(src_rows) - 1));
    const Both src = random(c.dtype, src_rows, c.cols, c.src_pad), dst = random(c.dtype, dst_rows, c.cols, c.dst_pad);
    on_both([&](Ops& ops, Side s) { ops.copy_rows(dst.view(s), dst_ids.array(), src.view(s), src_ids.array()); });
    EXPECT_TRUE(matches("dst", dst, 0));
  }
}

TEST_F(CudaOpsTest, Conv1dSiluStepUpdatesTheSlotsHistory) {
  const Index W = 4, S = 6;
  const std::vector<std::int32_t> slot_values{5, 0, 3, 2};  // slots 1 and 4 must stay as they are
  const Index N = std::ssize(slot_values);
  for (const Layout& l : kLayouts) {
    SCOPED_TRACE("cols " + std::to_string(l.cols) + ", pad " + std::to_string(l.pad));
    const Index C = l.cols;
    const Indices slots(slot_values);
    const Both w = random(bf16, C, W, 0), state = random(bf16, S * (W - 1), C, 0, -2, 2);
    // Two steps: the second reads the history the first shifted.
    for (int step = 0; step < 2; ++step) {
      const Both x = random(bf16, N, C, l.pad, -2, 2), out = unset(bf16, N, C, l.pad);
      on_both([&](Ops& ops, Side s) {
        ops.conv1d_silu_step(out.view(s), x.view(s), w.view(s), cache_view(state, s, S), slots.array());
      });
      EXPECT_TRUE(matches("out", out, kBf16Tolerance));
      EXPECT_TRUE(matches("state", state, 0));  // moved bfloat16 values, exact
    }
  }
}

// The conv's output and its gradient in column parts, as the model's q, k and v: the whole matrix's values on
// the GPU bit for bit (and the CPU's to bfloat16), both in one launch (parts 8-aligned: 16-byte groups) and in a
// launch per part (widths that split the kernels' channel groups).
TEST_F(CudaOpsTest, Conv1dSiluInColumnParts) {
  const Offsets cu = offsets({3, 70, 0, 41});
  const Index T = cu.back(), W = 4, S = 3;
  const Indices sequences(cu), slots(std::vector<std::int32_t>{2, 0});
  for (const std::array<Index, 3> widths : {std::array<Index, 3>{64, 64, 128}, std::array<Index, 3>{13, 7, 21}}) {
    const Index C = widths[0] + widths[1] + widths[2];
    SCOPED_TRACE("parts " + std::to_string(widths[0]) + ", " + std::to_string(widths[1]) + ", " +
                 std::to_string(widths[2]));
    const Both x = random(bf16, T, C, 0, -2, 2), w = random(bf16, C, W, 0), dout = random(bf16, T, C, 0);
    const Both whole = unset(bf16, T, C, 0), dx_whole = unset(bf16, T, C, 0), dw_whole = random(f32, C, W, 0);
    const Both dx = unset(bf16, T, C, 0);
    Both dw(f32, C, W);
    dw.set(dw_whole.expected());
    std::vector<Both> out, d;
    for (int p = 0, first = 0; p < 3; first += widths[p++]) {
      out.push_back(unset(bf16, T, widths[p], 0));
      d.emplace_back(bf16, T, widths[p]);
      d.back().set(columns_of(dout.expected(), C, first, widths[p]));
    }
    on_both([&](Ops& ops, Side s) {
      ops.conv1d_silu_forward(whole.view(s), x.view(s), w.view(s), sequences.array());
      ops.conv1d_silu_forward({out[0].view(s), out[1].view(s), out[2].view(s)}, x.view(s), w.view(s),
                              sequences.array());
      ops.conv1d_silu_backward(dx_whole.view(s), dw_whole.view(s), dout.view(s), x.view(s), w.view(s),
                               sequences.array());
      ops.conv1d_silu_backward(dx.view(s), dw.view(s), {d[0].view(s), d[1].view(s), d[2].view(s)}, x.view(s),
                               w.view(s), sequences.array());
    });
    for (int p = 0, first = 0; p < 3; first += widths[p++]) {
      EXPECT_EQ(out[p].actual(), columns_of(whole.actual(), C, first, widths[p])) << "part " << p;
      EXPECT_TRUE(matches("out part", out[p], kBf16Tolerance));
    }
    EXPECT_EQ(dx.actual(), dx_whole.actual());
    EXPECT_EQ(dw.actual(), dw_whole.actual());
    EXPECT_TRUE(matches("dx", dx, kBf16Tolerance));

    const Both state_whole = random(bf16, S * (W - 1), C, 0, -2, 2);
    Both state(bf16, S * (W - 1), C);
    state.set(state_whole.expected());
    const Both in = random(bf16, 2, C, 0, -2, 2), step_whole = unset(bf16, 2, C, 0);
    std::vector<Both> step;
    for (int p = 0; p < 3; ++p) step.push_back(unset(bf16, 2, widths[p], 0));
    on_both([&](Ops& ops, Side s) {
      ops.conv1d_silu_step(step_whole.view(s), in.view(s), w.view(s), cache_view(state_whole, s, S), slots.array());
      ops.conv1d_silu_step({step[0].view(s), step[1].view(s), step[2].view(s)}, in.view(s), w.view(s),
                           cache_view(state, s, S), slots.array());
    });
    for (int p = 0, first = 0; p < 3; first += widths[p++])
      EXPECT_EQ(step[p].actual(), columns_of(step_whole.actual(), C, first, widths[p])) << "step part " << p;
    EXPECT_EQ(state.actual(), state_whole.actual());
  }
}

// Decode's GDN inputs in one launch: the conv step (in q/k/v column parts, as the model's) and the gates, each
// bit for bit what conv1d_silu_step and gdn_gates_forward give on the GPU, and within tolerance of the CPU's.
// Parts that straddle the conv's channel groups take a launch each, the gates riding on the first.
TEST_F(CudaOpsTest, GdnInputsStepIsTheConvStepAndTheGates) {
  const Index W = 4, S = 9;
  const std::vector<std::int32_t> slot_values{4, 8, 0, 6, 1};
  const Index N = std::ssize(slot_values);
  const Indices slots(slot_values);
  for (const std::array<Index, 3> widths : {std::array<Index, 3>{64, 64, 128}, std::array<Index, 3>{13, 7, 21}}) {
    for (const Index H : {Index{16}, Index{300}}) {  // gate threads fewer and more than a CTA's
      SCOPED_TRACE("parts " + std::to_string(widths[0]) + ", " + std::to_string(widths[1]) + ", " +
                   std::to_string(widths[2]) + ", heads " + std::to_string(H));
      const Index C = widths[0] + widths[1] + widths[2];
      const Both x = random(bf16, N, C, 0, -2, 2), w = random(bf16, C, W, 0);
      const Values state0 = random(bf16, S * (W - 1), C, 0, -2, 2).expected();
      const Both a = random(bf16, N, H, 8, -6, 24), b = random(bf16, N, H, 0, -6, 6);
      const Both a_log = random_vec(bf16, H, -1, 1), dt_bias = random_vec(bf16, H, -1, 1);
      struct Outputs {
        std::vector<Both> out;
        Both state, g, beta;
      };
      const auto outputs = [&] {
        Outputs o{{}, Both(bf16, S * (W - 1), C), unset(f32, N, H), unset(f32, N, H)};
        for (const Index width : widths) o.out.push_back(unset(bf16, N, width));
        o.state.set(state0);
        return o;
      };
      const Outputs fused = outputs(), apart = outputs();
      const auto call = [&](Ops& ops, const Outputs& o, Side s, bool one_launch) {
        const ColumnParts out{o.out[0].view(s), o.out[1].view(s), o.out[2].view(s)};
        const GdnGates gates{o.g.view(s), o.beta.view(s), a.view(s), b.view(s), a_log.view(s), dt_bias.view(s)};
        if (one_launch) ops.gdn_inputs_step(out, x.view(s), w.view(s), cache_view(o.state, s, S), slots.array(), gates);
        else ops.Ops::gdn_inputs_step(out, x.view(s), w.view(s), cache_view(o.state, s, S), slots.array(), gates);
      };
      on_both([&](Ops& ops, Side s) { call(ops, fused, s, true); });
      call(*gpu_, apart, Side::gpu, false);
      for (int p = 0; p < 3; ++p) {
        EXPECT_TRUE(fused.out[p].bytes() == apart.out[p].bytes()) << "part " << p << ": not the conv step's bits";
        EXPECT_TRUE(matches("out part", fused.out[p], kBf16Tolerance));
      }
      EXPECT_TRUE(fused.state.bytes() == apart.state.bytes()) << "state";
      EXPECT_TRUE(matches("state", fused.state, 0));
      EXPECT_TRUE(fused.g.bytes() == apart.g.bytes()) << "g: not the gates' bits";
      EXPECT_TRUE(fused.beta.bytes() == apart.beta.bytes()) << "beta: not the gates' bits";
      EXPECT_TRUE(matches("g", fused.g, 1e-5));
      EXPECT_TRUE(matches("beta", fused.beta, 1e-5));
    }
  }
  // The gates' arguments are checked as gdn_gates_forward checks them, naming the tensor.
  const Both x = random(bf16, N, 64, 0), w = random(bf16, 64, W, 0), out = unset(bf16, N, 64);
  const Both state = random(bf16, S * (W - 1), 64, 0), a = random(bf16, N, 8, 0), b = random(bf16, N, 8, 0);
  const Both a_log = random_vec(bf16, 8), dt_bias = random_vec(bf16, 8), g = unset(f32, N, 8);
  const Both beta_bf16 = unset(bf16, N, 8);
  try {
    gpu_->gdn_inputs_step(out.view(Side::gpu), x.view(Side::gpu), w.view(Side::gpu), cache_view(state, Side::gpu, S),
                          slots.array(),
                          GdnGates{g.view(Side::gpu), beta_bf16.view(Side::gpu), a.view(Side::gpu), b.view(Side::gpu),
                                   a_log.view(Side::gpu), dt_bias.view(Side::gpu)});
    ADD_FAILURE() << "a bfloat16 beta was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "beta") << e.what();
  }
}

TEST_F(CudaOpsTest, RopeAtPositionsMatchesCpu) {
  const Index T = 57;
  const int heads = 3, head_dim = 64;
  // Decode positions up to long contexts, where float32 angles are large.
  const Indices positions(random_ints(T, 0, 40000));
  for (const int rotary_dim : {16, 64}) {
    SCOPED_TRACE("rotary_dim " + std::to_string(rotary_dim));
    const Both x = random(bf16, T, heads * head_dim, 8);
    on_both([&](Ops& ops, Side s) {
      ops.rope_at_positions(x.view(s), heads, head_dim, rotary_dim, 1e7, positions.array());
    });
    EXPECT_TRUE(matches("x", x, kBf16Tolerance));
  }
}

// Decode's attention inputs: the one-kernel form gives the bits of the operations it replaces (Ops' default, run
// on the GPU's own kernels) in every output, and both match the CPU. Rows come in shuffled batch order and go to
// scattered cache rows; q, k and v come as column blocks of one matrix (decode's one product) or apart, strided;
// shapes outside the kernel's plan take the default and must agree all the same.
TEST_F(CudaOpsTest, AttentionInputsStepIsTheNormsRopeAndCacheStores) {
  struct Case {
    int q_heads, kv_heads, head_dim, rotary_dim;
    Index pad;
  };
  const Case cases[] = {
      {8, 2, 256, 64, 0},    // Qwen3.5's attention layers
      {4, 2, 128, 128, 8},   // full rotation, strided values
      {2, 1, 64, 32, 0},     // a head of 8 lanes (the norm kernels' 16-lane rows)
      {3, 1, 96, 48, 24},    // a head of 12 lanes
      {2, 2, 64, 8, 0},      // pairs within a lane: the operations one by one
      {2, 1, 68, 16, 4},     // a head off 16-byte accesses: one by one
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("q_heads " + std::to_string(c.q_heads) + ", kv_heads " + std::to_string(c.kv_heads) +
                 ", head_dim " + std::to_string(c.head_dim) + ", rotary_dim " + std::to_string(c.rotary_dim));
    const Index T = 29, S = 40, L = 3, D = c.head_dim, q_cols = c.q_heads * D, kv_cols = c.kv_heads * D;
    std::vector<std::int32_t> cache_values(S * L), batch_values(T);
    std::iota(cache_values.begin(), cache_values.end(), 0);
    std::shuffle(cache_values.begin(), cache_values.end(), rng_);
    cache_values.resize(T);
    std::iota(batch_values.begin(), batch_values.end(), 0);
    std::shuffle(batch_values.begin(), batch_values.end(), rng_);
    const Indices positions(random_ints(T, 0, 40000)), cache_rows(cache_values), batch_rows(batch_values);
    // Decode's layout: the three as column blocks of one [T, 2 q_cols + 2 kv_cols] matrix; the others apart, v padded.
    const bool stacked = c.pad == 0;
    const Both qkv = random(bf16, T, 2 * q_cols + 2 * kv_cols, 0, -3, 3);
    const Both qg = random(bf16, T, 2 * q_cols, c.pad, -3, 3), k_raw = random(bf16, T, kv_cols, c.pad, -3, 3);
    const Both v = random(bf16, T, kv_cols, c.pad), q_norm = random_vec(bf16, D), k_norm = random_vec(bf16, D);
    const auto input = [&](const Both& apart, Side s, Index first, Index cols) {
      return stacked ? col_slice(qkv.view(s), first, first + cols) : apart.view(s);
    };
    const Values k_cache0 = random(bf16, S * L, kv_cols).expected(), v_cache0 = random(bf16, S * L, kv_cols).expected();
    // Two sets of outputs: the Ops' call, and (on the GPU) the default's operations one by one.
    struct Outputs {
      Both q, k, gate, q_rstd, k_rstd, k_cache, v_cache;
    };
    const auto outputs = [&] {
      Outputs o{unset(bf16, T, q_cols),         unset(bf16, T, kv_cols),   unset(bf16, T, q_cols),
                unset_vec(f32, T * c.q_heads),  unset_vec(f32, T * c.kv_heads),
                Both(bf16, S * L, kv_cols),     Both(bf16, S * L, kv_cols)};
      o.k_cache.set(k_cache0);
      o.v_cache.set(v_cache0);
      return o;
    };
    const Outputs fused = outputs(), apart = outputs();
    const auto inputs = [&](const Outputs& o, Side s) {
      return AttentionInputs{.qg = input(qg, s, 0, 2 * q_cols),
                             .k_raw = input(k_raw, s, 2 * q_cols, kv_cols),
                             .v = input(v, s, 2 * q_cols + kv_cols, kv_cols),
                             .q_norm = q_norm.view(s),
                             .k_norm = k_norm.view(s),
                             .q = o.q.view(s),
                             .k = o.k.view(s),
                             .gate = o.gate.view(s),
                             .q_rstd = o.q_rstd.view(s),
                             .k_rstd = o.k_rstd.view(s),
                             .q_heads = c.q_heads,
                             .kv_heads = c.kv_heads,
                             .head_dim = c.head_dim,
                             .rotary_dim = c.rotary_dim,
                             .theta = 1e7,
                             .eps = 1e-6};
    };
    on_both([&](Ops& ops, Side s) {
      ops.attention_inputs_step(inputs(fused, s), positions.array(), cache_view(fused.k_cache, s, S),
                                cache_view(fused.v_cache, s, S), cache_rows.array(), batch_rows.array());
    });
    gpu_->Ops::attention_inputs_step(inputs(apart, Side::gpu), positions.array(), cache_view(apart.k_cache, Side::gpu, S),
                                     cache_view(apart.v_cache, Side::gpu, S), cache_rows.array(), batch_rows.array());
    const std::pair<const char*, const Both Outputs::*> fields[] = {
        {"q", &Outputs::q},           {"k", &Outputs::k},           {"gate", &Outputs::gate},
        {"q_rstd", &Outputs::q_rstd}, {"k_rstd", &Outputs::k_rstd}, {"k_cache", &Outputs::k_cache},
        {"v_cache", &Outputs::v_cache}};
    for (const auto& [name, field] : fields) {
      EXPECT_TRUE((fused.*field).bytes() == (apart.*field).bytes()) << name << ": not the operations' bits";
      EXPECT_TRUE(matches(name, fused.*field, std::string(name).ends_with("rstd") ? kF32Tolerance : kBf16Tolerance));
    }
    // A head-holding matrix with strided rows cannot be seen as rows of heads: refused, naming it.
    const Both strided_q = unset(bf16, T, q_cols, 8);
    AttentionInputs bad = inputs(fused, Side::gpu);
    bad.q = strided_q.view(Side::gpu);
    try {
      gpu_->attention_inputs_step(bad, positions.array(), cache_view(fused.k_cache, Side::gpu, S),
                                  cache_view(fused.v_cache, Side::gpu, S), cache_rows.array(), batch_rows.array());
      ADD_FAILURE() << "a strided q was taken";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), "q") << e.what();
    }
  }
}

struct CachedAttentionCase {
  int q_heads, kv_heads, head_dim;
  std::vector<Index> news, lengths;  // per sequence: its new rows, and the positions its slot holds with them
  Index slot_rows, q_pad;
};

TEST_F(CudaOpsTest, CachedAttentionMatchesCpu) {
  const CachedAttentionCase cases[] = {
      // Qwen3.5's attention heads, one new row per sequence (decode), lengths from 1 to a full slot
      {8, 2, 256, {1, 1, 1, 1, 1}, {1, 2, 77, 300, 129}, 300, 0},
      // several new rows per sequence (a chunk of a prompt), GQA over head dim 64, strided q and o
      {4, 2, 64, {3, 1, 17}, {3, 40, 60}, 64, 8},
      // head dims off multiples of 8 (element by element) and over 256 (two chunks per lane)
      {3, 1, 68, {2, 1}, {5, 33}, 40, 0},
      {2, 1, 512, {1, 4}, {90, 4}, 100, 0},
      // a group of 8 heads on tensor cores over hundreds of keys (every warp's ring turning over many times)
      {8, 1, 128, {1, 1, 2}, {700, 33, 16}, 700, 0},
      // the warp kernel with 16-byte rows (a head dim the tensor-core kernel is not built for)
      {4, 1, 200, {1, 3}, {150, 9}, 160, 0},
  };
  for (const CachedAttentionCase& c : cases) {
    SCOPED_TRACE("q_heads " + std::to_string(c.q_heads) + ", kv_heads " + std::to_string(c.kv_heads) +
                 ", head_dim " + std::to_string(c.head_dim));
    const Index N = std::ssize(c.news), S = N + 2, q_cols = Index{c.q_heads} * c.head_dim;
    const Index kv_cols = Index{c.kv_heads} * c.head_dim;
    const Offsets cu = offsets(c.news);
    // The sequences in shuffled slots of a cache with two slots to spare.
    std::vector<std::int32_t> slot_values(S);
    std::iota(slot_values.begin(), slot_values.end(), 0);
    std::shuffle(slot_values.begin(), slot_values.end(), rng_);
    slot_values.resize(N);
    const Indices sequences(cu), slots(slot_values), lengths(Offsets(c.lengths.begin(), c.lengths.end()));
    const Both q = random(bf16, cu.back(), q_cols, c.q_pad, -2, 2);
    const Both k_cache = random(bf16, S * c.slot_rows, kv_cols, 0, -2, 2);
    const Both v_cache = random(bf16, S * c.slot_rows, kv_cols, 0);
    const double scale = 1 / std::sqrt(double(c.head_dim));
    const Both o = unset(bf16, cu.back(), q_cols, c.q_pad);
    const auto call = [&](Ops& ops, Side s) {
      ops.cached_attention(o.view(s), q.view(s), cache_view(k_cache, s, S), cache_view(v_cache, s, S), c.q_heads,
                           c.kv_heads, c.head_dim, scale, sequences.array(), slots.array(), lengths.array());
    };
    on_both(call);
    EXPECT_TRUE(matches("o", o, kBf16Tolerance));
    // The warps' partial softmaxes merge in a fixed order: the same bits again.
    const std::vector<std::uint8_t> first = o.bytes();
    call(*gpu_, Side::gpu);
    EXPECT_TRUE(first == o.bytes()) << "a second identical call gave other bits";
  }
}

TEST_F(CudaOpsTest, InferenceOpsRefuseHostTensorsWrongDtypesAndMissingDeviceIndices) {
  const auto invalid = [](const std::string& argument, const auto& call) {
    try {
      call();
      ADD_FAILURE() << "no InvalidArgument for " << argument;
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  const std::vector<std::int32_t> row_values{0, 2};
  const Indices rows(row_values);
  const IndexArray host_only(row_values);  // no device copy
  const Both src = random(bf16, 4, 16), dst = random(bf16, 5, 16), wide = random(f32, 4, 16);
  invalid("src", [&] { gpu_->copy_rows(dst.view(Side::gpu), rows.array(), wide.view(Side::gpu), rows.array()); });
  invalid("src", [&] { gpu_->copy_rows(dst.view(Side::gpu), rows.array(), src.view(Side::cpu), rows.array()); });
  invalid("dst_rows", [&] { gpu_->copy_rows(dst.view(Side::gpu), host_only, src.view(Side::gpu), rows.array()); });

  const Both x = random(bf16, 2, 16), out = unset(bf16, 2, 16), w = random(bf16, 16, 4);
  const Both state = random(bf16, 3 * 3, 16), state32 = random(f32, 3 * 3, 16);
  invalid("state", [&] {
    gpu_->conv1d_silu_step(out.view(Side::gpu), x.view(Side::gpu), w.view(Side::gpu), cache_view(state32, Side::gpu, 3),
                           rows.array());
  });
  invalid("slots", [&] {
    gpu_->conv1d_silu_step(out.view(Side::gpu), x.view(Side::gpu), w.view(Side::gpu), cache_view(state, Side::gpu, 3),
                           host_only);
  });
  // The shared checks (ops.cpp) name the same arguments as on the CPU.
  invalid("slots", [&] {
    gpu_->conv1d_silu_step(out.view(Side::gpu), x.view(Side::gpu), w.view(Side::gpu), cache_view(state, Side::gpu, 3),
                           Indices(std::vector<std::int32_t>{1, 1}).array());
  });

  const Both xr = random(bf16, 2, 8);
  invalid("positions", [&] { gpu_->rope_at_positions(xr.view(Side::gpu), 2, 4, 2, 1e4, host_only); });

  const Both q = random(bf16, 2, 8), o = unset(bf16, 2, 8), kc = random(bf16, 3 * 5, 4);
  const std::vector<std::int32_t> length_values{4};
  const Indices cu(std::vector<std::int32_t>{0, 2}), slot(std::vector<std::int32_t>{1}), length(length_values);
  invalid("k_cache", [&] {
    gpu_->cached_attention(o.view(Side::gpu), q.view(Side::gpu), cache_view(kc, Side::cpu, 3),
                           cache_view(kc, Side::gpu, 3), 2, 1, 4, 0.5, cu.array(), slot.array(), length.array());
  });
  invalid("lengths", [&] {
    gpu_->cached_attention(o.view(Side::gpu), q.view(Side::gpu), cache_view(kc, Side::gpu, 3),
                           cache_view(kc, Side::gpu, 3), 2, 1, 4, 0.5, cu.array(), slot.array(),
                           IndexArray(length_values));
  });
}

TEST_F(CudaOpsTest, RejectsHostTensorsAndWrongDtypes) {
  const Both x = random(bf16, 4, 8), out = unset(bf16, 4, 8), rstd = unset_vec(f32, 4), w = random_vec(bf16, 8);
  const Both wrong = random(f32, 4, 8);
  EXPECT_THROW(gpu_->rmsnorm_forward(out.view(Side::gpu), rstd.view(Side::gpu), x.view(Side::cpu), w.view(Side::gpu),
                                     1e-6, true),
               InvalidArgument);
  EXPECT_THROW(gpu_->rmsnorm_forward(out.view(Side::gpu), rstd.view(Side::gpu), wrong.view(Side::gpu),
                                     w.view(Side::gpu), 1e-6, true),
               InvalidArgument);
  EXPECT_THROW(gpu_->add(x.view(Side::gpu), rstd.view(Side::gpu)), InvalidArgument);
}

}  // namespace
}  // namespace deltatrain::model
