// The model on a GPU (bfloat16, cuBLASLt, the cuda GDN backend, the CUDA kernels of model/cuda/) against the CPU
// model in float32 on the same bfloat16 weights: loss, logits and every parameter gradient, within what
// bfloat16 activations allow; inference (prefill, then decode from the slots' states) against the CPU model's and
// the GPU's own full forward; and bitwise the same twice. Every test skips (not passes) without a usable GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "deltatrain/core/bfloat16.h"
#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/system.h"
#include "deltatrain/model/hf_checkpoint.h"
#include "deltatrain/model/inference.h"
#include "deltatrain/model/model.h"
#include "deltatrain/model/params.h"
#include "cuda_testing.h"
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
  // A training step of the GPU model in bfloat16 against the CPU model's in float32 on the same weights.
  void expect_gpu_matches_cpu(bool batch_invariant);
};

// A float32 or float64 store holding exactly the bfloat16 store's values (and so the same model).
void widen(const ParamStore& bf16, const ParamStore& wide) {
  const TensorView from = bf16.param_buffer(), to = wide.param_buffer();
  for (std::int64_t i = 0; i < from.numel(); ++i) {
    const float value = bf16_to_float(from.ptr<std::uint16_t>()[i]);
    if (to.dtype == DType::f64) {
      to.ptr<double>()[i] = value;
    } else {
      to.ptr<float>()[i] = value;
    }
  }
}

// A gradient tensor's values as doubles, whatever its dtype.
std::vector<double> values_of(const TensorView& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) out[i] = t.dtype == DType::f64 ? t.ptr<double>()[i] : t.ptr<float>()[i];
  return out;
}

// |a - b| / |b| (Euclidean norms) and a . b / (|a| |b|) of two gradient tensors' values: the bf16 step's rounding
// spread over the tensor. (The largest element's error against the largest element, the first form here, is set by
// one element and crossed 0.1 on about one seed in 25 for embed_tokens and conv1d.weight.)
double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double error = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    error += (a[i] - b[i]) * (a[i] - b[i]);
    scale += b[i] * b[i];
  }
  return scale > 0 ? std::sqrt(error / scale) : std::sqrt(error);
}
double cosine_similarity(const std::vector<double>& a, const std::vector<double>& b) {
  double dot = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    dot += a[i] * b[i];
    aa += a[i] * a[i];
    bb += b[i] * b[i];
  }
  return aa > 0 && bb > 0 ? dot / std::sqrt(aa * bb) : 0.0;
}

void CudaModelTest::expect_gpu_matches_cpu(bool batch_invariant) {
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
  // The same step in float64: how far float32 lands from it says how ill-conditioned this draw's sums are.
  ParamStore f64(c, DType::f64);
  widen(bf16, f64);
  Model exact(c, {.dtype = DType::f64});
  exact.bind(f64.params(), f64.grads());
  f64.zero_grads();
  exact.forward({tokens, cu});
  exact.backward();

  const Device gpu{DeviceType::cuda, 0};
  DeviceParams device(bf16, gpu);
  device.upload(bf16);
  device.zero_grads();
  Model model(c, {.device = gpu, .dtype = DType::bf16, .batch_invariant = batch_invariant});
  model.bind(device.params(), device.grads());
  const double gpu_loss = model.forward({tokens, cu});
  model.backward();
  device.download_grads(gpu_grads);

  std::printf("loss: cpu float32 %.6f, gpu bfloat16 %.6f (relative %.2e)\n", cpu_loss, gpu_loss,
              std::abs(gpu_loss - cpu_loss) / cpu_loss);
  EXPECT_NEAR(gpu_loss, cpu_loss, 1e-2 * cpu_loss);
  // Bounds from the spread over 54 seeds x 2 modes on the H200 (bench/results/gpu-tests-h200.md, session 14):
  // relative errors 0.030-0.101 (median 0.041; the largest in_proj_a's, whose rows feed the gates), decay cosines
  // down to 0.46.
  constexpr double kGradientError = 0.15, kDecayCosine = 0.3;
  // A draw is too ill-conditioned for the decay gradients' direction when float32's error on them, scaled by the
  // ratio of the formats' unit roundoffs (2^-8 / 2^-24), is far above the well-conditioned draws'. That scaling
  // overstates the GPU's error (which rounds to bfloat16 where activations are stored, not at every operation): over
  // 17 seeds x 2 modes on the H200 (2026-12-02), draws it scored 0.5-3.2 kept cosines above 0.99, and seed
  // 2017949097's dt_bias, scored 14.8, gave -0.86 in the batch-invariant mode, the same in every run.
  constexpr double kRoundoffRatio = 65536.0, kIllConditioned = 8;
  double worst = 0, least_cosine = 1;
  std::string worst_name;
  for (const ParamInfo& info : f32.infos()) {
    const std::vector<double> gpu_grad = values_of(gpu_grads.grad(info.name)), cpu_grad = values_of(f32.grad(info.name));
    if (info.kind == ParamKind::gdn_decay) {
      // A_log's and dt_bias's gradients (one value per head) sum every token's gate gradient, terms that largely
      // cancel while the bf16 rounding of the activations upstream does not: they differ by 5-100% over seeds,
      // so only their direction is compared here, loosely (a wrong sign or an unrelated vector fails), and only
      // where the draw's conditioning lets bfloat16 keep it (above). The per-token gate gradients are held tightly
      // elsewhere: the CUDA gate kernels against the CPU's in test_cuda_ops, in_proj_a's and in_proj_b's gradients
      // (their products with the input) below, and the CPU model's gradients against finite differences.
      const std::vector<double> exact_grad = values_of(f64.grad(info.name));
      const double predicted = kRoundoffRatio * relative_error(cpu_grad, exact_grad);
      const double cosine = cosine_similarity(gpu_grad, exact_grad);
      for (const double g : gpu_grad) EXPECT_TRUE(std::isfinite(g)) << info.name;
      if (predicted >= kIllConditioned) {
        std::printf("%s: ill-conditioned draw (float32's error scaled to bfloat16: %.2f): direction not compared "
                    "(cosine %.4f)\n",
                    info.name.c_str(), predicted, cosine);
        continue;
      }
      least_cosine = std::min(least_cosine, cosine);
      EXPECT_GT(cosine, kDecayCosine) << info.name << " (float32's error scaled to bfloat16: " << predicted << ")";
      continue;
    }
    const double e = relative_error(gpu_grad, cpu_grad);
    if (e > worst) worst = e, worst_name = info.name;
    EXPECT_LT(e, kGradientError) << info.name;
  }
  std::printf("gradients: worst relative error %.2e (%s); decay gradients' least cosine similarity %.4f\n", worst,
              worst_name.c_str(), least_cosine);
}


// Both GPU modes: the default, and batch-invariant (row-invariant products, attention by decode's kernel, float64
// log-probabilities), whose backward is the default's.
TEST_F(CudaModelTest, MatchesTheCpuModelInFloat32OnTheSameWeights) {
  SKIP_WITHOUT_GPU();
  for (const bool invariant : {false, true}) {
    SCOPED_TRACE(invariant ? "batch-invariant" : "default");
    expect_gpu_matches_cpu(invariant);
  }
}

// An HF model saved straight from parameters on the GPU (streamed chunk by chunk) loads back as the same bf16
// values; a device view in another dtype than the file's is refused by name, before anything is written.
TEST_F(CudaModelTest, SavesAnHfModelFromTheGpu) {
  SKIP_WITHOUT_GPU();
  const Config c = config();
  ParamStore bf16(c, DType::bf16), loaded(c, DType::bf16);
  bf16.init(0.05, seed_);
  DeviceParams device(bf16, Device{DeviceType::cuda, 0});
  device.upload(bf16);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("dt-gpu-save-" + std::to_string(seed_));
  std::filesystem::remove_all(dir);
  save_hf_model(dir / "model", c, device.params(), DType::bf16);
  load_hf_weights(dir / "model", c, loaded.params());
  const TensorView a = bf16.param_buffer(), b = loaded.param_buffer();
  ASSERT_EQ(a.nbytes(), b.nbytes());
  EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes()), 0) << "the saved model differs from the GPU's parameters";
  try {
    save_hf_model(dir / "as-float32", c, device.params(), DType::f32);
    ADD_FAILURE() << "a bf16 device view saved as float32 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("model.embed_tokens.weight"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "as-float32"));
  std::filesystem::remove_all(dir);
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

// ---------------------------------------------------------------------------------------------------------
// Inference

// What a rollout feeds: prompts into slots, then decode steps of random tokens; sequence 1 sits out step 2, so
// its slot advances behind the others.
struct Plan {
  std::vector<std::vector<std::int32_t>> tokens;  // each sequence's prompt, then the tokens decode feeds it
  std::vector<std::int64_t> prompt_lengths;
  std::vector<std::int32_t> slots;
  std::vector<std::vector<int>> steps;  // the sequences each decode step feeds
  std::int64_t slot_count = 0, max_length = 0;
};

// A one-token prompt (shorter than the conv history), prompts across GDN chunks of 64, shuffled slots, a slot
// left free.
Plan make_plan(std::mt19937_64& rng, std::int64_t vocab) {
  Plan p;
  p.prompt_lengths = {70, 1, 130};
  p.slots = {2, 0, 3};
  p.slot_count = 4;
  const int steps = 6;
  for (int s = 0; s < steps; ++s) p.steps.push_back(s == 2 ? std::vector<int>{0, 2} : std::vector<int>{0, 1, 2});
  for (std::size_t n = 0; n < p.prompt_lengths.size(); ++n) {
    p.tokens.push_back(testing::random_tokens(rng, p.prompt_lengths[n] + steps, vocab));
    p.max_length = std::max(p.max_length, p.prompt_lengths[n] + steps);
  }
  return p;
}

// The logits a rollout gives for the token at `position` of a sequence (predicting the next one).
struct Record {
  std::size_t sequence;
  std::int64_t position;
  std::vector<double> logits;
};

std::vector<Record> rollout(Model& model, const Plan& p) {
  const std::int64_t V = model.config().vocab_size;
  InferenceState state(model.config(), model.options(), p.slot_count, p.max_length);
  std::vector<std::int32_t> prompts, cu{0};
  for (std::size_t n = 0; n < p.tokens.size(); ++n) {
    prompts.insert(prompts.end(), p.tokens[n].begin(), p.tokens[n].begin() + p.prompt_lengths[n]);
    cu.push_back(static_cast<std::int32_t>(prompts.size()));
  }
  std::vector<double> logits(p.tokens.size() * V);
  model.prefill({prompts, cu}, p.slots, state, logits);
  std::vector<Record> records;
  std::vector<std::int64_t> next(p.prompt_lengths);  // each sequence's next position
  for (std::size_t n = 0; n < p.tokens.size(); ++n)
    records.push_back({n, next[n] - 1, {logits.begin() + n * V, logits.begin() + (n + 1) * V}});
  for (const std::vector<int>& step : p.steps) {
    std::vector<std::int32_t> tokens, slots;
    for (const int n : step) {
      tokens.push_back(p.tokens[n][next[n]]);
      slots.push_back(p.slots[n]);
    }
    logits.assign(step.size() * V, 0.0);
    model.decode(tokens, slots, state, logits);
    for (std::size_t i = 0; i < step.size(); ++i)
      records.push_back(
          {std::size_t(step[i]), next[step[i]]++, {logits.begin() + i * V, logits.begin() + (i + 1) * V}});
  }
  return records;
}

// The same records from one full forward (Model::logits) over every sequence's prompt and fed tokens, on the GPU.
std::vector<Record> full_forward(Model& model, const Plan& p, const std::vector<Record>& like) {
  const std::int64_t V = model.config().vocab_size;
  std::vector<std::int64_t> fed(p.tokens.size(), 0);
  for (const Record& r : like) fed[r.sequence] = std::max(fed[r.sequence], r.position + 1);
  std::vector<std::int32_t> tokens, cu{0};
  for (std::size_t n = 0; n < p.tokens.size(); ++n) {
    tokens.insert(tokens.end(), p.tokens[n].begin(), p.tokens[n].begin() + fed[n]);
    cu.push_back(static_cast<std::int32_t>(tokens.size()));
  }
  const auto T = std::ssize(tokens);
  void* out = nullptr;
  cuda_check(cudaMalloc(&out, T * V * sizeof(std::uint16_t)), "cudaMalloc");
  model.logits({tokens, cu}, TensorView::contiguous(out, DType::bf16, {T, V}, model.options().device));
  std::vector<std::uint16_t> bits(T * V);
  cuda_check(cudaMemcpy(bits.data(), out, bits.size() * sizeof(std::uint16_t), cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(out);
  std::vector<Record> records;
  for (const Record& r : like) {
    const std::int64_t row = cu[r.sequence] + r.position;
    std::vector<double> logits(V);
    for (std::int64_t v = 0; v < V; ++v) logits[v] = bf16_to_float(bits[row * V + v]);
    records.push_back({r.sequence, r.position, std::move(logits)});
  }
  return records;
}

// |a - b| over every logit of the records, relative to the largest |b|.
struct Gap {
  double max = 0, mean = 0;
};
Gap gap(const std::vector<Record>& a, const std::vector<Record>& b) {
  double scale = 0, sum = 0, worst = 0;
  std::size_t count = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].sequence, b[i].sequence);
    EXPECT_EQ(a[i].position, b[i].position);
    for (std::size_t v = 0; v < a[i].logits.size(); ++v) {
      const double d = std::abs(a[i].logits[v] - b[i].logits[v]);
      worst = std::isfinite(d) ? std::max(worst, d) : INFINITY;
      sum += d;
      scale = std::max(scale, std::abs(b[i].logits[v]));
      ++count;
    }
  }
  return {worst / scale, sum / double(count) / scale};
}

// How many records agree on the most likely next token.
std::size_t same_argmax(const std::vector<Record>& a, const std::vector<Record>& b) {
  std::size_t same = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto top = [](const std::vector<double>& l) { return std::max_element(l.begin(), l.end()) - l.begin(); };
    same += top(a[i].logits) == top(b[i].logits);
  }
  return same;
}

// Prefill and decode on the GPU against the float32 CPU model on the same weights, and against the GPU's own full
// forward over the same tokens. Decode computes the training forward's function with other float32 reductions
// (the recurrent GDN step from an fp32 state instead of the chunked kernel, attention over the cache in fp32
// instead of the unfused kernel's bf16 probabilities) and bf16 roundings at the same points, so its distance
// from the CPU model must be of the order of the GPU forward's own: within twice it, and its distance from the
// GPU forward within the sum of the two (3x).
TEST_F(CudaModelTest, PrefillAndDecodeMatchTheCpuModelAndTheFullForward) {
  SKIP_WITHOUT_GPU();
  const Config c = config();
  ParamStore bf16(c, DType::bf16), f32(c, DType::f32);
  bf16.init(0.05, seed_);
  widen(bf16, f32);
  const Plan plan = make_plan(rng_, c.vocab_size);

  Model cpu(c, {.dtype = DType::f32});
  cpu.bind(f32.params());
  const std::vector<Record> expected = rollout(cpu, plan);

  const Device gpu{DeviceType::cuda, 0};
  DeviceParams device(bf16, gpu);
  device.upload(bf16);
  Model model(c, {.device = gpu, .dtype = DType::bf16});
  model.bind(device.params());
  const std::vector<Record> decoded = rollout(model, plan);
  const std::vector<Record> forward = full_forward(model, plan, decoded);

  const Gap decode_cpu = gap(decoded, expected), forward_cpu = gap(forward, expected);
  const Gap decode_forward = gap(decoded, forward);
  std::printf("logits relative to the largest, max / mean: gpu decode vs cpu %.2e / %.2e; gpu forward vs cpu %.2e / "
              "%.2e; gpu decode vs gpu forward %.2e / %.2e; argmax agrees %zu of %zu (decode vs forward), %zu (decode "
              "vs cpu)\n",
              decode_cpu.max, decode_cpu.mean, forward_cpu.max, forward_cpu.mean, decode_forward.max,
              decode_forward.mean, same_argmax(decoded, forward), decoded.size(), same_argmax(decoded, expected));
  EXPECT_LT(forward_cpu.max, 5e-2);  // the premise: the GPU forward is a bf16 rendering of the CPU model
  EXPECT_LE(decode_cpu.max, 2 * forward_cpu.max);
  EXPECT_LE(decode_cpu.mean, 2 * forward_cpu.mean);
  EXPECT_LE(decode_forward.max, 3 * forward_cpu.max);
}

TEST_F(CudaModelTest, DecodeIsBitwiseDeterministic) {
  SKIP_WITHOUT_GPU();
  const Config c = config();
  ParamStore bf16(c, DType::bf16);
  bf16.init(0.05, seed_);
  const Plan plan = make_plan(rng_, c.vocab_size);
  const Device gpu{DeviceType::cuda, 0};
  DeviceParams device(bf16, gpu);
  device.upload(bf16);
  Model model(c, {.device = gpu, .dtype = DType::bf16});
  model.bind(device.params());
  const std::vector<Record> first = rollout(model, plan), second = rollout(model, plan);
  ASSERT_EQ(first.size(), second.size());
  for (std::size_t i = 0; i < first.size(); ++i) EXPECT_EQ(first[i].logits, second[i].logits) << "record " << i;
}

// Decode steps whose batch size changes and comes back (3, 3, 2, 3, 2, 2, 3, 1, 1, 3, 3, 3), so that decode with
// CUDA graphs runs a size one by one, records it and replays it, and leaves and returns to each size.
Plan make_changing_plan(std::mt19937_64& rng, std::int64_t vocab) {
  Plan p;
  p.prompt_lengths = {70, 1, 130};
  p.slots = {2, 0, 3};
  p.slot_count = 4;
  p.steps = {{0, 1, 2}, {0, 1, 2}, {0, 2}, {0, 1, 2}, {1, 2}, {0, 2}, {0, 1, 2},
             {1},       {2},       {0, 1, 2}, {0, 1, 2}, {0, 1, 2}};
  const auto steps = std::ssize(p.steps);
  for (std::size_t n = 0; n < p.prompt_lengths.size(); ++n) {
    p.tokens.push_back(testing::random_tokens(rng, p.prompt_lengths[n] + steps, vocab));
    p.max_length = std::max(p.max_length, p.prompt_lengths[n] + steps);
  }
  return p;
}

void expect_same_records(const std::vector<Record>& a, const std::vector<Record>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].sequence, b[i].sequence);
    EXPECT_EQ(a[i].position, b[i].position);
    EXPECT_EQ(a[i].logits, b[i].logits) << "record " << i;
  }
}

// Decode replayed from CUDA graphs against decode launching its kernels one by one: the same logits bit for bit,
// through the host-doubles path (rollout) and into a device view of the caller's, over batch sizes that change
// and repeat; again on a new state (other cache addresses), and after bind() to other weights (a graph holds the
// parameters' addresses).
TEST_F(CudaModelTest, DecodeReplayedFromCudaGraphsEqualsDecodeWithout) {
  SKIP_WITHOUT_GPU();
  const Config c = config();
  ParamStore first_weights(c, DType::bf16), second_weights(c, DType::bf16);
  first_weights.init(0.05, seed_);
  second_weights.init(0.05, seed_ + 1);
  const Plan plan = make_changing_plan(rng_, c.vocab_size);
  const Device gpu{DeviceType::cuda, 0};
  DeviceParams first(first_weights, gpu), second(second_weights, gpu);
  first.upload(first_weights);
  second.upload(second_weights);
  const testing::Stream stream;
  Model graphed(c, {.device = gpu, .dtype = DType::bf16, .stream = stream.get()});
  Model plain(c, {.device = gpu, .dtype = DType::bf16, .stream = stream.get(), .cuda_graphs = false});
  ASSERT_TRUE(graphed.decode_uses_cuda_graphs());
  ASSERT_FALSE(plain.decode_uses_cuda_graphs());
  graphed.bind(first.params());
  plain.bind(first.params());

  const std::vector<Record> expected = rollout(plain, plan);
  expect_same_records(rollout(graphed, plan), expected);
  expect_same_records(rollout(graphed, plan), expected);  // a new InferenceState

  // Into a device view: the engine's path. Each step's logits are compared as they are written.
  const std::int64_t V = c.vocab_size, S = std::ssize(plan.slots);
  void* rows = nullptr;
  cuda_check(cudaMalloc(&rows, 2 * S * V * sizeof(std::uint16_t)), "cudaMalloc");
  const auto view = [&](int model, std::int64_t n) {
    return TensorView::contiguous(static_cast<std::uint16_t*>(rows) + model * S * V, DType::bf16, {n, V}, gpu);
  };
  InferenceState graphed_state(c, graphed.options(), plan.slot_count, plan.max_length);
  InferenceState plain_state(c, plain.options(), plan.slot_count, plan.max_length);
  std::vector<std::int32_t> prompts, cu{0};
  for (std::size_t n = 0; n < plan.tokens.size(); ++n) {
    prompts.insert(prompts.end(), plan.tokens[n].begin(), plan.tokens[n].begin() + plan.prompt_lengths[n]);
    cu.push_back(static_cast<std::int32_t>(prompts.size()));
  }
  graphed.prefill({prompts, cu}, plan.slots, graphed_state, view(0, S));
  plain.prefill({prompts, cu}, plan.slots, plain_state, view(1, S));
  std::vector<std::int64_t> next(plan.prompt_lengths);
  std::vector<std::uint16_t> graphed_bits, plain_bits;
  for (std::size_t step = 0; step < plan.steps.size(); ++step) {
    std::vector<std::int32_t> tokens, slots;
    for (const int n : plan.steps[step]) {
      tokens.push_back(plan.tokens[n][next[n]++]);
      slots.push_back(plan.slots[n]);
    }
    const auto N = std::ssize(tokens);
    graphed.decode(tokens, slots, graphed_state, view(0, N));
    plain.decode(tokens, slots, plain_state, view(1, N));
    graphed_bits.resize(N * V);
    plain_bits.resize(N * V);
    cuda_check(cudaStreamSynchronize(stream.get()), "cudaStreamSynchronize");
    cuda_check(cudaMemcpy(graphed_bits.data(), view(0, N).data, N * V * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    cuda_check(cudaMemcpy(plain_bits.data(), view(1, N).data, N * V * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    EXPECT_EQ(graphed_bits, plain_bits) << "step " << step;
  }
  cudaFree(rows);

  graphed.bind(second.params());
  plain.bind(second.params());
  expect_same_records(rollout(graphed, plan), rollout(plain, plan));
}

}  // namespace
}  // namespace deltatrain::model
