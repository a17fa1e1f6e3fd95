#include "deltatrain/rl/loop.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "deltatrain/core/clock.h"
#include "deltatrain/core/error.h"
#include "deltatrain/model/hf_checkpoint.h"
#include "deltatrain/model/model.h"
#include "deltatrain/model/params.h"
#include "deltatrain/optim/adamw.h"
#include "deltatrain/optim/checkpoint.h"
#include "deltatrain/rl/tasks.h"
#include "deltatrain/rollout/engine.h"
#include "deltatrain/train/parameters.h"
#include "deltatrain/train/step_directory.h"
#include "optim/file_io.h"

namespace deltatrain::rl {

namespace fs = std::filesystem;
namespace {

constexpr const char* kStateFile = "rl.json";
constexpr const char* kStateFormat = "deltatrain-rl";
constexpr int kStateVersion = 1;
// The warm-up's problems come from a stream of their own, so that they are not the RL steps' prompts.
constexpr std::uint64_t kWarmupStream = 0x3a7f00d5eedull;
constexpr int kEvalExamples = 3;

constexpr MemoryTag kMemoryTags[] = {
    // Never parked: the rollout reads them in place. Pausing them would need a registered backup, and the
    // saver refuses a restore_from tag without one, so a wrong plan cannot lose them.
    {"weights", memsaver::Backup::RestoreFrom, true, true, "the model parameters"},
    {"grads", memsaver::Backup::None, false, true, "gradients (zeroed every step)"},
    {"optimizer", memsaver::Backup::CpuCopy, false, true, "fp32 main parameters and Adam moments (this rank's shard)"},
    {"activations", memsaver::Backup::None, false, true, "the trainer's activations"},
    {"rollout", memsaver::Backup::None, true, false, "the rollout's caches (GDN states, conv, K/V) and activations"},
};

const MemoryTag& tag_info(std::string_view tag) {
  for (const MemoryTag& t : kMemoryTags) {
    if (t.tag == tag) return t;
  }
  throw InvalidArgument("tag", "'" + std::string(tag) + "' is not one of the RL loop's memory tags");
}

// The memory saver and one allocator per tag; with memory "off", no saver and null allocators (plain memory,
// nothing parked).
class PhaseMemory {
 public:
  PhaseMemory(const std::string& backend, Device device) {
    if (backend == "off") return;
    saver_ = std::make_unique<memsaver::Saver>(memsaver::make_physical_memory(backend, device.index));
    for (const MemoryTag& t : kMemoryTags) {
      allocators_[t.tag] = memsaver::make_allocator(*saver_, {t.tag, t.backup}, device);
    }
  }

  Allocator* allocator(std::string_view tag) const {
    return saver_ ? allocators_.at(std::string(tag)).get() : nullptr;
  }

  // Seconds the switch took (the saver's work; the caller adds the communicator's).
  double switch_to(Phase phase) {
    const Clock::time_point start = Clock::now();
    if (!saver_) return 0;
    const PhaseSwitch plan = plan_switch(phase, saver_->stats());
    for (const std::string& tag : plan.pause) saver_->pause(tag);
    for (const std::string& tag : plan.resume) saver_->resume(tag);
    return seconds_since(start);
  }

  // Allocates the pinned copies of cpu tags now, so that the first switch does not pay for them.
  void prepare() {
    if (!saver_) return;
    for (const memsaver::TagStats& s : saver_->stats()) {
      if (s.backup == memsaver::Backup::CpuCopy) saver_->prepare_backups(s.tag);
    }
  }

  MemoryUse use() const {
    MemoryUse use;
    if (!saver_) return use;
    for (const memsaver::TagStats& s : saver_->stats()) {
      use.by_tag[s.tag] = s.mapped_bytes;
      use.mapped += s.mapped_bytes;
    }
    use.measured = saver_->memory().device_bytes_in_use();
    return use;
  }

  std::string backend() const { return saver_ ? saver_->memory().name() : "off"; }

 private:
  std::unique_ptr<memsaver::Saver> saver_;
  std::map<std::string, std::unique_ptr<Allocator>> allocators_;
};

// "auto": the saver's backend for the group's device.
std::string memory_backend(const std::string& option, Device device) {
  if (option != "auto") return option;
  return device.type == DeviceType::cpu ? "host" : "cuda";
}

// Sequences packed for the model, with per-token side data (advantage and rollout log-probability, at the
// positions whose target is a response token).
struct PackedBatch {
  std::vector<std::int32_t> tokens, cu_seqlens{0}, targets;
  std::vector<double> advantages, rollout_logprobs, weights;

  // prompt + response as one sequence; the targets are the response's tokens (each predicted from the
  // position before it), the prompt's and the last token's are -1.
  void add(std::span<const std::int32_t> prompt, std::span<const std::int32_t> response,
           std::span<const double> response_logprobs, double advantage) {
    const std::size_t start = tokens.size();
    tokens.insert(tokens.end(), prompt.begin(), prompt.end());
    tokens.insert(tokens.end(), response.begin(), response.end());
    const std::size_t length = tokens.size() - start;
    for (std::size_t i = 0; i < length; ++i) {
      const std::size_t response_index = i + 1 - prompt.size();  // of the target, when it is a response token
      const bool target = i + 1 >= prompt.size() && i + 1 < length;
      targets.push_back(target ? tokens[start + i + 1] : -1);
      advantages.push_back(target ? advantage : 0.0);
      rollout_logprobs.push_back(target && !response_logprobs.empty() ? response_logprobs[response_index] : 0.0);
    }
    cu_seqlens.push_back(static_cast<std::int32_t>(tokens.size()));
  }
  std::int64_t response_tokens() const {
    return std::count_if(targets.begin(), targets.end(), [](std::int32_t t) { return t >= 0; });
  }
  // log p of every target under `model`'s parameters now (a forward without backward).
  std::vector<double> logprobs_under(model::Model& model) const {
    model.forward({tokens, cu_seqlens, targets}, false);
    const std::span<const double> lp = model.token_logprobs();
    return {lp.begin(), lp.end()};
  }
};

struct RlState {
  std::int64_t step = 0;
  bool true_on_policy = false;
  std::uint64_t seed = 0;
  std::string task;
  std::int64_t warmup_steps = 0, warmup_batch = 0, prompts_per_step = 0, samples_per_prompt = 0, max_new_tokens = 0;
  std::int64_t updates_per_rollout = 1;
  double temperature = 0;
  int dp_size = 1;
  std::string config_json;
};

nlohmann::ordered_json state_json(const RlState& s) {
  return {{"format", kStateFormat},
          {"version", kStateVersion},
          {"step", s.step},
          // Problems and samples are pure functions of the seed and the step: the seed is the generators' state.
          {"seed", s.seed},
          {"task", s.task},
          {"warmup_steps", s.warmup_steps},
          {"warmup_batch", s.warmup_batch},
          {"prompts_per_step", s.prompts_per_step},
          {"samples_per_prompt", s.samples_per_prompt},
          {"max_new_tokens", s.max_new_tokens},
          {"updates_per_rollout", s.updates_per_rollout},
          {"temperature", s.temperature},
          {"true_on_policy", s.true_on_policy},
          {"dp_size", s.dp_size},
          {"config", nlohmann::ordered_json::parse(s.config_json)}};
}

RlState state_from_json(const std::string& text, const std::string& source) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (j.at("format") != kStateFormat) throw Failure("not an RL state (format " + j.at("format").dump() + ")");
    if (j.at("version") != kStateVersion) throw Failure("version " + j.at("version").dump() + " is not " + std::to_string(kStateVersion));
    RlState s;
    s.step = j.at("step");
    s.seed = j.at("seed");
    s.task = j.at("task");
    s.warmup_steps = j.at("warmup_steps");
    s.warmup_batch = j.at("warmup_batch");
    s.prompts_per_step = j.at("prompts_per_step");
    s.samples_per_prompt = j.at("samples_per_prompt");
    s.max_new_tokens = j.at("max_new_tokens");
    s.updates_per_rollout = j.value("updates_per_rollout", std::int64_t{1});  // absent before it existed: 1
    s.temperature = j.at("temperature");
    s.true_on_policy = j.at("true_on_policy");
    s.dp_size = j.at("dp_size");
    s.config_json = model::config_to_hf_json(model::config_from_hf_json(j.at("config").dump(), source));
    return s;
  } catch (const std::exception& e) {
    throw Failure("RL state " + source + " is not valid: " + e.what());
  }
}

class Loop {
 public:
  Loop(comm::Group& group, const RlOptions& options, Observer* observer)
      : group_(group),
        options_(options),
        observer_(observer),
        task_(make_task(options.task)),
        memory_(memory_backend(options.memory, group.device()), group.device()),
        optimizer_(group, train::param_specs(options.config, group.device()),
                   {options.lr, options.beta1, options.beta2, options.eps, options.weight_decay, options.max_grad_norm},
                   {}, nullptr,
                   {memory_.allocator("weights"), memory_.allocator("grads"), memory_.allocator("optimizer")}),
        model_(options.config, model_options("activations")),
        max_new_tokens_(options.max_new_tokens > 0 ? options.max_new_tokens : task_->max_answer_length() + 1) {
    const model::TensorLookup params = [this](std::string_view name) { return optimizer_.param(name); };
    model_.bind(params, [this](std::string_view name) { return optimizer_.grad(name); });
    const std::int64_t slots = options.prompts_per_step / group.size() * options.samples_per_prompt;
    engine_ = std::make_unique<rollout::Engine>(
        options.config, model_options("rollout"), params,
        rollout::EngineOptions{.max_batch = std::max<std::int64_t>(slots, options.eval_prompts / group.size()),
                               .max_length = task_->max_prompt_length() + max_new_tokens_});
  }

  RlResult run(const std::function<bool()>& stop_requested) {
    StartReport start{0, {}, model::param_count(options_.config), group_.size(), memory_.backend()};
    if (options_.resume.empty()) {
      initialize();
    } else {
      start.resumed_from = resume(options_.resume);
      start.step = optimizer_.step_count();
    }
    memory_.prepare();
    if (observer_) observer_->on_start(start);
    phase_ = std::nullopt;  // every tag is mapped until the first switch

    RlResult result;
    const Clock::time_point began = Clock::now();
    const std::int64_t total = options_.warmup_steps + options_.steps * options_.updates_per_rollout;
    while (optimizer_.step_count() < total) {
      if (comm::any_rank(group_, stop_requested && stop_requested())) {
        result.stopped = true;
        break;
      }
      const std::int64_t before = optimizer_.step_count();
      StepReport report = before < options_.warmup_steps ? warmup_step() : rl_step();
      report.elapsed = seconds_since(began);
      if (observer_) observer_->on_step(report);
      // A step of several updates saves once, at its end, when it reached a multiple of --save-every: a
      // checkpoint always falls between rollouts.
      const std::int64_t step = optimizer_.step_count();
      if (!options_.checkpoint_root.empty() && options_.save_every > 0 &&
          step / options_.save_every > before / options_.save_every) {
        result.last_checkpoint = save();
      }
    }
    // The evaluation of the final parameters, unless the last step's rollout phase just did it.
    if (!result.stopped && last_eval_step_ != optimizer_.step_count()) {
      switch_to(Phase::rollout);
      const std::vector<double> local = evaluate_local();
      switch_to(Phase::train);
      result.final_accuracy = report_eval(local);
    } else {
      result.final_accuracy = last_accuracy_;
    }
    switch_to(Phase::train);
    if (train::final_save_needed(group_, options_.checkpoint_root, optimizer_.step_count())) result.last_checkpoint = save();
    result.step = optimizer_.step_count();
    result.digest = optim::digest_state(optimizer_);
    return result;
  }

 private:
  model::ModelOptions model_options(std::string_view tag) const {
    return {.device = group_.device(), .dtype = train::param_dtype(group_.device()), .cpu_threads = options_.cpu_threads,
            .memory = memory_.allocator(tag), .batch_invariant = options_.true_on_policy};
  }

  // Seconds of the switch: the saver's work and the communicator's release or reload (whose share is added to
  // communicator_s_).
  double switch_to(Phase phase) {
    if (phase_ == phase) return 0;
    const Clock::time_point start = Clock::now();
    if (phase == Phase::rollout && options_.release_communicator && !group_.released()) {
      group_.release();  // the rollout communicates nothing
      communicator_s_ += seconds_since(start);
    }
    if (phase == Phase::train && group_.released()) {
      // First, so that NCCL's rebuild (on its worker thread) overlaps the memory restored below.
      const Clock::time_point reload = Clock::now();
      group_.reload();
      communicator_s_ += seconds_since(reload);
    }
    memory_.switch_to(phase);
    phase_ = phase;
    const double seconds = seconds_since(start);
    (phase == Phase::rollout ? rollout_memory_ : train_memory_) = memory_.use();  // a measurement, not the switch
    return seconds;
  }

  // The starting weights: the --init model's, or the seeded ones.
  void initialize() {
    model::ParamStore host(options_.config, train::param_dtype(group_.device()));
    if (!options_.init.empty()) {
      comm::collectively(group_, [&] { model::load_hf_weights(options_.init, options_.config, host.params()); });
    } else {
      host.init(options_.config.initializer_range, options_.seed);
    }
    train::start_from(optimizer_, host);
  }

  void set_lr(double lr) {
    optim::AdamWConfig config = optimizer_.config();
    config.lr = lr;
    optimizer_.set_config(config);
  }

  // This rank's contiguous share [begin, end) of `count` items.
  std::pair<std::int64_t, std::int64_t> share(std::int64_t count) const {
    const std::int64_t each = count / group_.size();
    return {group_.rank() * each, (group_.rank() + 1) * each};
  }

  // A supervised step on demonstrations: prompt, answer, end token; the loss on the answer and the end token.
  StepReport warmup_step() {
    StepReport report;
    report.warmup = true;
    report.to_train_s = switch_to(Phase::train);
    const Clock::time_point start = Clock::now();
    const std::int64_t step = optimizer_.step_count();
    PackedBatch batch;
    const auto [begin, end] = share(options_.warmup_batch);
    for (std::int64_t i = begin; i < end; ++i) {
      const Problem problem = task_->train_problem(options_.seed ^ kWarmupStream,
                                                   static_cast<std::uint64_t>(step * options_.warmup_batch + i));
      std::vector<std::int32_t> answer = Alphabet::encode(problem.answer);
      answer.push_back(Alphabet::kEnd);
      batch.add(Alphabet::encode(problem.prompt), answer, {}, 0);
    }
    const auto targets = static_cast<double>(batch.response_tokens());
    const double global_targets = comm::sum_over_ranks(group_, targets);
    // The optimizer averages the ranks' gradients: weigh each target by dp / N for the mean over all N.
    batch.weights.assign(batch.targets.size(), 0.0);
    for (std::size_t t = 0; t < batch.targets.size(); ++t) {
      if (batch.targets[t] >= 0) batch.weights[t] = group_.size() / global_targets;
    }
    set_lr(options_.warmup_lr);
    optimizer_.zero_grad();
    const double local = model_.forward({batch.tokens, batch.cu_seqlens, batch.targets, batch.weights});
    model_.backward();
    optimizer_.step();
    report.step = optimizer_.step_count();
    report.loss = comm::sum_over_ranks(group_, local) / group_.size();
    report.grad_norm = optimizer_.grad_norm();
    report.lr = options_.warmup_lr;
    report.train_tokens = static_cast<std::int64_t>(comm::sum_over_ranks(group_, double(batch.tokens.size())));
    report.train_s = seconds_since(start);
    report.train_memory = train_memory_;
    return report;
  }

  StepReport rl_step() {
    StepReport report;
    communicator_s_ = 0;
    const std::int64_t rl_index = rl_steps_done(options_, optimizer_.step_count());
    const std::int64_t P = options_.prompts_per_step, G = options_.samples_per_prompt;

    // --- Rollout --------------------------------------------------------------------------------------------
    report.to_rollout_s = switch_to(Phase::rollout);
    std::optional<std::vector<double>> eval;
    if (options_.eval_every > 0 && rl_index % options_.eval_every == 0) eval = evaluate_local();
    const Clock::time_point rollout_start = Clock::now();
    const auto [begin, end] = share(P);
    std::vector<Problem> problems;
    std::vector<rollout::Request> requests;
    for (std::int64_t p = begin; p < end; ++p) {
      const std::uint64_t index = static_cast<std::uint64_t>(rl_index * P + p);
      problems.push_back(task_->train_problem(options_.seed, index));
      const std::vector<std::int32_t> prompt = Alphabet::encode(problems.back().prompt);
      for (std::int64_t g = 0; g < G; ++g) {
        rollout::Request r;
        r.id = index * static_cast<std::uint64_t>(G) + static_cast<std::uint64_t>(g);
        r.prompt = prompt;
        r.max_new_tokens = static_cast<std::int32_t>(max_new_tokens_);
        r.stop_tokens = {Alphabet::kEnd};
        r.sampling = {.temperature = options_.temperature, .seed = options_.seed};
        r.untempered_logprobs = true;
        requests.push_back(std::move(r));
      }
    }
    const std::vector<rollout::Completion> completions = engine_->generate(requests);
    std::vector<double> rewards(completions.size());
    std::int64_t generated = 0;
    for (std::size_t i = 0; i < completions.size(); ++i) {
      rewards[i] = task_->reward(problems[i / G], Alphabet::decode(completions[i].tokens));
      generated += static_cast<std::int64_t>(completions[i].tokens.size());
    }
    const std::vector<double> advantages = group_advantages(rewards, G);
    report.rollout_s = seconds_since(rollout_start);

    // --- Train ----------------------------------------------------------------------------------------------
    report.to_train_s = switch_to(Phase::train);
    const Clock::time_point train_start = Clock::now();
    if (eval) report_eval(*eval);
    // One mini-batch of whole prompt groups per update (check_options: the updates divide the prompts per rank).
    const std::int64_t updates = options_.updates_per_rollout;
    const std::size_t samples_per_update = completions.size() / static_cast<std::size_t>(updates);
    std::vector<PackedBatch> batches(static_cast<std::size_t>(updates));
    for (std::size_t i = 0; i < completions.size(); ++i) {
      batches[i / samples_per_update].add(requests[i].prompt, completions[i].tokens, completions[i].untempered_logprobs,
                                          advantages[i]);
    }
    std::vector<double> local_tokens;
    for (const PackedBatch& batch : batches) local_tokens.push_back(static_cast<double>(batch.response_tokens()));
    const std::vector<double> global_tokens = comm::sum_over_ranks(group_, local_tokens);
    // The old policy: the trainer's log-probabilities at the rollout's parameters. With one update they are that
    // update's own forward's (a constant in the gradient); with more, the later updates run on moved parameters,
    // so every mini-batch's are computed before the first update.
    std::vector<std::vector<double>> old_logprobs(batches.size());
    if (updates > 1) {
      for (std::size_t u = 0; u < batches.size(); ++u) old_logprobs[u] = batches[u].logprobs_under(model_);
    }

    struct Sums {
      double clipped = 0, tis = 0, kl = 0, mismatch = 0, mismatch_kl = 0, mismatch_max = 0, tokens = 0;
    } sums;
    double local_loss = 0, grad_norm = 0;
    set_lr(options_.lr);
    for (std::size_t u = 0; u < batches.size(); ++u) {
      const PackedBatch& batch = batches[u];
      const double weight = global_tokens[u] > 0 ? group_.size() / global_tokens[u] : 0.0;
      std::vector<double> reference;
      if (options_.grpo.kl_coef > 0) reference = reference_logprobs(batch);
      const model::TokenObjective objective = [&](std::int64_t first, std::span<const double> logprobs,
                                                  std::span<double> terms, std::span<double> derivatives) {
        for (std::size_t r = 0; r < logprobs.size(); ++r) {
          const std::size_t t = static_cast<std::size_t>(first) + r;
          if (batch.targets[t] < 0) {
            terms[r] = derivatives[r] = 0;
            continue;
          }
          const double old = updates > 1 ? old_logprobs[u][t] : logprobs[r];
          const TokenLoss loss = grpo_token_loss(
              options_.grpo, {logprobs[r], old, batch.rollout_logprobs[t], reference.empty() ? 0.0 : reference[t],
                              batch.advantages[t], weight});
          terms[r] = loss.term;
          derivatives[r] = loss.derivative;
          const double difference = old - batch.rollout_logprobs[t];
          sums.clipped += loss.clipped ? 1 : 0;
          sums.tis += loss.tis;
          sums.kl += loss.kl;
          sums.mismatch += std::abs(difference);
          sums.mismatch_max = std::max(sums.mismatch_max, std::abs(difference));
          sums.mismatch_kl += std::exp(difference) - difference - 1;
          sums.tokens += 1;
        }
      };
      optimizer_.zero_grad();
      local_loss += model_.forward({.tokens = batch.tokens, .cu_seqlens = batch.cu_seqlens, .targets = batch.targets,
                                    .objective = &objective});
      model_.backward();
      optimizer_.step();
      grad_norm += optimizer_.grad_norm();
    }
    std::size_t trained_tokens = 0;
    for (const PackedBatch& batch : batches) trained_tokens += batch.tokens.size();
    report.train_s = seconds_since(train_start);

    // --- Statistics (global) --------------------------------------------------------------------------------
    double reward_sum = 0, reward_squares = 0;
    for (const double r : rewards) {
      reward_sum += r;
      reward_squares += r * r;
    }
    const std::vector<double> global = comm::sum_over_ranks(
        group_, std::vector<double>{local_loss, reward_sum, reward_squares, static_cast<double>(rewards.size()), static_cast<double>(generated),
                 static_cast<double>(trained_tokens), sums.clipped, sums.tis, sums.kl, sums.mismatch,
                 sums.mismatch_kl, sums.tokens});
    const double samples = global[3], tokens = std::max(1.0, global[11]);
    report.step = optimizer_.step_count();
    report.updates = updates;
    report.loss = global[0] / group_.size() / static_cast<double>(updates);
    report.grad_norm = grad_norm / static_cast<double>(updates);
    report.lr = options_.lr;
    report.reward_mean = global[1] / samples;
    report.reward_std = std::sqrt(std::max(0.0, global[2] / samples - report.reward_mean * report.reward_mean));
    report.rollout_tokens = static_cast<std::int64_t>(global[4]);
    report.response_length = global[4] / samples;
    report.train_tokens = static_cast<std::int64_t>(global[5]);
    report.clip_fraction = global[6] / tokens;
    report.tis_mean = global[7] / tokens;
    report.kl = global[8] / tokens;
    report.mismatch_mean = global[9] / tokens;
    report.mismatch_kl = global[10] / tokens;
    report.mismatch_max = comm::max_over_ranks(group_, sums.mismatch_max);
    report.rollout_memory = rollout_memory_;
    report.train_memory = train_memory_;
    report.communicator_s = communicator_s_;
    return report;
  }

  // log p of every target under the reference policy (the parameters RL started from).
  std::vector<double> reference_logprobs(const PackedBatch& batch) {
    if (!reference_) capture_reference();
    return batch.logprobs_under(*reference_model_);
  }

  void capture_reference() {
    reference_ = train::host_params(optimizer_, options_.config);
    bind_reference();
  }

  // The reference model reads the host copy on the CPU, a device mirror of it on a GPU.
  void bind_reference() {
    reference_model_ = std::make_unique<model::Model>(options_.config, model_options("activations"));
    if (group_.device().type == DeviceType::cpu) {
      reference_model_->bind(reference_->params());
      return;
    }
    reference_device_ = std::make_unique<model::DeviceParams>(*reference_, group_.device());
    reference_device_->upload(*reference_);
    reference_model_->bind(reference_device_->params());
  }

  // Greedy completions of this rank's share of the held-out problems: {solved, reward sum, count}. Runs in the
  // rollout phase; report_eval sums it over the ranks once the communicator is back.
  std::vector<double> evaluate_local() {
    const std::vector<Problem> problems = task_->eval_problems(options_.eval_prompts);
    const auto [begin, end] = share(options_.eval_prompts);
    std::vector<rollout::Request> requests;
    for (std::int64_t i = begin; i < end; ++i) {
      rollout::Request r;
      r.id = static_cast<std::uint64_t>(i);
      r.prompt = Alphabet::encode(problems[i].prompt);
      r.max_new_tokens = static_cast<std::int32_t>(max_new_tokens_);
      r.stop_tokens = {Alphabet::kEnd};
      r.sampling = {.temperature = 0, .seed = options_.seed};
      requests.push_back(std::move(r));
    }
    const std::vector<rollout::Completion> completions = engine_->generate(requests);
    double solved = 0, reward = 0;
    eval_examples_.clear();
    for (std::size_t i = 0; i < completions.size(); ++i) {
      const Problem& problem = problems[begin + static_cast<std::int64_t>(i)];
      const std::string text = Alphabet::decode(completions[i].tokens);
      const double r = task_->reward(problem, text);
      solved += r == 1.0 ? 1 : 0;
      reward += r;
      if (static_cast<int>(eval_examples_.size()) < kEvalExamples) eval_examples_.push_back({problem.prompt, text, r});
    }
    return {solved, reward, static_cast<double>(completions.size())};
  }

  double report_eval(const std::vector<double>& local) {
    const std::vector<double> global = comm::sum_over_ranks(group_, local);
    EvalReport report;
    report.step = optimizer_.step_count();
    report.problems = static_cast<std::int64_t>(global[2]);
    report.accuracy = global[2] > 0 ? global[0] / global[2] : 0;
    report.reward_mean = global[2] > 0 ? global[1] / global[2] : 0;
    report.examples = eval_examples_;
    last_eval_step_ = report.step;
    last_accuracy_ = report.accuracy;
    if (observer_) observer_->on_eval(report);
    return report.accuracy;
  }

  RlState state() const {
    return {optimizer_.step_count(), options_.true_on_policy, options_.seed, options_.task, options_.warmup_steps, options_.warmup_batch,
            options_.prompts_per_step, options_.samples_per_prompt, max_new_tokens_, options_.updates_per_rollout,
            options_.temperature, group_.size(), model::config_to_hf_json(options_.config)};
  }

  fs::path save() {
    const fs::path dir = train::save_step_directory(
        group_, options_.checkpoint_root, optimizer_.step_count(), kStateFile,
        [this](const fs::path& temp) { optim::save_checkpoint(optimizer_, temp / "optimizer"); },
        [this](const fs::path& temp) {
          // In the parameters' own dtype (bf16 on a GPU, float32 on the CPU; the optimizer's checkpoint holds the
          // float32 main weights), streamed from where they live.
          model::save_hf_model(temp / "model", options_.config,
                               [this](std::string_view name) { return optimizer_.param(name); },
                               train::param_dtype(group_.device()));
          if (reference_) model::save_hf_model(temp / "reference", options_.config, reference_->params(), reference_->dtype());
          optim::write_new_file(temp / kStateFile, state_json(state()).dump(2) + "\n");
        });
    if (observer_) observer_->on_save(optimizer_.step_count(), dir);
    return dir;
  }

  fs::path resume(const fs::path& path) {
    fs::path dir;
    RlState saved;
    comm::collectively(group_, [&] {
      dir = train::resolve_step_directory(path, kStateFile);
      saved = state_from_json(optim::read_text_file(dir / kStateFile), (dir / kStateFile).string());
      const RlState now = state();
      if (saved.config_json != now.config_json) {
        throw InvalidArgument("resume", "checkpoint " + dir.string() + " holds a model of another config than --config");
      }
      auto must_match = [&](const char* flag, const std::string& was, const std::string& is) {
        if (was != is) {
          throw InvalidArgument("resume", "checkpoint " + dir.string() + " was run with --" + flag + " " + was +
                                              ", this run has " + is + " (a resume must draw the same problems and samples)");
        }
      };
      must_match("task", saved.task, now.task);
      must_match("seed", std::to_string(saved.seed), std::to_string(now.seed));
      must_match("warmup-steps", std::to_string(saved.warmup_steps), std::to_string(now.warmup_steps));
      must_match("warmup-batch", std::to_string(saved.warmup_batch), std::to_string(now.warmup_batch));
      must_match("prompts-per-step", std::to_string(saved.prompts_per_step), std::to_string(now.prompts_per_step));
      must_match("samples-per-prompt", std::to_string(saved.samples_per_prompt), std::to_string(now.samples_per_prompt));
      must_match("max-new-tokens", std::to_string(saved.max_new_tokens), std::to_string(now.max_new_tokens));
      must_match("updates-per-rollout", std::to_string(saved.updates_per_rollout), std::to_string(now.updates_per_rollout));
      must_match("temperature", std::to_string(saved.temperature), std::to_string(now.temperature));
      must_match("true-on-policy", saved.true_on_policy ? "on" : "off", now.true_on_policy ? "on" : "off");
      // After the checks above, so that the warm-up and the updates per rollout are the checkpoint's.
      const std::int64_t last = options_.warmup_steps + options_.steps * options_.updates_per_rollout;
      train::check_resume_step(dir, saved.step, last,
                               "counts the RL steps after the warm-up, here to optimizer step " +
                                   std::to_string(options_.warmup_steps) + " + " + std::to_string(options_.steps) +
                                   " x " + std::to_string(options_.updates_per_rollout) + " = " + std::to_string(last));
      if (options_.grpo.kl_coef > 0 && saved.step > options_.warmup_steps && !fs::exists(dir / "reference")) {
        throw InvalidArgument("resume", "checkpoint " + dir.string() + " has no reference policy, which --kl-coef needs");
      }
    });
    optim::load_checkpoint(optimizer_, dir / "optimizer");
    if (optimizer_.step_count() != saved.step) {
      throw Failure("checkpoint " + dir.string() + " is inconsistent: rl.json says step " + std::to_string(saved.step) +
                    ", the optimizer's checkpoint step " + std::to_string(optimizer_.step_count()));
    }
    if (options_.grpo.kl_coef > 0 && fs::exists(dir / "reference")) {
      reference_ = std::make_unique<model::ParamStore>(options_.config, train::param_dtype(group_.device()));
      comm::collectively(group_, [&] { model::load_hf_weights(dir / "reference", options_.config, reference_->params()); });
      bind_reference();
    }
    return dir;
  }

  comm::Group& group_;
  const RlOptions& options_;
  Observer* observer_;
  std::unique_ptr<Task> task_;
  PhaseMemory memory_;
  optim::DistributedAdamW optimizer_;
  model::Model model_;
  std::int64_t max_new_tokens_;
  std::unique_ptr<rollout::Engine> engine_;
  std::unique_ptr<model::ParamStore> reference_;
  std::unique_ptr<model::DeviceParams> reference_device_;  // its mirror on a GPU
  std::unique_ptr<model::Model> reference_model_;
  std::optional<Phase> phase_;
  MemoryUse rollout_memory_, train_memory_;
  double communicator_s_ = 0;  // of this step's switches
  std::vector<EvalReport::Example> eval_examples_;
  std::int64_t last_eval_step_ = -1;
  std::optional<double> last_accuracy_;  // none before the first evaluation
};

}  // namespace

const char* phase_name(Phase phase) { return phase == Phase::rollout ? "rollout" : "train"; }

std::span<const MemoryTag> memory_tags() { return kMemoryTags; }

PhaseSwitch plan_switch(Phase to, const std::vector<memsaver::TagStats>& now) {
  PhaseSwitch plan;
  for (const memsaver::TagStats& s : now) {
    const MemoryTag& t = tag_info(s.tag);
    const bool keep = to == Phase::rollout ? t.in_rollout : t.in_train;
    if (!keep && s.state == memsaver::TagState::Active) plan.pause.push_back(s.tag);
    if (keep && s.state == memsaver::TagState::Paused) plan.resume.push_back(s.tag);
  }
  return plan;
}

void check_options(const RlOptions& o, int dp_size) {
  model::validate(o.config);
  make_task(o.task);
  if (o.config.vocab_size < Alphabet::size()) {
    throw InvalidArgument("config", "its vocabulary of " + std::to_string(o.config.vocab_size) +
                                        " tokens is smaller than the tasks' alphabet of " + std::to_string(Alphabet::size()));
  }
  check_options(o.grpo);
  auto multiple_of_ranks = [&](const char* flag, std::int64_t value) {
    if (value < 1 || value % dp_size != 0) {
      throw InvalidArgument(flag, "must be a positive multiple of the " + std::to_string(dp_size) + " ranks, got " +
                                      std::to_string(value));
    }
  };
  multiple_of_ranks("prompts-per-step", o.prompts_per_step);
  multiple_of_ranks("warmup-batch", o.warmup_batch);
  multiple_of_ranks("eval-prompts", o.eval_prompts);
  auto at_least = [](const char* flag, std::int64_t value, std::int64_t least) {
    if (value < least) throw InvalidArgument(flag, "must be >= " + std::to_string(least) + ", got " + std::to_string(value));
  };
  at_least("samples-per-prompt", o.samples_per_prompt, 2);  // a group of one has no baseline: advantage 0
  at_least("max-new-tokens", o.max_new_tokens, 0);
  at_least("steps", o.steps, 0);
  at_least("updates-per-rollout", o.updates_per_rollout, 1);
  if ((o.prompts_per_step / dp_size) % o.updates_per_rollout != 0) {
    throw InvalidArgument("updates-per-rollout", "splits each rank's " + std::to_string(o.prompts_per_step / dp_size) +
                                                     " prompts into mini-batches of whole groups: must divide them, got " +
                                                     std::to_string(o.updates_per_rollout));
  }
  at_least("warmup-steps", o.warmup_steps, 0);
  at_least("eval-every", o.eval_every, 0);
  at_least("save-every", o.save_every, 0);
  at_least("threads", o.cpu_threads, 0);
  make_task(o.task)->eval_problems(o.eval_prompts);  // the held-out set is large enough
  optim::check_config({o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.max_grad_norm});
  try {
    optim::check_config({o.warmup_lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.max_grad_norm});
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("warmup-lr", e.rule());  // the check above passed: only the learning rate differs
  }
  if (!(o.temperature > 0) || !std::isfinite(o.temperature)) {
    throw InvalidArgument("temperature", "must be > 0 (RL samples), got " + std::to_string(o.temperature));
  }
  if (o.true_on_policy && o.temperature != 1.0) {
    throw InvalidArgument("true-on-policy", "samples from the policy the trainer computes: needs --temperature 1, got " +
                                                std::to_string(o.temperature));
  }
  if (o.memory != "auto" && o.memory != "host" && o.memory != "cuda" && o.memory != "off") {
    throw InvalidArgument("memory", "must be auto, host, cuda or off, got '" + o.memory + "'");
  }
  if (o.save_every > 0 && o.checkpoint_root.empty()) throw InvalidArgument("save-every", "needs --ckpt, the directory to save into");
}

RlResult run_rl(comm::Group& group, const RlOptions& options, Observer* observer,
                const std::function<bool()>& stop_requested) {
  check_options(options, group.size());
  const std::string backend = memory_backend(options.memory, group.device());
  if (backend != "off" && (backend == "host") != (group.device().type == DeviceType::cpu)) {
    throw InvalidArgument("memory", "the " + backend + " backend cannot hold memory of " + device_name(group.device()));
  }
  std::unique_ptr<Loop> loop;
  comm::collectively(group, [&] {
    if (group.rank() == 0) train::check_checkpoint_root(options.checkpoint_root, !options.resume.empty());
    loop = std::make_unique<Loop>(group, options, observer);
  });
  return loop->run(stop_requested);
}

}  // namespace deltatrain::rl
