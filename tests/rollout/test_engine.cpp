// The engine against the model's full forward, on fresh random weights and prompts each run (a failure prints
// the seed; DELTATRAIN_TEST_SEED=<seed> replays it): greedy tokens are the argmax of Model::logits over prompt +
// generated prefix at every step, returned logprobs are the log-softmax of those logits under the same
// temperature / top-k / top-p transform (written here, independently of sampling.cpp), sampling reproduces
// from the seed, a sequence in a continuous batch (others joining and leaving, slots reused) gets what it gets
// alone, the scheduler's decisions, and every bad input refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "deltatrain/core/error.h"
#include "deltatrain/model/inference.h"
#include "deltatrain/model/model.h"
#include "deltatrain/model/params.h"
#include "deltatrain/rollout/engine.h"
#include "model_testing.h"
#include "rollout_testing.h"

namespace deltatrain::rollout {
namespace {

using model::Config;

Config small_config(bool tied) { return model::testing::small_hybrid_config(tied); }

class EngineTest : public model::testing::SeededTest {
 protected:
  // Random weights with random norm weights too (zeros at init would hide a wrong norm), scaled up so that
  // logits spread and the distributions are far from uniform.
  model::ParamStore& store(const Config& config, DType dtype) {
    store_ = std::make_unique<model::ParamStore>(config, dtype);
    store_->init(0.3, rng_());
    return *store_;
  }


  // Requests of every kind: greedy, tempered, top-p, top-k + top-p, stop tokens, a one-token prompt (shorter
  // than the conv history), prompts longer than a GDN chunk, untempered logprobs asked for.
  std::vector<Request> mixed_requests(std::int64_t vocab, int count) {
    std::vector<Request> requests;
    std::uniform_int_distribution<int> length(1, 70), news(1, 12);
    for (int i = 0; i < count; ++i) {
      Request r;
      r.id = 100 + i;
      r.prompt = model::testing::random_tokens(rng_, i == 0 ? 1 : length(rng_), vocab);
      r.max_new_tokens = news(rng_);
      r.untempered_logprobs = true;
      const std::uint64_t seed = rng_();
      switch (i % 4) {
        case 0: r.sampling = {.temperature = 0, .seed = seed}; break;
        case 1: r.sampling = {.temperature = 0.8, .seed = seed}; break;
        case 2: r.sampling = {.temperature = 1.3, .top_p = 0.7, .seed = seed}; break;
        default: r.sampling = {.temperature = 1.0, .top_p = 0.9, .top_k = 5, .seed = seed};
      }
      if (i % 3 == 1) r.stop_tokens = {static_cast<std::int32_t>(i % vocab), 3};
      requests.push_back(r);
    }
    return requests;
  }

  std::unique_ptr<model::ParamStore> store_;
};

Request request(std::uint64_t id, std::vector<std::int32_t> prompt, std::int32_t max_new_tokens = 4,
                SamplingParams sampling = {}) {
  Request r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  r.sampling = sampling;
  return r;
}

// The full forward's logits of the last position of `tokens`, as doubles.
std::vector<double> last_logits(model::Model& m, const std::vector<std::int32_t>& tokens) {
  const auto T = static_cast<std::int64_t>(tokens.size()), V = m.config().vocab_size;
  const std::vector<std::int32_t> cu{0, static_cast<std::int32_t>(T)};
  std::vector<double> out(V);
  if (m.options().dtype == DType::f64) {
    std::vector<double> all(T * V);
    m.logits({tokens, cu}, TensorView::contiguous(all.data(), DType::f64, {T, V}));
    std::copy(all.end() - V, all.end(), out.begin());
  } else {
    std::vector<float> all(T * V);
    m.logits({tokens, cu}, TensorView::contiguous(all.data(), DType::f32, {T, V}));
    std::copy(all.end() - V, all.end(), out.begin());
  }
  return out;
}

// The reference transform, written from the definition: logits / T; keep the top_k largest (ties to the
// lower id); sort the rest by probability; keep the shortest prefix whose probability reaches top_p; return
// log p(token) renormalised over what is kept, or -inf when the token is not kept.
double reference_logprob(const std::vector<double>& logits, const SamplingParams& p, std::int32_t token) {
  const auto V = static_cast<std::int32_t>(logits.size());
  std::vector<std::int32_t> ids(V);
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](std::int32_t a, std::int32_t b) { return logits[a] > logits[b]; });
  const std::int32_t k = p.top_k > 0 ? std::min(p.top_k, V) : V;
  ids.resize(k);
  std::vector<double> prob(k);
  double z = 0;
  for (std::int32_t i = 0; i < k; ++i) z += std::exp(logits[ids[i]] / p.temperature - logits[ids[0]] / p.temperature);
  for (std::int32_t i = 0; i < k; ++i) prob[i] = std::exp(logits[ids[i]] / p.temperature - logits[ids[0]] / p.temperature) / z;
  std::int32_t kept = 0;
  double mass = 0;
  while (kept < k) {
    mass += prob[kept++];
    if (mass >= p.top_p * (1 - 1e-12)) break;
  }
  for (std::int32_t i = 0; i < kept; ++i)
    if (ids[i] == token) return std::log(prob[i] / mass);
  return -INFINITY;
}

struct Mismatch {
  double sum = 0, max = 0, k3 = 0;
  std::int64_t n = 0;
  void add(double rollout, double trainer) {
    const double d = std::abs(rollout - trainer), r = trainer - rollout;
    sum += d;
    max = std::max(max, d);
    k3 += std::exp(r) - 1 - r;  // k3 estimate of KL(rollout || trainer), tokens drawn by the rollout
    ++n;
  }
  void print(const char* what) const {
    std::printf("[mismatch] %s: %lld tokens, mean |dlogp| %.3e, max |dlogp| %.3e, k3 KL %.3e\n", what,
                static_cast<long long>(n), n ? sum / n : 0.0, max, n ? k3 / n : 0.0);
  }
};

// The same weights in float64 (the float32 store's values, exactly).
std::unique_ptr<model::ParamStore> widened(const Config& config, const model::ParamStore& store) {
  auto wide = std::make_unique<model::ParamStore>(config, DType::f64);
  const auto* from = static_cast<const float*>(store.param_buffer().data);
  auto* to = static_cast<double*>(wide->param_buffer().data);
  std::copy(from, from + store.numel(), to);
  return wide;
}

// log p(token) with all logits (no transform), in float64.
double log_softmax_at(const std::vector<double>& logits, std::int32_t token) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double z = 0;
  for (const double l : logits) z += std::exp(l - max);
  return logits[token] - max - std::log(z);
}

// Generates every request, then replays each completion through the full forward: every token must be what
// the logits allow (greedy: the argmax, unless the top two are within `tie`) and every logprob must match the
// reference transform within `tolerance`. In float32 both bounds grow by 4x the full forward's own error against a
// float64 evaluation of the same weights at that token: where the model is ill-conditioned (a random model's
// prompt can put 3e-4 of float32 rounding into a logprob), two float32 evaluation orders differ by as much.
void check_against_full_forward(const Config& config, DType dtype, model::ParamStore& store,
                                const std::vector<Request>& requests, const EngineOptions& options, double tolerance,
                                double tie, const char* label) {
  Engine engine(config, {.dtype = dtype, .cpu_threads = 1}, store.params(), options);
  const std::vector<Completion> out = engine.generate(requests);
  model::Model full(config, {.dtype = dtype, .cpu_threads = 1});
  full.bind(store.params());
  const std::unique_ptr<model::ParamStore> wide = dtype == DType::f32 ? widened(config, store) : nullptr;
  std::unique_ptr<model::Model> exact;
  if (wide) {
    exact = std::make_unique<model::Model>(config, model::ModelOptions{.dtype = DType::f64, .cpu_threads = 1});
    exact->bind(wide->params());
  }
  Mismatch sampled, untempered;
  int near_ties = 0;
  ASSERT_EQ(out.size(), requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    const Completion& c = out[i];
    ASSERT_EQ(c.id, r.id);
    ASSERT_FALSE(c.tokens.empty());
    ASSERT_EQ(c.logprobs.size(), c.tokens.size());
    std::vector<std::int32_t> prefix = r.prompt;
    for (std::size_t t = 0; t < c.tokens.size(); ++t) {
      const std::vector<double> logits = last_logits(full, prefix);
      const std::vector<double> exact_logits = exact ? last_logits(*exact, prefix) : logits;
      const std::int32_t token = c.tokens[t];
      double logit_error = 0;
      for (std::size_t i = 0; i < logits.size(); ++i)
        logit_error = std::max(logit_error, std::abs(logits[i] - exact_logits[i]));
      if (r.sampling.temperature == 0) {
        std::vector<double> sorted = logits;
        std::sort(sorted.rbegin(), sorted.rend());
        const auto best = static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        const double tie_here = tie + 4 * logit_error;
        if (sorted[0] - sorted[1] > tie_here) {
          EXPECT_EQ(token, best) << label << " request " << r.id << " token " << t;
        } else {
          ++near_ties;
          EXPECT_LE(logits[best] - logits[token], tie_here) << label << " request " << r.id << " token " << t;
        }
        EXPECT_EQ(c.logprobs[t], 0.0);
      } else {
        const double expected = reference_logprob(logits, r.sampling, token);
        const double error = std::abs(expected - reference_logprob(exact_logits, r.sampling, token));
        EXPECT_NEAR(c.logprobs[t], expected, tolerance + 4 * error) << label << " request " << r.id << " token " << t;
        sampled.add(c.logprobs[t], expected);
      }
      if (r.untempered_logprobs) {
        ASSERT_EQ(c.untempered_logprobs.size(), c.tokens.size());
        const double expected = log_softmax_at(logits, token);
        const double error = std::abs(expected - log_softmax_at(exact_logits, token));
        EXPECT_NEAR(c.untempered_logprobs[t], expected, tolerance + 4 * error)
            << label << " request " << r.id << " token " << t;
        untempered.add(c.untempered_logprobs[t], expected);
      }
      const bool stop = std::find(r.stop_tokens.begin(), r.stop_tokens.end(), token) != r.stop_tokens.end();
      if (t + 1 < c.tokens.size()) {
        EXPECT_FALSE(stop) << "generation went on after a stop token";
      }
      prefix.push_back(token);
    }
    const bool stopped = std::find(r.stop_tokens.begin(), r.stop_tokens.end(), c.tokens.back()) != r.stop_tokens.end();
    EXPECT_EQ(c.finish, stopped ? FinishReason::stop : FinishReason::length);
    if (!stopped) {
      EXPECT_EQ(std::ssize(c.tokens), r.max_new_tokens);
    }
  }
  if (sampled.n) sampled.print((std::string(label) + " sampled").c_str());
  if (untempered.n) untempered.print((std::string(label) + " untempered").c_str());
  if (near_ties) std::printf("[mismatch] %s: %d greedy near-ties (top-2 margin <= %.0e) skipped\n", label, near_ties, tie);
}

class FullForward : public EngineTest, public ::testing::WithParamInterface<bool> {};

// float64: exact tokens and logprobs to 1e-10. Continuous batching throughout (3 slots, 9 requests).
TEST_P(FullForward, Float64EqualsTheFullForward) {
  const Config c = small_config(GetParam());
  model::ParamStore& s = store(c, DType::f64);
  const auto requests = mixed_requests(c.vocab_size, 9);
  check_against_full_forward(c, DType::f64, s, requests, {.max_batch = 3, .max_length = 96, .max_prefill_tokens = 80},
                             1e-10, 0, GetParam() ? "float64 tied" : "float64 untied");
}

// float32: logprobs to 1e-4, greedy tokens wherever the top-2 margin exceeds 1e-4 (both widened where float32
// itself is that far from float64 at the token: check_against_full_forward).
TEST_P(FullForward, Float32EqualsTheFullForward) {
  const Config c = small_config(GetParam());
  model::ParamStore& s = store(c, DType::f32);
  const auto requests = mixed_requests(c.vocab_size, 9);
  check_against_full_forward(c, DType::f32, s, requests, {.max_batch = 3, .max_length = 96, .max_prefill_tokens = 80},
                             1e-4, 1e-4, GetParam() ? "float32 tied" : "float32 untied");
}

INSTANTIATE_TEST_SUITE_P(Embeddings, FullForward, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "tied" : "untied"; });

// The tiny preset (head dims 64, a 4096-token vocabulary) in float32.
TEST_F(EngineTest, TinyPresetEqualsTheFullForward) {
  const Config c = model::preset("tiny");
  model::ParamStore& s = store(c, DType::f32);
  std::vector<Request> requests;
  for (int i = 0; i < 3; ++i) {
    Request r = request(i, model::testing::random_tokens(rng_, 5 + 17 * i, c.vocab_size), 6,
                        {.temperature = i == 0 ? 0.0 : 0.9, .top_p = i == 2 ? 0.8 : 1.0, .seed = rng_()});
    r.untempered_logprobs = true;
    requests.push_back(r);
  }
  check_against_full_forward(c, DType::f32, s, requests, {.max_batch = 2, .max_length = 64}, 1e-4, 1e-4,
                             "tiny float32");
}

// Each request alone in a 1-slot engine, then all of them through 3 slots with different arrival (every
// request admitted as slots free up, several prefills packed): the same tokens, and logprobs to 1e-12.
TEST_F(EngineTest, ContinuousBatchingIsBatchInvariant) {
  const Config c = small_config(false);
  model::ParamStore& s = store(c, DType::f64);
  const auto requests = mixed_requests(c.vocab_size, 10);
  const model::ModelOptions mo{.dtype = DType::f64, .cpu_threads = 1};
  std::vector<Completion> alone;
  for (const Request& r : requests) {
    Engine e(c, mo, s.params(), {.max_batch = 1, .max_length = 96});
    alone.push_back(e.generate(std::span(&r, 1)).front());
  }
  Engine batched(c, mo, s.params(), {.max_batch = 3, .max_length = 96, .max_prefill_tokens = 100});
  // Half submitted up front, the rest while the first ones run.
  for (std::size_t i = 0; i < requests.size() / 2; ++i) batched.submit(requests[i]);
  std::vector<Completion> done;
  std::size_t next = requests.size() / 2;
  int steps = 0;
  while (!batched.idle() || next < requests.size()) {
    batched.step();
    if (++steps % 2 == 0 && next < requests.size()) batched.submit(requests[next++]);
    for (Completion& x : batched.take_finished()) done.push_back(std::move(x));
  }
  ASSERT_EQ(done.size(), requests.size());
  for (const Completion& a : alone) {
    const auto it = std::find_if(done.begin(), done.end(), [&](const Completion& b) { return b.id == a.id; });
    ASSERT_NE(it, done.end());
    EXPECT_EQ(it->tokens, a.tokens) << "request " << a.id;
    EXPECT_EQ(it->finish, a.finish);
    ASSERT_EQ(it->logprobs.size(), a.logprobs.size());
    for (std::size_t t = 0; t < a.logprobs.size(); ++t) {
      EXPECT_NEAR(it->logprobs[t], a.logprobs[t], 1e-12) << "request " << a.id << " token " << t;
      EXPECT_NEAR(it->untempered_logprobs[t], a.untempered_logprobs[t], 1e-12);
    }
  }
}

// The same requests twice give bitwise the same completions; another seed gives other tokens.
// True on-policy: in batch-invariant mode the rollout's log-probability of every sampled token is bit for bit
// the training forward's over all the completions packed together, although the rollout ran prefill and
// decode in changing batches (more requests than slots) and the trainer one packed forward. Without the mode,
// in float32, the two differ (the control: the test can fail).
TEST_F(EngineTest, BatchInvariantRolloutEqualsTheTrainingForwardBitForBit) {
  const Config c = small_config(false);
  model::ParamStore& s = store(c, DType::f32);
  std::vector<Request> requests = mixed_requests(c.vocab_size, 7);
  for (Request& r : requests) r.sampling.temperature = 1.0, r.sampling.top_p = 1.0, r.sampling.top_k = 0;
  auto largest_difference = [&](bool invariant) {
    const model::ModelOptions options{.dtype = DType::f32, .cpu_threads = 1, .batch_invariant = invariant};
    Engine engine(c, options, s.params(), {.max_batch = 3, .max_length = 96});
    return testing::largest_logprob_gap(c, options, s.params(), requests, engine.generate(requests));
  };
  EXPECT_EQ(largest_difference(true), 0.0);
  EXPECT_GT(largest_difference(false), 0.0);
}

TEST_F(EngineTest, SamplingReproducesFromTheSeed) {
  const Config c = small_config(true);
  model::ParamStore& s = store(c, DType::f32);
  std::vector<Request> requests;
  for (int i = 0; i < 4; ++i) {
    requests.push_back(request(i, model::testing::random_tokens(rng_, 9, c.vocab_size), 20, {.temperature = 1.5, .seed = 7}));
  }
  const model::ModelOptions mo{.dtype = DType::f32, .cpu_threads = 1};
  Engine e(c, mo, s.params(), {.max_batch = 2, .max_length = 64});
  const auto first = e.generate(requests);
  const auto second = e.generate(requests);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(first[i].tokens, second[i].tokens);
    EXPECT_EQ(first[i].logprobs, second[i].logprobs);
  }
  for (Request& r : requests) r.sampling.seed = 8;
  const auto other = e.generate(requests);
  int differ = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) differ += other[i].tokens != first[i].tokens;
  EXPECT_GT(differ, 0) << "80 draws at temperature 1.5 all the same under another seed";
}

TEST(Scheduler, RetiresFinishedAndAdmitsFirstComeFirstServed) {
  using P = SlotPhase;
  const std::vector<P> slots{P::running, P::finished, P::free, P::running, P::free};
  const std::vector<std::int64_t> waiting{10, 20, 30, 5};
  StepPlan plan = plan_step(slots, waiting, 1000);
  EXPECT_EQ(plan.retire, (std::vector<std::int64_t>{1}));
  ASSERT_EQ(plan.admit.size(), 3u);  // three slots free after retirement
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(plan.admit[i].waiting, i);
  EXPECT_EQ(plan.admit[0].slot, 1);
  EXPECT_EQ(plan.admit[1].slot, 2);
  EXPECT_EQ(plan.admit[2].slot, 4);
  // The prefill budget stops admission at the first request that does not fit; none is skipped.
  plan = plan_step(slots, waiting, 35);
  ASSERT_EQ(plan.admit.size(), 2u);
  // A prompt over the budget still runs, alone, when it is first.
  plan = plan_step(slots, std::vector<std::int64_t>{50, 1}, 35);
  ASSERT_EQ(plan.admit.size(), 1u);
  EXPECT_EQ(plan.admit[0].waiting, 0u);
  // Nothing free, nothing admitted; nothing waiting, only retirements.
  plan = plan_step(std::vector<P>{P::running, P::running}, waiting, 1000);
  EXPECT_TRUE(plan.admit.empty() && plan.retire.empty());
  plan = plan_step(std::vector<P>{P::finished, P::finished}, {}, 1000);
  EXPECT_EQ(plan.retire, (std::vector<std::int64_t>{0, 1}));
  EXPECT_TRUE(plan.admit.empty());
}

// Every bad input is refused by name, before any work, leaving what is queued or generated intact.
TEST_F(EngineTest, BadInputIsRefusedByName) {
  const Config c = small_config(false);
  model::ParamStore& s = store(c, DType::f32);
  const model::ModelOptions mo{.dtype = DType::f32, .cpu_threads = 1};
  const auto refused = [](const auto& call, const std::string& argument) {
    try {
      call();
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
      return;
    }
    ADD_FAILURE() << "not refused: " << argument;
  };
  refused([&] { Engine(c, mo, s.params(), {.max_batch = 0}); }, "max_batch");
  refused([&] { Engine(c, mo, s.params(), {.max_length = 0}); }, "max_length");
  refused([&] { Engine(c, mo, s.params(), {.max_prefill_tokens = 0}); }, "max_prefill_tokens");
  const std::int64_t bytes = model::InferenceState::bytes(c, mo, 4, 64);
  refused([&] { Engine(c, mo, s.params(), {.max_batch = 4, .max_length = 64, .cache_budget = bytes - 1}); },
          "max_batch");
  Engine ok(c, mo, s.params(), {.max_batch = 4, .max_length = 64, .cache_budget = bytes});

  Engine e(c, mo, s.params(), {.max_batch = 2, .max_length = 16});
  const Request good = request(1, {1, 2, 3}, 5);
  e.submit(good);
  e.step();  // good is running: one token generated
  const auto bad = [&](auto change, const std::string& argument) {
    Request r = good;
    r.id = 2;
    change(r);
    refused([&] { e.submit(r); }, argument);
    refused([&] { e.generate(std::vector<Request>{request(3, {1}), r}); }, argument);
  };
  bad([](Request& r) { r.prompt = {}; }, "request 2: prompt");
  bad([&](Request& r) { r.prompt = {1, static_cast<std::int32_t>(c.vocab_size)}; }, "request 2: prompt");
  bad([](Request& r) { r.prompt = {-1}; }, "request 2: prompt");
  bad([](Request& r) { r.prompt = std::vector<std::int32_t>(17, 1); }, "request 2: prompt");  // longer than the cache
  bad([](Request& r) { r.prompt = std::vector<std::int32_t>(13, 1); }, "request 2: prompt");  // 13 + 5 - 1 > 16
  bad([](Request& r) { r.max_new_tokens = 0; }, "request 2: max_new_tokens");
  bad([](Request& r) { r.stop_tokens = {99}; }, "request 2: stop_tokens");
  bad([](Request& r) { r.sampling.temperature = -0.5; }, "request 2: sampling.temperature");
  bad([](Request& r) { r.sampling.temperature = NAN; }, "request 2: sampling.temperature");
  bad([](Request& r) { r.sampling.top_p = 0; }, "request 2: sampling.top_p");
  bad([](Request& r) { r.sampling.top_p = 1.5; }, "request 2: sampling.top_p");
  bad([](Request& r) { r.sampling.top_k = -1; }, "request 2: sampling.top_k");
  bad([](Request& r) { r.id = 1; }, "request 1: id");  // already running
  refused([&] { e.generate(std::vector<Request>{request(5, {1}), request(5, {2})}); },
          "request 5: id");
  // The running request was untouched by every refusal: it finishes with all its tokens.
  while (!e.idle()) e.step();
  const auto done = e.take_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].id, 1u);
  EXPECT_EQ(done[0].tokens.size(), 5u);
}

// The model's inference entry points refuse what the engine never sends.
TEST_F(EngineTest, ModelInferenceRefusesBadSlotsAndTokens) {
  const Config c = small_config(false);
  model::ParamStore& s = store(c, DType::f32);
  const model::ModelOptions mo{.dtype = DType::f32, .cpu_threads = 1};
  model::Model m(c, mo);
  m.bind(s.params());
  model::InferenceState state(c, mo, 2, 8);
  std::vector<double> logits(2 * c.vocab_size);
  const std::vector<std::int32_t> tokens{1, 2, 3}, cu{0, 2, 3};
  const auto argument_of = [](const auto& call) {
    try {
      call();
    } catch (const InvalidArgument& e) {
      return e.argument();
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(argument_of([&] { m.prefill({tokens, cu}, std::vector<std::int32_t>{0, 0}, state, logits); }), "slots");
  EXPECT_EQ(argument_of([&] { m.prefill({tokens, cu}, std::vector<std::int32_t>{0, 2}, state, logits); }), "slots");
  EXPECT_EQ(argument_of([&] { m.prefill({tokens, cu}, std::vector<std::int32_t>{0}, state, logits); }), "slots");
  const std::vector<std::int32_t> long_prompt(9, 1), long_cu{0, 9};
  EXPECT_EQ(argument_of([&] {
              m.prefill({long_prompt, long_cu}, std::vector<std::int32_t>{0}, state,
                        std::span(logits).first(c.vocab_size));
            }),
            "prompts");
  EXPECT_EQ(argument_of([&] { m.decode(std::vector<std::int32_t>{1}, std::vector<std::int32_t>{0}, state,
                                       std::span(logits).first(c.vocab_size)); }),
            "slots");  // an empty slot
  m.prefill({tokens, cu}, std::vector<std::int32_t>{1, 0}, state, logits);
  EXPECT_EQ(state.length(1), 2);
  EXPECT_EQ(state.length(0), 1);
  EXPECT_EQ(argument_of([&] { m.decode(std::vector<std::int32_t>{-1}, std::vector<std::int32_t>{0}, state,
                                       std::span(logits).first(c.vocab_size)); }),
            "tokens");
  EXPECT_EQ(argument_of([&] { m.decode(std::vector<std::int32_t>{1}, std::vector<std::int32_t>{0}, state, logits); }),
            "logits");
  model::InferenceState other(c, {.dtype = DType::f64}, 2, 8);
  EXPECT_EQ(argument_of([&] { m.decode(std::vector<std::int32_t>{1}, std::vector<std::int32_t>{0}, other,
                                       std::span(logits).first(c.vocab_size)); }),
            "state");
}

}  // namespace
}  // namespace deltatrain::rollout
