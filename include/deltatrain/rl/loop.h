// Colocated RL: one process per device alternates rollout and training on the same memory.
//
//   auto group = comm::make_mpi_group(MPI_COMM_WORLD);
//   rl::RlOptions options{.config = model::preset("tiny"), .task = "arithmetic", .warmup_steps = 200, ...};
//   rl::RlResult result = rl::run_rl(*group, options, &observer, stop_requested);
//
// A step of the loop:
//   1. switch to rollout: park the trainer's memory (gradients: dropped; optimizer state: copied to pinned host
//      memory) and release the communicator; the rollout's caches come back;
//   2. rollout: samples_per_prompt completions of each of this rank's prompts, from the current parameters read
//      in place (the rollout engine binds the optimizer's parameter buffers: no copy, no refresh to do), with
//      each token's log-probability; rewards; group-normalised advantages;
//   3. switch to train: park the rollout's caches, bring the trainer's memory back, reload the communicator;
//   4. train: one forward over prompts + completions whose loss is GRPO's (grpo.h), with the trainer's
//      log-probabilities of the same forward as the old policy's (one update per rollout: the forward is
//      deterministic, so ratio = 1 and its gradient is the policy gradient), backward, the ZeRO-1 AdamW step.
// Which memory each phase holds is decided in one place, memory_tags() and plan_switch().
//
// Before RL, `warmup_steps` supervised steps on the task's demonstrations (prompt + answer) give a small model
// a non-zero reward. Checkpoints are the trainer's step directories (train/step_directory.h) with rl.json;
// every random draw (problems, samples) is a pure function of the seed and the step, so a resume is bitwise.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "deltatrain/comm/group.h"
#include "deltatrain/memsaver/saver.h"
#include "deltatrain/model/config.h"
#include "deltatrain/optim/digest.h"
#include "deltatrain/rl/grpo.h"

namespace deltatrain::rl {

// --- Memory: which tag holds what, and in which phase ------------------------------------------------------

enum class Phase : std::uint8_t { rollout, train };
const char* phase_name(Phase phase);  // "rollout", "train"

struct MemoryTag {
  const char* tag;
  memsaver::Backup backup;
  bool in_rollout, in_train;  // the phases that keep it mapped
  const char* holds;
};
// weights (both phases: the rollout reads them in place), grads and activations (train; dropped when parked),
// optimizer (train; copied out and back), rollout (the rollout's caches and activations; dropped when parked).
std::span<const MemoryTag> memory_tags();

// What entering `to` does, given the saver's tags now: pause every active tag that `to` does not keep, then
// resume every paused tag it keeps (in that order, so the memory is free before the other phase maps its own).
// Tags with no allocation yet are absent from `now` and left alone. InvalidArgument for a tag of `now` that
// memory_tags() does not know.
struct PhaseSwitch {
  std::vector<std::string> pause, resume;
};
PhaseSwitch plan_switch(Phase to, const std::vector<memsaver::TagStats>& now);

// --- Options and reports -----------------------------------------------------------------------------------

struct RlOptions {
  model::Config config;
  std::filesystem::path init;           // an HF model directory to start from; empty: the seeded initial weights
  std::string task = "arithmetic";
  std::int64_t prompts_per_step = 16;   // global, a multiple of the ranks
  std::int64_t samples_per_prompt = 8;  // G, the group of each prompt
  std::int64_t max_new_tokens = 0;      // 0: the task's longest answer + 1 (its end token)
  std::int64_t steps = 50;              // RL steps (after the warm-up): rollouts
  // Optimizer steps on each rollout: its samples split into this many mini-batches of whole prompt groups, one
  // step each (PPO's minibatches). From the second on the policy has moved from the one that sampled, so every
  // token's ratio is taken to the old log-probabilities, the trainer's at the rollout's parameters, computed
  // before the first update, and clipping engages. A divisor of the prompts per rank.
  std::int64_t updates_per_rollout = 1;
  double lr = 2e-4;
  double weight_decay = 0.0;
  double max_grad_norm = 1.0;           // 0: no clipping
  double beta1 = 0.9, beta2 = 0.99, eps = 1e-8;
  GrpoOptions grpo;
  double temperature = 1.0;             // of the rollout's sampling (1: the policy the trainer computes)
  // Rollout and trainer in the model's batch-invariant mode (ModelOptions::batch_invariant): the rollout's
  // log-probabilities are the trainer's bit for bit, so the mismatch is exactly 0. CPU only; temperature 1.
  bool true_on_policy = false;
  std::int64_t warmup_steps = 0;        // supervised steps on demonstrations before RL
  std::int64_t warmup_batch = 64;       // problems per warm-up step, global, a multiple of the ranks
  double warmup_lr = 3e-3;
  std::int64_t eval_every = 0;          // RL steps between evaluations on the held-out set (0: only at the end)
  std::int64_t eval_prompts = 128;      // held-out problems, a multiple of the ranks
  std::uint64_t seed = 1234;
  std::filesystem::path checkpoint_root;  // empty: no checkpoints
  std::int64_t save_every = 0;          // optimizer steps between saves (0: at the end only)
  std::filesystem::path resume;         // a step directory or a root with `latest`; empty: fresh start
  int cpu_threads = 0;
  // The memory saver's backend: "host" (the CPU's pages), "cuda" (VMM on the GPU), "off" (nothing is parked),
  // or "auto" (host or cuda, by the group's device).
  std::string memory = "auto";
  // Release the communicator during the rollout (NCCL gives back a few hundred MiB; its teardown takes about
  // half a second on an H200, NOTES "Release and rebuild"), or keep it.
  bool release_communicator = true;
};

// InvalidArgument naming the flag for values out of range.
void check_options(const RlOptions& options, int dp_size);

// RL steps (rollouts) done when the optimizer has taken `optimizer_step` steps (the warm-up's included).
inline std::int64_t rl_steps_done(const RlOptions& options, std::int64_t optimizer_step) {
  return (optimizer_step - options.warmup_steps) / options.updates_per_rollout;
}

struct StartReport {
  std::int64_t step = 0;  // optimizer steps done (warm-up included)
  std::filesystem::path resumed_from;
  std::int64_t parameters = 0;
  int dp_size = 1;
  std::string memory_backend;
};

// Bytes mapped under each tag, and in total, while a phase runs (the saver's bookkeeping), and what the
// backend measures in use (host pages: resident bytes of the saver's ranges; CUDA: the device's used bytes).
struct MemoryUse {
  std::map<std::string, std::uint64_t> by_tag;
  std::uint64_t mapped = 0;
  std::uint64_t measured = 0;
};

struct StepReport {
  std::int64_t step = 0;  // the optimizer's step after this one
  bool warmup = false;    // a supervised warm-up step (the rollout fields are 0)
  std::int64_t updates = 1;  // optimizer steps it took (RL: updates_per_rollout)
  double loss = 0, grad_norm = 0, lr = 0;  // RL: the mean over its updates
  // Rollout
  double reward_mean = 0, reward_std = 0;
  double response_length = 0;  // mean tokens per completion, the end token included
  std::int64_t rollout_tokens = 0, train_tokens = 0;  // generated; trained on (global)
  // The trainer's log-probabilities of the sampled tokens at the rollout's parameters against the rollout's
  // (over every response token): mean and max |difference|, and k3 of KL(rollout || trainer). The clip fraction
  // and the TIS and KL means are over every response token of every update.
  double mismatch_mean = 0, mismatch_max = 0, mismatch_kl = 0;
  double clip_fraction = 0, tis_mean = 1, kl = 0;
  // Seconds: each phase, each switch (park + bring back + communicator), the communicator's share of the two
  // switches (release + reload), and the weights' refresh for the rollout (0: it reads the trainer's buffers
  // in place; there is nothing to copy).
  double rollout_s = 0, train_s = 0, to_train_s = 0, to_rollout_s = 0, communicator_s = 0, weight_refresh_s = 0;
  MemoryUse rollout_memory, train_memory;
  double elapsed = 0;
};

struct EvalReport {
  std::int64_t step = 0;
  double accuracy = 0;      // problems solved exactly, greedy decoding
  double reward_mean = 0;
  std::int64_t problems = 0;
  struct Example {
    std::string prompt, completion;
    double reward = 0;
  };
  std::vector<Example> examples;  // the first few problems (of rank 0's share)
};

class Observer {
 public:
  virtual ~Observer() = default;
  virtual void on_start(const StartReport&) {}
  virtual void on_step(const StepReport&) {}
  virtual void on_eval(const EvalReport&) {}
  virtual void on_save(std::int64_t step, const std::filesystem::path& dir) {}
};

struct RlResult {
  std::int64_t step = 0;
  bool stopped = false;
  std::filesystem::path last_checkpoint;
  optim::StateDigest digest;  // of the final optimizer state
  std::optional<double> final_accuracy;  // the last evaluation's; none when stopped before any
};

// Collective: every rank calls it. `stop_requested` is polled between steps on every rank; a stop on any rank
// finishes the step, saves (with a checkpoint root) and returns with `stopped`.
RlResult run_rl(comm::Group& group, const RlOptions& options, Observer* observer = nullptr,
                const std::function<bool()>& stop_requested = {});

}  // namespace deltatrain::rl
