// `deltatrain rl`: colocated GRPO on every rank that mpirun starts (one rank without mpirun): rollout and
// training take turns on the same memory. Rank 0 prints a line per step (reward, the train/rollout mismatch,
// each phase's time and each switch's), the held-out accuracy at each evaluation, writes the JSONL log and,
// at the end, the chart (reward and accuracy, and the phase timeline) when --log is given.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "run_support.h"
#include "deltatrain/core/error.h"
#include "deltatrain/model/config.h"
#include "deltatrain/rl/loop.h"
#include "deltatrain/rl/tasks.h"

namespace deltatrain::tools {
namespace {

namespace fs = std::filesystem;

struct RlArgs {
  std::string config;
  std::string init;
  std::string task = "arithmetic";
  std::int64_t prompts_per_step = 16;
  std::int64_t samples_per_prompt = 8;
  std::int64_t max_new_tokens = 0;
  std::int64_t steps = 50;
  std::int64_t updates_per_rollout = 1;
  double lr = 2e-4;
  double clip = 0.2, clip_high = 0.28, kl_coef = 0;
  bool tis = false;
  bool true_on_policy = false;
  double weight_decay = 0, max_grad_norm = 1.0;
  double temperature = 1.0;
  std::int64_t warmup_steps = 0, warmup_batch = 64;
  double warmup_lr = 3e-3;
  std::int64_t eval_every = 0, eval_prompts = 128;
  std::string ckpt;
  std::int64_t save_every = 0;
  std::string resume;
  std::string log, chart;
  std::uint64_t seed = 1234;
  int threads = 0;
  std::string memory = "auto";
  std::string device = "cpu";
  bool keep_communicator = false;
};

double mib(std::uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

nlohmann::ordered_json memory_json(const rl::MemoryUse& use) {
  nlohmann::ordered_json by_tag = nlohmann::ordered_json::object();
  for (const auto& [tag, bytes] : use.by_tag) by_tag[tag] = bytes;
  return {{"mapped", use.mapped}, {"measured", use.measured}, {"by_tag", by_tag}};
}

// Rank 0's view: the console and the JSONL log.
class Reporter : public rl::Observer {
 public:
  Reporter(const RlArgs& args, const rl::RlOptions& options)
      : args_(args), options_(options), log_(args.log, !args.resume.empty()) {}

  void on_start(const rl::StartReport& s) override {
    log_.start();
    std::printf("rl: task %s, %lld parameters on %d rank%s, memory saver %s; %s step %lld: %lld warm-up + %lld RL steps "
                "of %lld prompts x %lld samples\n",
                options_.task.c_str(), static_cast<long long>(s.parameters), s.dp_size, s.dp_size == 1 ? "" : "s",
                s.memory_backend.c_str(), s.resumed_from.empty() ? "starting at" : ("resumed from " + s.resumed_from.string() + " at").c_str(),
                static_cast<long long>(s.step), static_cast<long long>(options_.warmup_steps),
                static_cast<long long>(options_.steps), static_cast<long long>(options_.prompts_per_step),
                static_cast<long long>(options_.samples_per_prompt));
    std::fflush(stdout);
    write({{"kind", "start"}, {"step", s.step}, {"task", options_.task}, {"parameters", s.parameters},
           {"dp_size", s.dp_size}, {"memory_backend", s.memory_backend}, {"warmup_steps", options_.warmup_steps},
           {"steps", options_.steps}});
  }

  void on_step(const rl::StepReport& r) override {
    if (r.warmup) {
      // A line every 25 warm-up steps and the last: the warm-up is the prologue, RL the story.
      if (r.step % 25 == 0 || r.step == options_.warmup_steps) {
        std::printf("warm-up %lld/%lld  loss %.4f  gnorm %.3f  %.0f ms/step\n", static_cast<long long>(r.step),
                    static_cast<long long>(options_.warmup_steps), r.loss, r.grad_norm, 1e3 * r.train_s);
      }
      write({{"kind", "warmup"}, {"step", r.step}, {"loss", r.loss}, {"lr", r.lr}, {"grad_norm", r.grad_norm},
             {"tokens", r.train_tokens}, {"train_s", r.train_s}, {"elapsed", r.elapsed}});
    } else {
      const std::int64_t rl_step = rl::rl_steps_done(options_, r.step);
      const double done = static_cast<double>(rl_step);
      const double eta = rl_started_ >= 0 && done > rl_first_
                             ? (r.elapsed - rl_started_) / (done - rl_first_) * (static_cast<double>(options_.steps) - done)
                             : -1;
      if (rl_started_ < 0) {
        rl_started_ = r.elapsed - (r.rollout_s + r.train_s + r.to_train_s + r.to_rollout_s);
        rl_first_ = done - 1;
      }
      std::printf("step %lld/%lld  reward %.3f  len %.1f  mismatch %.1e (max %.1e)  clip %.3f  rollout %.2fs (%.0f tok/s)  "
                  "train %.2fs  switches %.1f/%.1f ms  eta %s\n",
                  static_cast<long long>(rl_step), static_cast<long long>(options_.steps), r.reward_mean,
                  r.response_length, r.mismatch_mean, r.mismatch_max, r.clip_fraction, r.rollout_s,
                  r.rollout_s > 0 ? r.rollout_tokens / r.rollout_s : 0.0, r.train_s, 1e3 * r.to_train_s,
                  1e3 * r.to_rollout_s, duration_text(eta).c_str());
      write({{"kind", "rl"},
             {"step", r.step},
             {"rl_step", rl_step},
             {"updates", r.updates},
             {"loss", r.loss},
             {"lr", r.lr},
             {"grad_norm", r.grad_norm},
             {"reward_mean", r.reward_mean},
             {"reward_std", r.reward_std},
             {"response_length", r.response_length},
             {"rollout_tokens", r.rollout_tokens},
             {"train_tokens", r.train_tokens},
             {"mismatch_mean", r.mismatch_mean},
             {"mismatch_max", r.mismatch_max},
             {"mismatch_kl", r.mismatch_kl},
             {"clip_fraction", r.clip_fraction},
             {"tis_mean", r.tis_mean},
             {"kl", r.kl},
             {"rollout_s", r.rollout_s},
             {"train_s", r.train_s},
             {"to_train_s", r.to_train_s},
             {"to_rollout_s", r.to_rollout_s},
             {"communicator_s", r.communicator_s},
             {"weight_refresh_s", r.weight_refresh_s},
             {"rollout_tokens_per_s", r.rollout_s > 0 ? r.rollout_tokens / r.rollout_s : 0.0},
             {"train_tokens_per_s", r.train_s > 0 ? r.train_tokens / r.train_s : 0.0},
             {"rollout_memory", memory_json(r.rollout_memory)},
             {"train_memory", memory_json(r.train_memory)},
             {"elapsed", r.elapsed}});
      if (!memory_shown_) {
        std::printf("memory held: rollout phase %.1f MiB mapped (trainer's grads/optimizer/activations %.1f MiB), "
                    "train phase %.1f MiB (rollout's %.1f MiB)\n",
                    mib(r.rollout_memory.mapped), mib(trainer_bytes(r.rollout_memory)), mib(r.train_memory.mapped),
                    mib(value(r.train_memory, "rollout")));
        memory_shown_ = true;
      }
    }
    std::fflush(stdout);
  }

  void on_eval(const rl::EvalReport& r) override {
    std::string examples;
    for (const rl::EvalReport::Example& e : r.examples) {
      examples += "  " + e.prompt + e.completion + (e.reward == 1.0 ? " (right)" : " (wrong)");
    }
    const std::int64_t rl_step = rl::rl_steps_done(options_, r.step);
    std::printf("eval after step %lld: accuracy %.3f  reward %.3f  (%lld held-out problems)%s\n",
                static_cast<long long>(rl_step), r.accuracy, r.reward_mean,
                static_cast<long long>(r.problems), examples.c_str());
    std::fflush(stdout);
    nlohmann::ordered_json shown = nlohmann::ordered_json::array();
    for (const rl::EvalReport::Example& e : r.examples) {
      shown.push_back({{"prompt", e.prompt}, {"completion", e.completion}, {"reward", e.reward}});
    }
    write({{"kind", "eval"}, {"step", r.step}, {"rl_step", rl_step}, {"accuracy", r.accuracy},
           {"reward_mean", r.reward_mean}, {"problems", r.problems}, {"examples", shown}});
  }

  void on_save(std::int64_t, const fs::path& dir) override {
    std::printf("saved %s\n", dir.string().c_str());
    std::fflush(stdout);
  }

 private:
  static std::uint64_t value(const rl::MemoryUse& use, const std::string& tag) {
    const auto found = use.by_tag.find(tag);
    return found == use.by_tag.end() ? 0 : found->second;
  }
  static std::uint64_t trainer_bytes(const rl::MemoryUse& use) {
    return value(use, "grads") + value(use, "optimizer") + value(use, "activations");
  }
  void write(const nlohmann::ordered_json& row) { log_.write(row); }

  const RlArgs& args_;
  const rl::RlOptions& options_;
  JsonlLog log_;
  double rl_started_ = -1, rl_first_ = 0;
  bool memory_shown_ = false;
};

rl::RlOptions make_options(const RlArgs& args) {
  rl::RlOptions o;
  o.config = load_config_flag(args.config);
  o.init = args.init;
  o.task = args.task;
  o.prompts_per_step = args.prompts_per_step;
  o.samples_per_prompt = args.samples_per_prompt;
  o.max_new_tokens = args.max_new_tokens;
  o.steps = args.steps;
  o.updates_per_rollout = args.updates_per_rollout;
  o.lr = args.lr;
  o.weight_decay = args.weight_decay;
  o.max_grad_norm = args.max_grad_norm;
  o.grpo = {.clip_low = args.clip, .clip_high = args.clip_high, .kl_coef = args.kl_coef, .tis = args.tis};
  o.temperature = args.temperature;
  o.true_on_policy = args.true_on_policy;
  o.warmup_steps = args.warmup_steps;
  o.warmup_batch = args.warmup_batch;
  o.warmup_lr = args.warmup_lr;
  o.eval_every = args.eval_every;
  o.eval_prompts = args.eval_prompts;
  o.seed = args.seed;
  o.checkpoint_root = args.ckpt;
  o.save_every = args.save_every;
  o.resume = resume_path(args.resume, args.ckpt);
  o.cpu_threads = args.threads == 0 ? default_threads() : args.threads;  // a negative count is refused by name
  o.memory = args.memory;
  o.release_communicator = !args.keep_communicator;
  return o;
}

void run_rl_command(const RlArgs& args) {
  run_collective_command(
      [&](int rank, int ranks) {
        const rl::RlOptions options = make_options(args);
        rl::check_options(options, ranks);
        const std::unique_ptr<comm::Group> group = make_group(args.device);
        std::unique_ptr<Reporter> reporter;  // on every rank's watch: a log rank 0 cannot open stops them all
        comm::collectively(*group, [&] {
          if (rank == 0) reporter = std::make_unique<Reporter>(args, options);
        });
        const rl::RlResult result = rl::run_rl(*group, options, reporter.get(), stop_requested);
        if (rank == 0) {
          char accuracy[64] = "no held-out accuracy (stopped before any evaluation)";
          if (result.final_accuracy) {
            std::snprintf(accuracy, sizeof accuracy, "held-out accuracy %.3f", *result.final_accuracy);
          }
          char summary[160];
          std::snprintf(summary, sizeof summary, "%s at step %lld, %s", result.stopped ? "stopped on a signal" : "done",
                        static_cast<long long>(result.step), accuracy);
          print_result(summary, result.digest);
        }
      },
      args.log, args.chart);
}

}  // namespace

void add_rl_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("rl", "colocated GRPO: rollout and training take turns on the same memory");
  auto a = std::make_shared<RlArgs>();
  std::string tasks;
  for (const std::string& name : rl::task_names()) tasks += (tasks.empty() ? "" : ", ") + name;
  cmd->add_option("--config", a->config, "a preset (tiny, qwen3.5-0.8b), a config.json, or a model directory")->required();
  cmd->add_option("--init", a->init, "start from this HF model directory (config.json + model.safetensors)");
  cmd->add_option("--task", a->task, "the task: " + tasks)->capture_default_str();
  cmd->add_option("--prompts-per-step", a->prompts_per_step, "prompts per RL step (global, a multiple of the ranks)")
      ->capture_default_str();
  cmd->add_option("--samples-per-prompt", a->samples_per_prompt, "G: completions per prompt, one group")->capture_default_str();
  cmd->add_option("--max-new-tokens", a->max_new_tokens, "tokens per completion (0: the task's longest answer + 1)")
      ->capture_default_str();
  cmd->add_option("--steps", a->steps, "RL steps (rollouts) after the warm-up")->capture_default_str();
  cmd->add_option("--updates-per-rollout", a->updates_per_rollout,
                  "optimizer steps per rollout, on mini-batches of whole prompt groups (ratios to the rollout's policy)")
      ->capture_default_str();
  cmd->add_option("--lr", a->lr, "RL learning rate (constant)")->capture_default_str();
  cmd->add_option("--clip", a->clip, "PPO clip: ratio >= 1 - clip")->capture_default_str();
  cmd->add_option("--clip-high", a->clip_high, "PPO clip: ratio <= 1 + clip-high")->capture_default_str();
  cmd->add_option("--kl-coef", a->kl_coef, "weight of k3 KL to the policy RL started from (0: none)")->capture_default_str();
  cmd->add_flag("--tis", a->tis, "truncated importance sampling: weigh tokens by min(p_train / p_rollout, 2)");
  cmd->add_flag("--true-on-policy", a->true_on_policy,
                "batch-invariant rollout and trainer: their log-probabilities agree bit for bit (slower on the CPU)");
  cmd->add_option("--temperature", a->temperature, "rollout sampling temperature")->capture_default_str();
  cmd->add_option("--weight-decay", a->weight_decay, "AdamW's decoupled weight decay")->capture_default_str();
  cmd->add_option("--max-grad-norm", a->max_grad_norm, "clip the global gradient norm to this (0: off)")->capture_default_str();
  cmd->add_option("--warmup-steps", a->warmup_steps, "supervised steps on the task's demonstrations before RL")
      ->capture_default_str();
  cmd->add_option("--warmup-batch", a->warmup_batch, "problems per warm-up step (global)")->capture_default_str();
  cmd->add_option("--warmup-lr", a->warmup_lr, "warm-up learning rate (constant)")->capture_default_str();
  cmd->add_option("--eval-every", a->eval_every, "held-out accuracy every N RL steps (0: at the end only)")
      ->capture_default_str();
  cmd->add_option("--eval-prompts", a->eval_prompts, "held-out problems per evaluation")->capture_default_str();
  CLI::Option* ckpt = cmd->add_option("--ckpt", a->ckpt, "checkpoint root: one directory per step and `latest`");
  cmd->add_option("--save-every", a->save_every,
                  "save every N optimizer steps, at the end of the RL step that reaches them (0: at the end only)")
      ->needs(ckpt);
  cmd->add_option("--resume", a->resume, "a checkpoint directory, a root with `latest`, or `latest` (of --ckpt)");
  cmd->add_option("--log", a->log, "JSONL log: one object per step and evaluation");
  cmd->add_option("--chart", a->chart, "chart PNG (default: the log's name with .png; none: no chart)");
  cmd->add_option("--seed", a->seed, "initial weights, problems and samples")
      ->capture_default_str()
      ->check(kNoSign);
  cmd->add_option("--threads", a->threads, "CPU threads per rank (0: the cores divided by the local ranks)")
      ->capture_default_str();
  cmd->add_option("--memory", a->memory, "the memory saver between phases: auto (by device), host, cuda, off")
      ->capture_default_str();
  cmd->add_option("--device", a->device, "cpu (MPI ranks) or cuda (one GPU per rank, NCCL)")->capture_default_str();
  cmd->add_flag("--keep-communicator", a->keep_communicator,
                "keep the communicator through the rollout (faster switches; NCCL keeps its memory)");
  cmd->callback([a] { run_rl_command(*a); });
}

}  // namespace deltatrain::tools
