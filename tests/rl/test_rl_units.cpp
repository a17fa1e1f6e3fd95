// The RL loop's pure parts: the tasks (alphabet, rewards on hand-checked cases, held-out sets never drawn for
// training, determinism), GRPO's arithmetic against direct computations and finite differences, and the
// phase plan of which memory tag is parked when.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "deltatrain/core/error.h"
#include "deltatrain/rl/grpo.h"
#include "deltatrain/rl/loop.h"
#include "deltatrain/rl/tasks.h"

namespace deltatrain::rl {
namespace {

std::uint64_t fresh_seed() { return std::random_device{}(); }

TEST(Alphabet, RoundTripsAndRefusesOtherCharacters) {
  const std::string text = "12+34=46abc>cba";
  std::vector<std::int32_t> tokens = Alphabet::encode(text);
  for (const std::int32_t t : tokens) {
    EXPECT_GT(t, Alphabet::kEnd);
    EXPECT_LT(t, Alphabet::size());
  }
  EXPECT_EQ(Alphabet::decode(tokens), text);
  tokens.insert(tokens.begin() + 3, Alphabet::kEnd);
  EXPECT_EQ(Alphabet::decode(tokens), "12+") << "decoding stops at the end token";
  try {
    Alphabet::encode("1 2", "prompt");
    ADD_FAILURE() << "a space is not in the alphabet";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "prompt");
  }
}

TEST(Tasks, UnknownNameIsRefusedListingTheTasks) {
  try {
    make_task("countup");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "task");
    EXPECT_NE(std::string(e.what()).find("arithmetic"), std::string::npos) << e.what();
  }
}

TEST(Tasks, ArithmeticRewardsOnlyTheExactSum) {
  const auto task = make_task("arithmetic");
  const Problem p{"37+58=", "95"};
  EXPECT_EQ(task->reward(p, "95"), 1.0);
  EXPECT_EQ(task->reward(p, "96"), 0.0);
  EXPECT_EQ(task->reward(p, "095"), 0.0);
  EXPECT_EQ(task->reward(p, "9"), 0.0);
  EXPECT_EQ(task->reward(p, ""), 0.0);
  // Every training problem is a true sum in the task's format.
  const std::uint64_t seed = fresh_seed();
  for (std::uint64_t i = 0; i < 200; ++i) {
    const Problem q = task->train_problem(seed, i);
    const std::size_t plus = q.prompt.find('+');
    ASSERT_NE(plus, std::string::npos);
    ASSERT_EQ(q.prompt.back(), '=');
    const int a = std::stoi(q.prompt.substr(0, plus)), b = std::stoi(q.prompt.substr(plus + 1));
    EXPECT_EQ(q.answer, std::to_string(a + b));
    EXPECT_LE(static_cast<std::int64_t>(q.prompt.size()), task->max_prompt_length());
    EXPECT_LE(static_cast<std::int64_t>(q.answer.size()), task->max_answer_length());
  }
}

TEST(Tasks, ReverseRewardIsTheCommonSubsequenceRatio) {
  EXPECT_EQ(longest_common_subsequence("abcde", "ace"), 3);
  EXPECT_EQ(longest_common_subsequence("", "abc"), 0);
  EXPECT_EQ(longest_common_subsequence("abc", "cba"), 1);
  const auto task = make_task("reverse");
  const Problem p{"abcde>", "edcba"};
  EXPECT_EQ(task->reward(p, "edcba"), 1.0);
  EXPECT_DOUBLE_EQ(task->reward(p, "edcab"), 4.0 / 5.0);
  EXPECT_DOUBLE_EQ(task->reward(p, "edcbaxyz"), 5.0 / 8.0);
  EXPECT_EQ(task->reward(p, ""), 0.0);
  const std::uint64_t seed = fresh_seed();
  for (std::uint64_t i = 0; i < 100; ++i) {
    const Problem q = task->train_problem(seed, i);
    const std::string word = q.prompt.substr(0, q.prompt.size() - 1);
    EXPECT_EQ(q.answer, std::string(word.rbegin(), word.rend()));
  }
}

// The training stream never draws a held-out problem, is a pure function of (seed, index), and differs
// between seeds; the held-out set is fixed and has no repeats.
TEST(Tasks, TrainingStreamsAvoidTheHeldOutSet) {
  for (const std::string& name : task_names()) {
    const auto task = make_task(name);
    const std::int64_t eval_count = name == "arithmetic" ? 1000 : 2000;
    std::set<std::string> held_out;
    for (const Problem& p : task->eval_problems(eval_count)) held_out.insert(p.prompt);
    EXPECT_EQ(static_cast<std::int64_t>(held_out.size()), eval_count) << name;
    const std::vector<Problem> first = task->eval_problems(10);
    const std::vector<Problem> again = task->eval_problems(10);
    for (std::size_t i = 0; i < first.size(); ++i) EXPECT_EQ(first[i].prompt, again[i].prompt);
    const std::uint64_t seed = fresh_seed();
    std::size_t differing = 0;
    for (std::uint64_t i = 0; i < 3000; ++i) {
      const Problem p = task->train_problem(seed, i);
      EXPECT_EQ(held_out.count(p.prompt), 0u) << name << " drew held-out " << p.prompt;
      EXPECT_EQ(task->train_problem(seed, i).prompt, p.prompt);
      differing += task->train_problem(seed + 1, i).prompt != p.prompt ? 1 : 0;
    }
    EXPECT_GT(differing, 2500u) << name;
  }
  EXPECT_THROW(make_task("arithmetic")->eval_problems(100000), InvalidArgument);
}

TEST(Grpo, AdvantagesAreGroupNormalised) {
  std::mt19937_64 rng(fresh_seed());
  std::uniform_real_distribution<double> reward(0, 1);
  const std::int64_t groups = 5, G = 6;
  std::vector<double> rewards(groups * G);
  for (double& r : rewards) r = reward(rng);
  std::fill(rewards.begin() + G, rewards.begin() + 2 * G, 0.5);  // one group with equal rewards
  const std::vector<double> advantages = group_advantages(rewards, G);
  for (std::int64_t g = 0; g < groups; ++g) {
    // In long double, a different summation: agreement to double rounding (relative to the spread).
    long double mean = 0, squares = 0;
    for (std::int64_t i = G - 1; i >= 0; --i) mean += rewards[g * G + i];
    mean /= G;
    for (std::int64_t i = 0; i < G; ++i) squares += (rewards[g * G + i] - mean) * (rewards[g * G + i] - mean);
    const long double spread = std::sqrt(squares / G) + 1e-6L;
    for (std::int64_t i = 0; i < G; ++i) {
      EXPECT_NEAR(advantages[g * G + i], static_cast<double>((rewards[g * G + i] - mean) / spread), 1e-9);
    }
  }
  for (std::int64_t i = G; i < 2 * G; ++i) EXPECT_EQ(advantages[i], 0.0) << "equal rewards: no signal";
  EXPECT_THROW(group_advantages(rewards, 7), InvalidArgument);
  EXPECT_THROW(group_advantages(rewards, 0), InvalidArgument);
}

// The loss against PPO's formula written out directly, and its derivative against central differences, on
// random inputs that land in both the clipped and unclipped regions of either sign of advantage.
TEST(Grpo, TokenLossMatchesItsDefinitionAndDerivative) {
  std::mt19937_64 rng(fresh_seed());
  std::uniform_real_distribution<double> u(-1, 1);
  int clipped = 0, unclipped = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const GrpoOptions o{.clip_low = 0.2, .clip_high = 0.28, .kl_coef = trial % 2 ? 0.05 : 0.0, .tis = trial % 3 == 0};
    TokenInputs in;
    in.old_logprob = -1 + u(rng);
    in.logprob = in.old_logprob + 0.5 * u(rng);
    in.rollout_logprob = in.old_logprob + 0.3 * u(rng);
    in.ref_logprob = in.old_logprob + 0.3 * u(rng);
    in.advantage = 2 * u(rng);
    in.weight = 0.1 + std::abs(u(rng));
    auto direct = [&](double logprob) {
      const double ratio = std::exp(logprob - in.old_logprob);
      const double lo = -in.advantage * ratio;
      const double hi = -in.advantage * std::min(std::max(ratio, 1 - o.clip_low), 1 + o.clip_high);
      const double tis = o.tis ? std::min(std::exp(in.old_logprob - in.rollout_logprob), o.tis_cap) : 1.0;
      const double d = in.ref_logprob - logprob;
      const double kl = o.kl_coef > 0 ? std::exp(d) - d - 1 : 0.0;
      return in.weight * (tis * std::max(lo, hi) + o.kl_coef * kl);
    };
    const TokenLoss loss = grpo_token_loss(o, in);
    EXPECT_NEAR(loss.term, direct(in.logprob), 1e-13);
    const double ratio = std::exp(in.logprob - in.old_logprob);
    if (std::abs(ratio - (1 - o.clip_low)) < 1e-4 || std::abs(ratio - (1 + o.clip_high)) < 1e-4) continue;  // a kink
    const double h = 1e-6;
    const double numeric = (direct(in.logprob + h) - direct(in.logprob - h)) / (2 * h);
    EXPECT_NEAR(loss.derivative, numeric, 1e-7 * (1 + std::abs(numeric)));
    (loss.clipped ? clipped : unclipped) += 1;
    if (o.kl_coef > 0) EXPECT_GE(loss.kl, 0.0);
  }
  EXPECT_GT(clipped, 100);
  EXPECT_GT(unclipped, 100);
}

TEST(Grpo, OptionsOutOfRangeNameTheFlag) {
  auto expect = [](GrpoOptions o, const std::string& flag) {
    try {
      check_options(o);
      ADD_FAILURE() << flag;
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), flag);
    }
  };
  expect({.clip_low = 1.0}, "clip");
  expect({.clip_low = -0.1}, "clip");
  expect({.clip_high = -1}, "clip-high");
  expect({.kl_coef = std::nan("")}, "kl-coef");
}

memsaver::TagStats tag(const std::string& name, memsaver::TagState state) {
  memsaver::TagStats s;
  s.tag = name;
  s.state = state;
  return s;
}

TEST(PhasePlan, ParksWhatThePhaseDoesNotUseAndBringsBackWhatItDoes) {
  using memsaver::TagState;
  const std::vector<memsaver::TagStats> all_active = {
      tag("activations", TagState::Active), tag("grads", TagState::Active), tag("optimizer", TagState::Active),
      tag("rollout", TagState::Active), tag("weights", TagState::Active)};
  PhaseSwitch to_rollout = plan_switch(Phase::rollout, all_active);
  EXPECT_EQ(to_rollout.pause, (std::vector<std::string>{"activations", "grads", "optimizer"}));
  EXPECT_TRUE(to_rollout.resume.empty());
  const std::vector<memsaver::TagStats> in_rollout = {
      tag("activations", TagState::Paused), tag("grads", TagState::Paused), tag("optimizer", TagState::Paused),
      tag("rollout", TagState::Active), tag("weights", TagState::Active)};
  PhaseSwitch to_train = plan_switch(Phase::train, in_rollout);
  EXPECT_EQ(to_train.pause, (std::vector<std::string>{"rollout"}));
  EXPECT_EQ(to_train.resume, (std::vector<std::string>{"activations", "grads", "optimizer"}));
  EXPECT_TRUE(plan_switch(Phase::rollout, in_rollout).pause.empty());
  EXPECT_TRUE(plan_switch(Phase::rollout, in_rollout).resume.empty());
  // The weights are in both phases; no plan ever parks them.
  for (const MemoryTag& t : memory_tags()) {
    if (std::string(t.tag) == "weights") EXPECT_TRUE(t.in_rollout && t.in_train);
  }
  EXPECT_THROW(plan_switch(Phase::train, {tag("kv", TagState::Active)}), InvalidArgument);
}

}  // namespace
}  // namespace deltatrain::rl
