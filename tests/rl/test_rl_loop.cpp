// The colocated RL loop under mpirun (2 ranks) on a micro model: which memory each phase holds (the memory
// saver's host backend), the rollout reading the trainer's updated parameters in place (the train/rollout
// mismatch stays at float32 rounding while the parameters move), bitwise resume across the loop (the rollout's
// draws included), and the errors of bad options and of a checkpoint from another config.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <string>
#include <vector>

#include "deltatrain/comm/mpi_group.h"
#include "deltatrain/core/error.h"
#include "deltatrain/rl/loop.h"
#include "model_testing.h"
#include "test_support.h"

namespace deltatrain::rl {
namespace {

namespace fs = std::filesystem;
using testing_support::SharedTempDir;

// The model tests' small hybrid, with room for the task alphabet's 40 tokens.
model::Config micro_config() {
  model::Config c = model::testing::small_hybrid_config(true);
  c.vocab_size = 48;
  return c;
}

RlOptions micro_options(std::uint64_t seed) {
  RlOptions o;
  o.config = micro_config();
  o.task = "reverse";  // partial rewards: groups of an untrained model still differ, so there is a gradient
  o.prompts_per_step = 4;
  o.samples_per_prompt = 4;
  o.steps = 3;
  o.warmup_steps = 2;
  o.warmup_batch = 8;
  o.warmup_lr = 1e-2;
  o.lr = 1e-2;  // large: the parameters move visibly between rollouts
  o.eval_prompts = 8;
  o.seed = seed;
  o.cpu_threads = 1;
  return o;
}

struct Recorder : Observer {
  std::vector<StepReport> steps;
  std::vector<EvalReport> evals;
  void on_step(const StepReport& r) override { steps.push_back(r); }
  void on_eval(const EvalReport& r) override { evals.push_back(r); }
};

class Rl : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing_support::shared_seed();
    group_ = comm::make_mpi_group(MPI_COMM_WORLD);
  }
  std::uint64_t seed_ = 0;
  std::unique_ptr<comm::Group> group_;
};

std::uint64_t tag_bytes(const MemoryUse& use, const std::string& tag) {
  const auto found = use.by_tag.find(tag);
  return found == use.by_tag.end() ? 0 : found->second;
}

// A resumed run against the same run straight through: the same final state bit for bit, and each resumed step
// (the straight run's last ones) with the same rollouts, losses and KL.
void expect_resumed_equals_straight(const RlResult& whole, const Recorder& straight, const RlResult& resumed,
                                    const Recorder& second) {
  EXPECT_EQ(resumed.digest.params, whole.digest.params);
  EXPECT_EQ(resumed.digest.state, whole.digest.state);
  ASSERT_EQ(second.steps.size(), 2u);
  for (std::size_t i = 0; i < second.steps.size(); ++i) {
    const StepReport& a = straight.steps[straight.steps.size() - 2 + i];
    const StepReport& b = second.steps[i];
    EXPECT_EQ(a.step, b.step);
    EXPECT_EQ(a.reward_mean, b.reward_mean);
    EXPECT_EQ(a.rollout_tokens, b.rollout_tokens);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.kl, b.kl);
  }
}

TEST_F(Rl, EachPhaseHoldsOnlyItsMemoryAndTheRolloutSeesEveryUpdate) {
  Recorder recorder;
  const RlOptions options = micro_options(seed_);
  const RlResult result = run_rl(*group_, options, &recorder);
  EXPECT_EQ(result.step, options.warmup_steps + options.steps);
  ASSERT_EQ(recorder.steps.size(), static_cast<std::size_t>(options.warmup_steps + options.steps));
  for (const StepReport& r : recorder.steps) {
    if (r.warmup) {
      EXPECT_EQ(tag_bytes(r.train_memory, "rollout"), 0u) << "warm-up step " << r.step;
      continue;
    }
    SCOPED_TRACE("step " + std::to_string(r.step));
    // Rollout phase: the trainer's gradients, optimizer state and activations are unmapped.
    EXPECT_EQ(tag_bytes(r.rollout_memory, "grads"), 0u);
    EXPECT_EQ(tag_bytes(r.rollout_memory, "optimizer"), 0u);
    EXPECT_EQ(tag_bytes(r.rollout_memory, "activations"), 0u);
    EXPECT_GT(tag_bytes(r.rollout_memory, "rollout"), 0u);
    EXPECT_GT(tag_bytes(r.rollout_memory, "weights"), 0u);
    // Train phase: the rollout's caches are unmapped, the trainer's memory is back.
    EXPECT_EQ(tag_bytes(r.train_memory, "rollout"), 0u);
    EXPECT_GT(tag_bytes(r.train_memory, "grads"), 0u);
    EXPECT_GT(tag_bytes(r.train_memory, "optimizer"), 0u);
    EXPECT_GT(tag_bytes(r.train_memory, "activations"), 0u);
    EXPECT_EQ(tag_bytes(r.rollout_memory, "weights"), tag_bytes(r.train_memory, "weights"));
    // What the host backend measures resident is no more than what the phase keeps mapped: the parked
    // tags' pages really went back to the system.
    EXPECT_LE(r.rollout_memory.measured, r.rollout_memory.mapped);
    EXPECT_LE(r.train_memory.measured, r.train_memory.mapped);
    // The rollout's log-probabilities are the trainer's to float32 rounding at every step, although each step
    // moves the parameters (a rollout on stale weights would differ by far more).
    EXPECT_GT(r.grad_norm, 0);
    EXPECT_LT(r.mismatch_max, 1e-4);
    EXPECT_GT(r.rollout_tokens, 0);
    EXPECT_EQ(r.weight_refresh_s, 0.0);
    EXPECT_GE(r.reward_mean, 0.0);
    EXPECT_LE(r.reward_mean, 1.0);
    EXPECT_TRUE(std::isfinite(r.loss));
  }
  ASSERT_FALSE(recorder.evals.empty());
  EXPECT_EQ(recorder.evals.back().problems, options.eval_prompts);
}

// A run stopped before its first evaluation reports no accuracy rather than 0.
TEST_F(Rl, AStopBeforeAnyEvaluationMeasuresNoAccuracy) {
  const RlResult result = run_rl(*group_, micro_options(seed_), nullptr, [] { return true; });
  EXPECT_TRUE(result.stopped);
  EXPECT_FALSE(result.final_accuracy.has_value()) << *result.final_accuracy;
}

// Straight through, against stopped after the first RL step and resumed from its checkpoint: the same final
// state bit for bit, and the same rollouts (rewards, lengths) in the resumed steps. With the KL penalty (its
// reference policy travels in the checkpoint) and TIS on.
TEST_F(Rl, ResumeIsBitwiseAcrossTheLoop) {
  SharedTempDir dir;
  RlOptions options = micro_options(seed_);
  options.grpo.kl_coef = 0.05;
  options.grpo.tis = true;
  Recorder straight;
  const RlResult whole = run_rl(*group_, options, &straight);

  options.checkpoint_root = dir.path() / "ckpt";
  options.steps = 1;
  Recorder first;
  const RlResult part = run_rl(*group_, options, &first);
  ASSERT_FALSE(part.last_checkpoint.empty());
  options.steps = 3;
  options.resume = options.checkpoint_root;
  Recorder second;
  const RlResult resumed = run_rl(*group_, options, &second);
  expect_resumed_equals_straight(whole, straight, resumed, second);
  EXPECT_GT(straight.steps.back().kl, 0.0) << "the policy moved away from its reference";
  // --steps counts RL steps after the warm-up: a resume whose run ends before the checkpoint's step is refused by
  // name, as the trainer's is, rather than taking no step and reporting the checkpoint as done.
  options.steps = 2;  // to optimizer step 2 + 2, and `latest` is at 2 + 3
  try {
    run_rl(*group_, options);
    ADD_FAILURE() << "a resume past the run's last step was not refused";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "steps") << e.what();
  }
  options.steps = 3;

  // A save killed after its rename and before `latest` moved leaves a step directory beyond `latest`: a run
  // resumed from `latest` replaces it when it saves that step, and stops at nothing.
  RlOptions again = options;
  again.checkpoint_root = dir.path() / "killed";
  again.resume.clear();
  again.steps = 1;
  run_rl(*group_, again);  // step-00000003, and `latest` names it
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const fs::path leftover = again.checkpoint_root / "step-00000004";
  if (rank == 0) fs::create_directories(leftover / "model");  // half a checkpoint, as a kill could leave it
  MPI_Barrier(MPI_COMM_WORLD);
  again.resume = again.checkpoint_root;
  again.steps = 2;
  again.save_every = 1;
  const RlResult replaced = run_rl(*group_, again);
  EXPECT_EQ(replaced.step, 4);
  EXPECT_TRUE(fs::exists(leftover / "rl.json")) << "the leftover was replaced by a whole checkpoint";
  // Saving a step that `latest` already names is refused: nothing is overwritten.
  again.resume = again.checkpoint_root / "step-00000003";
  try {
    run_rl(*group_, again);
    ADD_FAILURE() << "step 4 was saved over the checkpoint `latest` names";
  } catch (const Failure& e) {
    EXPECT_NE(std::string(e.what()).find("nothing is overwritten"), std::string::npos) << e.what();
  }

  // A checkpoint of another config is refused by name, and so is one of another task.
  RlOptions other = options;
  other.config.intermediate_size = 96;
  try {
    run_rl(*group_, other);
    ADD_FAILURE() << "another config resumed";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "resume") << e.what();
  }
  other = options;
  other.task = "arithmetic";
  EXPECT_THROW(run_rl(*group_, other), InvalidArgument);
}

// With --true-on-policy the rollout's log-probability of every sampled token is the trainer's, bit for bit, at
// every step (2 ranks, the parameters moving between rollouts).
TEST_F(Rl, TrueOnPolicyHasNoMismatchAtAll) {
  Recorder recorder;
  RlOptions options = micro_options(seed_);
  options.true_on_policy = true;
  options.grpo.tis = true;
  run_rl(*group_, options, &recorder);
  int rl_steps = 0;
  for (const StepReport& r : recorder.steps) {
    if (r.warmup) continue;
    ++rl_steps;
    EXPECT_EQ(r.mismatch_max, 0.0) << "step " << r.step;
    EXPECT_EQ(r.mismatch_kl, 0.0) << "step " << r.step;
    EXPECT_EQ(r.tis_mean, 1.0) << "step " << r.step;
    EXPECT_GT(r.grad_norm, 0.0);
  }
  EXPECT_EQ(rl_steps, options.steps);
}

// Two updates per rollout: the second runs on parameters the first moved, so its tokens' ratios to the rollout's
// policy leave 1 and clipping engages, where with one update every ratio is exactly 1. The mismatch is still
// taken at the rollout's parameters (float32 rounding), a report covers a rollout and its updates, checkpoints
// fall between rollouts, a resume continues bit for bit, and one with another update count is refused.
TEST_F(Rl, SeveralUpdatesPerRolloutTakeRatiosToTheRolloutPolicy) {
  RlOptions options = micro_options(seed_);
  // A clip range of 0.1%: any ratio an update moves is out of it (a token counts as clipped where its advantage
  // pushes the ratio further out), while a ratio of exactly 1 never is.
  options.grpo.clip_low = options.grpo.clip_high = 1e-3;
  Recorder single;
  run_rl(*group_, options, &single);
  for (const StepReport& r : single.steps) {
    if (!r.warmup) EXPECT_EQ(r.clip_fraction, 0.0) << "one update: the ratio is exactly 1 (step " << r.step << ")";
  }

  options.updates_per_rollout = 2;
  Recorder straight;
  const RlResult whole = run_rl(*group_, options, &straight);
  EXPECT_EQ(whole.step, options.warmup_steps + options.steps * 2);
  ASSERT_EQ(straight.steps.size(), static_cast<std::size_t>(options.warmup_steps + options.steps));
  double clipped = 0;
  for (const StepReport& r : straight.steps) {
    if (r.warmup) continue;
    SCOPED_TRACE("step " + std::to_string(r.step));
    EXPECT_EQ(r.updates, 2);
    EXPECT_EQ((r.step - options.warmup_steps) % 2, 0);
    EXPECT_LT(r.mismatch_max, 1e-4);
    EXPECT_GT(r.grad_norm, 0);
    EXPECT_TRUE(std::isfinite(r.loss));
    clipped += r.clip_fraction;
  }
  EXPECT_GT(clipped, 0.0) << "the second update's ratios never left the clip range: its old policy is not the rollout's";

  SharedTempDir dir;
  options.checkpoint_root = dir.path() / "ckpt";
  options.save_every = 3;  // crossed inside the first rollout's updates (steps 3 and 4): saved at step 4
  options.steps = 1;
  const RlResult part = run_rl(*group_, options, nullptr);
  EXPECT_EQ(part.last_checkpoint.filename(), "step-00000004");
  options.steps = 3;
  options.save_every = 0;
  options.resume = options.checkpoint_root;
  Recorder second;
  const RlResult resumed = run_rl(*group_, options, &second);
  expect_resumed_equals_straight(whole, straight, resumed, second);
  options.updates_per_rollout = 1;
  try {
    run_rl(*group_, options);
    ADD_FAILURE() << "resumed with another update count";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "resume") << e.what();
    EXPECT_NE(std::string(e.what()).find("updates-per-rollout"), std::string::npos) << e.what();
  }
}

TEST_F(Rl, BadOptionsNameTheFlag) {
  auto expect = [&](RlOptions o, const std::string& flag) {
    try {
      run_rl(*group_, o);
      ADD_FAILURE() << "no error for " << flag;
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), flag) << e.what();
    }
  };
  RlOptions o = micro_options(seed_);
  o.task = "sorting";
  expect(o, "task");
  o = micro_options(seed_);
  o.prompts_per_step = 3;  // not a multiple of 2 ranks
  expect(o, "prompts-per-step");
  o = micro_options(seed_);
  o.samples_per_prompt = 1;
  expect(o, "samples-per-prompt");
  o = micro_options(seed_);
  o.config.vocab_size = 16;
  expect(o, "config");
  o = micro_options(seed_);
  o.memory = "disk";
  expect(o, "memory");
  o = micro_options(seed_);
  o.updates_per_rollout = 0;
  expect(o, "updates-per-rollout");
  o = micro_options(seed_);
  o.updates_per_rollout = 3;  // 2 prompts per rank
  expect(o, "updates-per-rollout");
  o = micro_options(seed_);
  o.grpo.clip_low = 1.5;
  expect(o, "clip");
  o = micro_options(seed_);
  o.temperature = 0;
  expect(o, "temperature");
  o = micro_options(seed_);
  o.true_on_policy = true;
  o.temperature = 0.7;
  expect(o, "true-on-policy");
}

}  // namespace
}  // namespace deltatrain::rl
