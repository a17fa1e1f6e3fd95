// BatchSampler on a GPU against BatchSampler on the CPU on the identical values: fresh random bfloat16 logits
// (several batch sizes, vocabularies of 1, odd sizes and 248,320, planted ties at the top and inside the cuts,
// signed zeros), every sampling mode per row; the tokens must be equal and the logprobs (sampled and
// untempered) within what float64 sums over the vocabulary in two orders allow. Then the engine on the GPU
// against the same steps taken by hand: the GPU model's logits brought to the host as doubles and sampled there
// with the same draws. Every test skips (not passes) without a usable GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "deltatrain/core/bfloat16.h"
#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/system.h"
#include "deltatrain/model/inference.h"
#include "deltatrain/model/model.h"
#include "deltatrain/model/params.h"
#include "deltatrain/rollout/engine.h"
#include "deltatrain/rollout/sampling.h"
#include "cuda_testing.h"
#include "model_testing.h"
#include "rollout_testing.h"

namespace deltatrain::rollout {
namespace {

#define SKIP_WITHOUT_GPU()                                                      \
  do {                                                                          \
    if (!cuda_info().usable()) GTEST_SKIP() << cuda_info().unavailable_reason;  \
  } while (0)

const Device kGpu{DeviceType::cuda, 0};

class CudaSamplingTest : public model::testing::SeededTest {};

// The tiny preset with a 1,000-token vocabulary and seeded bfloat16 weights, uploaded to the GPU.
struct TinyGpuModel {
  model::Config config = [] {
    model::Config c = model::preset("tiny");
    c.vocab_size = 1000;
    return c;
  }();
  model::ParamStore store{config, DType::bf16};
  model::DeviceParams device{store, kGpu};  // allocates; the weights are uploaded once initialised
  explicit TinyGpuModel(std::uint64_t seed) {
    store.init(0.05, seed);
    device.upload(store);
  }
};

// Device memory freed at scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes) { cuda_check(cudaMalloc(&data_, std::max<std::size_t>(bytes, 1)), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
};

// N x V bfloat16 logits on the GPU and the same values widened to float64 on the host, each sampled by its own
// BatchSampler (the GPU's keeps its workspace from call to call).
class LogitsOnBoth {
 public:
  LogitsOnBoth(const std::vector<std::uint16_t>& bits, std::int64_t N, std::int64_t V)
      : N_(N), V_(V), device_(bits.size() * sizeof(std::uint16_t)), widened_(bits.size()) {
    cuda_check(cudaMemcpy(device_.data(), bits.data(), bits.size() * sizeof(std::uint16_t), cudaMemcpyHostToDevice),
               "cudaMemcpy");
    std::transform(bits.begin(), bits.end(), widened_.begin(), [](std::uint16_t b) { return double(bf16_to_float(b)); });
  }
  std::vector<Sample> sample_on_gpu(const std::vector<RowSampling>& rows) {
    return gpu_.sample(TensorView::contiguous(device_.data(), DType::bf16, {N_, V_}, kGpu), rows);
  }
  std::vector<Sample> sample_on_cpu(const std::vector<RowSampling>& rows) {
    return cpu_.sample(TensorView::contiguous(widened_.data(), DType::f64, {N_, V_}), rows);
  }

 private:
  std::int64_t N_, V_;
  DeviceBuffer device_;
  std::vector<double> widened_;
  BatchSampler gpu_, cpu_;
};

// Row n's logits: normal with a scale that varies by row (flat to peaked), as bfloat16, with ties planted: the
// row's maximum repeated at a few random places, a run of one value copied over ~2% of the row (so top-k and
// top-p cuts land inside runs of equal values), and +0 / -0.
std::vector<std::uint16_t> random_bf16_logits(std::mt19937_64& rng, std::int64_t N, std::int64_t V) {
  std::vector<std::uint16_t> bits(N * V);
  std::uniform_int_distribution<std::int64_t> position(0, V - 1);
  for (std::int64_t n = 0; n < N; ++n) {
    std::normal_distribution<float> value(0.f, 0.5f + 4.f * float(n % 7));
    std::uint16_t* row = bits.data() + n * V;
    for (std::int64_t v = 0; v < V; ++v) row[v] = float_to_bf16(value(rng));
    const std::uint16_t top = *std::max_element(row, row + V, [](std::uint16_t a, std::uint16_t b) {
      return bf16_to_float(a) < bf16_to_float(b);
    });
    for (int i = 0; i < 3; ++i) row[position(rng)] = top;
    const std::uint16_t common = row[position(rng)];
    for (std::int64_t i = 0; i < V / 50; ++i) row[position(rng)] = common;
    row[position(rng)] = float_to_bf16(0.f);
    row[position(rng)] = float_to_bf16(-0.f);
  }
  return bits;
}

// Every mode, by row: greedy, plain, temperatures, top-k (1, small, >= V, V - 1), top-p (tiny, mid, 1), both.
SamplingParams mode(std::int64_t n, std::int64_t V) {
  const auto k = [&](std::int64_t value) { return static_cast<std::int32_t>(std::min<std::int64_t>(value, INT32_MAX)); };
  switch (n % 12) {
    case 0: return {.temperature = 0};
    case 1: return {.temperature = 1.0};
    case 2: return {.temperature = 0.3};
    case 3: return {.temperature = 2.5};
    case 4: return {.temperature = 1.0, .top_k = 1};
    case 5: return {.temperature = 0.8, .top_k = 50};
    case 6: return {.temperature = 1.0, .top_k = k(V + 3)};
    case 7: return {.temperature = 1.0, .top_k = k(std::max<std::int64_t>(V - 1, 1))};
    case 8: return {.temperature = 1.0, .top_p = 1e-6};
    case 9: return {.temperature = 0.9, .top_p = 0.9};
    case 10: return {.temperature = 1.2, .top_p = 1.0, .top_k = 1000};
    default: return {.temperature = 0.7, .top_p = 0.6, .top_k = k(V / 3 + 1)};
  }
}

// `count` requests with ids first_id, first_id + 1, ...: request n has prompt_length(n) random tokens, asks for
// max_new_tokens(n), samples in mode(n) with a fresh seed, and wants untempered logprobs when n % 2 == untempered.
template <class PromptLength, class MaxNewTokens>
std::vector<Request> random_requests(std::mt19937_64& rng, std::int64_t vocab, std::int64_t count, std::uint64_t first_id,
                                     PromptLength prompt_length, MaxNewTokens max_new_tokens, std::int64_t untempered) {
  std::vector<Request> requests(count);
  for (std::int64_t n = 0; n < count; ++n) {
    Request& r = requests[n];
    r.id = first_id + static_cast<std::uint64_t>(n);
    r.prompt = model::testing::random_tokens(rng, prompt_length(n), vocab);
    r.max_new_tokens = static_cast<std::int32_t>(max_new_tokens(n));
    r.sampling = mode(n, vocab);
    r.sampling.seed = rng();
    r.untempered_logprobs = n % 2 == untempered;
  }
  return requests;
}

// Every mode by row (mode(n + N)), every other row wanting the untempered log-probability; or, `greedy`, every row
// greedy without it (the GPU's greedy_rows path).
void expect_gpu_equals_cpu(std::mt19937_64& rng, std::int64_t N, std::int64_t V, bool greedy = false) {
  LogitsOnBoth logits(random_bf16_logits(rng, N, V), N, V);
  std::vector<RowSampling> rows(N);
  const std::uint64_t seed = rng();
  for (std::int64_t n = 0; n < N; ++n)
    rows[n] = greedy ? RowSampling{{.temperature = 0}, uniform(seed, n, 0), false}
                     : RowSampling{mode(n + N, V), uniform(seed, n, 0), n % 2 == 1};

  const std::vector<Sample> on_gpu = logits.sample_on_gpu(rows), on_cpu = logits.sample_on_cpu(rows);
  ASSERT_EQ(on_gpu.size(), std::size_t(N));
  for (std::int64_t n = 0; n < N; ++n) {
    const SamplingParams& p = rows[n].params;
    const std::string where = "N " + std::to_string(N) + " V " + std::to_string(V) + " row " + std::to_string(n) +
                              ": temperature " + std::to_string(p.temperature) + " top_p " + std::to_string(p.top_p) +
                              " top_k " + std::to_string(p.top_k) + " u " + std::to_string(rows[n].u);
    EXPECT_EQ(on_gpu[n].token, on_cpu[n].token) << where;
    EXPECT_NEAR(on_gpu[n].logprob, on_cpu[n].logprob, model::testing::log_softmax_tolerance(V, on_cpu[n].logprob))
        << where;
    EXPECT_NEAR(on_gpu[n].untempered_logprob, on_cpu[n].untempered_logprob,
                model::testing::log_softmax_tolerance(V, on_cpu[n].untempered_logprob))
        << where;
  }
  // Calls after the first reuse the workspace: a second call on the same rows gives the same samples.
  const std::vector<Sample> again = logits.sample_on_gpu(rows);
  for (std::int64_t n = 0; n < N; ++n) EXPECT_EQ(again[n].token, on_gpu[n].token) << "row " << n;
}

TEST_F(CudaSamplingTest, EqualsTheCpuSamplerOnTheQwenVocabulary) {
  SKIP_WITHOUT_GPU();
  for (const std::int64_t N : {1, 37, 256}) expect_gpu_equals_cpu(rng_, N, 248320);
}

TEST_F(CudaSamplingTest, EqualsTheCpuSamplerOnOddAndTinyVocabularies) {
  SKIP_WITHOUT_GPU();
  expect_gpu_equals_cpu(rng_, 512, 4099);
  expect_gpu_equals_cpu(rng_, 24, 1);
  expect_gpu_equals_cpu(rng_, 24, 2);
  expect_gpu_equals_cpu(rng_, 24, 4097);
  expect_gpu_equals_cpu(rng_, 24, 100003);
}

// Batches of greedy rows that want no untempered log-probability take greedy_rows, each row spread over several
// blocks: the CPU's argmax (the lowest id among the planted ties of the maximum) over rows that start at every
// alignment and parts of every size.
TEST_F(CudaSamplingTest, GreedyBatchesSpreadOverBlocksEqualTheCpuArgmax) {
  SKIP_WITHOUT_GPU();
  for (const auto& [N, V] : {std::pair<std::int64_t, std::int64_t>{1, 248320}, {64, 248320}, {3, 100003},
                             {300, 4099}, {5, 1}, {7, 8195}})
    expect_gpu_equals_cpu(rng_, N, V, true);
}

// A row of one value: every cut falls inside the tie, on the lowest ids.
TEST_F(CudaSamplingTest, AllEqualLogitsKeepTheLowestIds) {
  SKIP_WITHOUT_GPU();
  const std::int64_t N = 12, V = 10007;
  LogitsOnBoth logits(std::vector<std::uint16_t>(N * V, float_to_bf16(1.5f)), N, V);
  std::vector<RowSampling> rows(N);
  for (std::int64_t n = 0; n < N; ++n) rows[n] = {mode(n, V), uniform(seed_, n, 1), true};
  const std::vector<Sample> on_gpu = logits.sample_on_gpu(rows), on_cpu = logits.sample_on_cpu(rows);
  for (std::int64_t n = 0; n < N; ++n) {
    EXPECT_EQ(on_gpu[n].token, on_cpu[n].token) << "row " << n;
    EXPECT_NEAR(on_gpu[n].logprob, on_cpu[n].logprob, 1e-12) << "row " << n;
    EXPECT_NEAR(on_gpu[n].untempered_logprob, -std::log(double(V)), 1e-12) << "row " << n;
  }
}

// The engine on the GPU (logits kept on the device, one sampling call per step) against the same schedule by
// hand: every prompt prefilled at once into slots 0.., then decode steps over all of them, the GPU model's logits
// widened to host doubles and drawn with sample_token and the same draws.
TEST_F(CudaSamplingTest, EngineOnTheGpuEqualsHostSamplingOfTheSameLogits) {
  SKIP_WITHOUT_GPU();
  const TinyGpuModel tiny(seed_);
  const model::Config& c = tiny.config;
  const model::ModelOptions options{.device = kGpu, .dtype = DType::bf16};
  const std::int64_t sequences = 6, new_tokens = 12;
  const std::vector<Request> requests = random_requests(
      rng_, c.vocab_size, sequences, 100, [](std::int64_t n) { return 5 + 7 * n; },
      [&](std::int64_t) { return new_tokens; }, 0);
  Engine engine(c, options, tiny.device.params(), {.max_batch = sequences, .max_length = 256});
  const std::vector<Completion> out = engine.generate(requests);

  model::Model m(c, options);
  m.bind(tiny.device.params());
  model::InferenceState state(c, options, sequences, 256);
  std::vector<std::int32_t> prompts, cu{0}, slots;
  for (std::int64_t n = 0; n < sequences; ++n) {
    prompts.insert(prompts.end(), requests[n].prompt.begin(), requests[n].prompt.end());
    cu.push_back(static_cast<std::int32_t>(prompts.size()));
    slots.push_back(static_cast<std::int32_t>(n));
  }
  std::vector<double> logits(sequences * c.vocab_size);
  std::vector<std::int32_t> scratch, last(sequences);
  m.prefill({prompts, cu}, slots, state, logits);
  for (std::int64_t t = 0; t < new_tokens; ++t) {
    if (t > 0) m.decode(last, slots, state, logits);
    for (std::int64_t n = 0; n < sequences; ++n) {
      const Request& r = requests[n];
      const std::span<const double> row(logits.data() + n * c.vocab_size, c.vocab_size);
      const Sample s = sample_token(row, r.sampling, uniform(r.sampling.seed, r.id, t), r.untempered_logprobs, scratch);
      ASSERT_EQ(out[n].tokens[t], s.token) << "sequence " << n << " token " << t;
      EXPECT_NEAR(out[n].logprobs[t], s.logprob, 1e-12) << "sequence " << n << " token " << t;
      if (r.untempered_logprobs) {
        EXPECT_NEAR(out[n].untempered_logprobs[t], s.untempered_logprob, 1e-12) << "sequence " << n << " token " << t;
      }
      last[n] = s.token;
    }
  }
}

// True on-policy on the GPU: in batch-invariant mode the rollout's untempered log-probability of every sampled
// token is bit for bit the training forward's over all the completions packed together, although the rollout ran
// prefill and decode in changing batches (more requests than slots, decode replayed from CUDA graphs) and the
// trainer one packed forward in loss chunks of another size. Without the mode the two differ (the control: the
// test can fail).
TEST_F(CudaSamplingTest, BatchInvariantRolloutEqualsTheTrainingForwardBitForBit) {
  SKIP_WITHOUT_GPU();
  const TinyGpuModel tiny(seed_);
  const model::Config& c = tiny.config;
  const model::testing::Stream stream;
  std::vector<Request> requests = random_requests(
      rng_, c.vocab_size, 7, 300, [](std::int64_t n) { return 3 + 11 * n; }, [](std::int64_t n) { return 6 + 3 * n; }, 0);
  for (Request& r : requests) {
    r.sampling.temperature = 1.0, r.sampling.top_p = 1.0, r.sampling.top_k = 0;
    r.untempered_logprobs = true;
  }
  auto largest_difference = [&](bool invariant) {
    const model::ModelOptions options{
        .device = kGpu, .dtype = DType::bf16, .stream = stream.get(), .loss_chunk = 37, .batch_invariant = invariant};
    Engine engine(c, options, tiny.device.params(), {.max_batch = 3, .max_length = 160, .max_prefill_tokens = 50});
    return testing::largest_logprob_gap(c, options, tiny.device.params(), requests, engine.generate(requests));
  };
  EXPECT_EQ(largest_difference(true), 0.0);
  EXPECT_GT(largest_difference(false), 0.0);
}

// The engine with decode replayed from CUDA graphs against the engine launching decode's kernels one by one, on the
// same requests: more requests than slots and different lengths, so sequences join and finish and the decode batch
// size changes and repeats. Tokens, logprobs and finish reasons must be identical; a second round on the same
// engines replays the graphs recorded in the first. Graphs on the caller's stream, and on the engine's own when the
// caller names none (the CLI's, the Python binding's and the RL loop's case).
TEST_F(CudaSamplingTest, EngineWithCudaGraphsEqualsEngineWithout) {
  SKIP_WITHOUT_GPU();
  const TinyGpuModel tiny(seed_);
  const model::Config& c = tiny.config;
  const model::testing::Stream stream;
  const std::int64_t count = 9;
  const std::vector<Request> requests = random_requests(
      rng_, c.vocab_size, count, 200, [](std::int64_t n) { return 1 + 9 * n; },
      [](std::int64_t n) { return 2 + (5 * n) % 11; }, 1);
  const EngineOptions engine_options{.max_batch = 4, .max_length = 128, .max_prefill_tokens = 40};
  {
    Engine graphed(c, {.device = kGpu, .dtype = DType::bf16, .stream = stream.get()}, tiny.device.params(),
                   engine_options);
    Engine own_stream(c, {.device = kGpu, .dtype = DType::bf16}, tiny.device.params(), engine_options);
    Engine plain(c, {.device = kGpu, .dtype = DType::bf16, .stream = stream.get(), .cuda_graphs = false},
                 tiny.device.params(), engine_options);
    EXPECT_TRUE(graphed.uses_cuda_graphs());
    EXPECT_TRUE(own_stream.uses_cuda_graphs());
    EXPECT_FALSE(plain.uses_cuda_graphs());
    for (int round = 0; round < 2; ++round) {
      const std::vector<Completion> expected = plain.generate(requests);
      for (Engine* engine : {&graphed, &own_stream}) {
        const std::vector<Completion> out = engine->generate(requests);
        ASSERT_EQ(out.size(), expected.size());
        for (std::int64_t n = 0; n < count; ++n) {
          SCOPED_TRACE("round " + std::to_string(round) + " request " + std::to_string(n) +
                       (engine == &graphed ? " (caller's stream)" : " (engine's stream)"));
          EXPECT_EQ(out[n].id, expected[n].id);
          EXPECT_EQ(out[n].tokens, expected[n].tokens);
          EXPECT_EQ(out[n].logprobs, expected[n].logprobs);
          EXPECT_EQ(out[n].untempered_logprobs, expected[n].untempered_logprobs);
          EXPECT_EQ(out[n].finish, expected[n].finish);
        }
      }
    }
  }
}

// Overlapped decode steps (each queued from the previous step's tokens on the device before the host reads them)
// against synchronous ones: the same completions bit for bit, with sequences that stop on a token (so a step runs
// past them and its sample must be dropped), sequences that reach max_new_tokens, more requests than slots and
// requests submitted while others run.
TEST_F(CudaSamplingTest, OverlappedDecodeStepsEqualSynchronousOnes) {
  SKIP_WITHOUT_GPU();
  const TinyGpuModel tiny(seed_);
  const model::Config& c = tiny.config;
  const model::testing::Stream stream;
  const model::ModelOptions options{.device = kGpu, .dtype = DType::bf16, .stream = stream.get()};
  const std::int64_t count = 10;
  std::vector<Request> requests = random_requests(
      rng_, c.vocab_size, count, 500, [](std::int64_t n) { return 2 + 5 * n; },
      [](std::int64_t n) { return 6 + (7 * n) % 13; }, 0);
  const auto run = [&](bool overlap) {
    Engine engine(c, options, tiny.device.params(),
                  {.max_batch = 4, .max_length = 128, .max_prefill_tokens = 30, .overlap_steps = overlap});
    for (std::int64_t n = 0; n < count / 2; ++n) engine.submit(requests[n]);
    std::vector<Completion> done;
    std::int64_t next = count / 2;
    for (int steps = 1; !engine.idle() || next < count; ++steps) {
      engine.step();
      if (steps % 3 == 0 && next < count) engine.submit(requests[next++]);
      for (Completion& x : engine.take_finished()) done.push_back(std::move(x));
    }
    std::sort(done.begin(), done.end(), [](const Completion& a, const Completion& b) { return a.id < b.id; });
    return done;
  };
  // Stops that occur: each odd request stops on the token its synchronous run without stops drew third. Until the
  // first stop both runs batch alike, so at least that one fires; later ones may not, as other batches may round the
  // logits otherwise.
  const std::vector<Completion> unstopped = run(false);
  for (std::int64_t n = 1; n < count; n += 2) requests[n].stop_tokens = {unstopped[n].tokens[2]};
  const std::vector<Completion> expected = run(false), out = run(true);
  ASSERT_EQ(out.size(), std::size_t(count));
  int stopped = 0;
  for (std::int64_t n = 0; n < count; ++n) {
    SCOPED_TRACE("request " + std::to_string(n));
    EXPECT_EQ(out[n].tokens, expected[n].tokens);
    EXPECT_EQ(out[n].logprobs, expected[n].logprobs);
    EXPECT_EQ(out[n].untempered_logprobs, expected[n].untempered_logprobs);
    EXPECT_EQ(out[n].finish, expected[n].finish);
    stopped += expected[n].finish == FinishReason::stop;
  }
  EXPECT_GE(stopped, 1) << "a step ran past a stopped sequence";
}

}  // namespace
}  // namespace deltatrain::rollout
