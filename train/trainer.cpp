#include "deltatrain/train/trainer.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "deltatrain/core/clock.h"
#include "deltatrain/core/error.h"
#include "deltatrain/model/hf_checkpoint.h"
#include "deltatrain/model/inference.h"
#include "deltatrain/model/model.h"
#include "deltatrain/model/params.h"
#include "deltatrain/optim/adamw.h"
#include "deltatrain/optim/checkpoint.h"
#include "deltatrain/rollout/engine.h"
#include "deltatrain/train/data.h"
#include "deltatrain/train/parameters.h"
#include "deltatrain/train/step_directory.h"
#include "optim/file_io.h"
#include "optim/json_fields.h"

namespace deltatrain::train {

namespace fs = std::filesystem;
namespace {

constexpr const char* kStateFile = "trainer.json";
constexpr const char* kStateFormat = "deltatrain-trainer";
constexpr int kStateVersion = 1;

// A packed batch in host memory, and the model's view of it.
struct HostBatch {
  std::vector<std::int32_t> tokens, cu_seqlens{0}, targets;
  std::vector<double> weights;
  model::Batch view() const { return {tokens, cu_seqlens, targets, weights}; }
};

// Each planned piece is one sequence. A token's target is the document's next token, even across a row's
// end (the last token of a cut piece still has one); `weight` goes to every token with a target.
template <class TokensOf>
HostBatch build_batch(std::span<const std::vector<Piece>> rows, const std::vector<Document>& documents,
                      const TokensOf& tokens_of, double weight) {
  HostBatch batch;
  for (const std::vector<Piece>& row : rows) {
    for (const Piece& piece : row) {
      const std::span<const std::int32_t> document = tokens_of(documents[piece.document]);
      for (std::int64_t i = piece.offset; i < piece.offset + piece.length; ++i) {
        batch.tokens.push_back(document[i]);
        const bool has_target = i + 1 < static_cast<std::int64_t>(document.size());
        batch.targets.push_back(has_target ? document[i + 1] : -1);
        batch.weights.push_back(has_target ? weight : 0.0);
      }
      batch.cu_seqlens.push_back(static_cast<std::int32_t>(batch.tokens.size()));
    }
  }
  return batch;
}

// The bytes of the regular files under `dir`: what a checkpoint wrote or a resume read.
std::int64_t bytes_under(const fs::path& dir) {
  std::int64_t bytes = 0;
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) bytes += static_cast<std::int64_t>(entry.file_size());
  }
  return bytes;
}

std::string config_differences(const std::string& saved, const std::string& current) {
  const nlohmann::json a = nlohmann::json::parse(saved), b = nlohmann::json::parse(current);
  std::string fields;
  for (const auto& [key, value] : b.items()) {
    if (!a.contains(key) || a[key] != value) fields += (fields.empty() ? "" : ", ") + key;
  }
  for (const auto& [key, value] : a.items()) {
    if (!b.contains(key)) fields += (fields.empty() ? "" : ", ") + key;
  }
  return fields;
}

class Trainer {
 public:
  Trainer(comm::Group& group, const TrainOptions& options, Observer* observer)
      : group_(group),
        options_(options),
        observer_(observer),
        data_(options.data, options.config.vocab_size),
        train_lengths_(data_.train_lengths()),
        validation_lengths_(data_.validation_lengths()),
        plan_options_{options.tokens_per_step, options.seq_len, group.size(), true, options.seed},
        optimizer_(group, param_specs(options.config, group.device()),
                   {options.schedule.lr, options.beta1, options.beta2, options.eps, options.weight_decay, options.clip}),
        model_(options.config, model_options()) {
    model_.bind(params(), [this](std::string_view name) { return optimizer_.grad(name); });
  }

  TrainResult run(const std::function<bool()>& stop_requested) {
    StartReport start;
    start.parameters = model::param_count(options_.config);
    start.train_tokens = data_.train_token_count();
    start.dp_size = group_.size();
    if (options_.resume.empty()) {
      initialize();
    } else {
      const Clock::time_point began = Clock::now();
      start.resumed_from = resume(options_.resume);
      start.resume_seconds = seconds_since(began);
      // What a resume reads: the trainer state and the optimizer's checkpoint (model/ is for export).
      start.resume_bytes = bytes_under(start.resumed_from / "optimizer") +
                           static_cast<std::int64_t>(fs::file_size(start.resumed_from / kStateFile));
      start.step = optimizer_.step_count();
    }
    if (observer_) observer_->on_start(start);

    TrainResult result;
    const Clock::time_point began = Clock::now();
    while (optimizer_.step_count() < options_.steps) {
      if (comm::any_rank(group_, stop_requested && stop_requested())) {
        result.stopped = true;
        break;
      }
      const Clock::time_point step_began = Clock::now();
      StepReport report = train_step();
      report.seconds = seconds_since(step_began);
      report.elapsed = seconds_since(began);
      if (observer_) observer_->on_step(report);
      const std::int64_t step = optimizer_.step_count();
      if (options_.eval_every > 0 && step % options_.eval_every == 0) evaluate(stop_requested);
      if (options_.sample_every > 0 && step % options_.sample_every == 0) sample(stop_requested);
      if (!options_.checkpoint_root.empty() && options_.save_every > 0 && step % options_.save_every == 0) {
        result.last_checkpoint = save();
      }
    }
    if (final_save_needed(group_, options_.checkpoint_root, optimizer_.step_count())) result.last_checkpoint = save();
    result.step = optimizer_.step_count();
    result.digest = optim::digest_state(optimizer_);
    return result;
  }

 private:
  model::ModelOptions model_options() const {
    return {.device = group_.device(), .dtype = param_dtype(group_.device()), .cpu_threads = options_.cpu_threads};
  }
  model::TensorLookup params() const {
    return [this](std::string_view name) { return optimizer_.param(name); };
  }

  // The seeded initial weights, the same on every rank.
  void initialize() {
    model::ParamStore host(options_.config, param_dtype(group_.device()));
    host.init(options_.config.initializer_range, options_.seed);
    start_from(optimizer_, host);
  }

  StepReport train_step() {
    const std::int64_t index = optimizer_.step_count();
    const StepPlan plan = plan_step(train_lengths_, plan_options_, position_);
    // DistributedAdamW averages the ranks' gradients (sum / dp_size). For that average to be the gradient of
    // the global mean loss (1/N) sum over all N targets of the step, each rank weighs its targets by
    // dp_size / N: (1/dp) sum_r sum_{t in r} (dp/N) grad nll_t = (1/N) sum_t grad nll_t.
    const double weight = plan.targets > 0 ? static_cast<double>(group_.size()) / static_cast<double>(plan.targets) : 0;
    const HostBatch batch =
        build_batch(rank_rows(plan, group_.rank(), group_.size()), data_.train_documents(),
                    [this](const Document& d) { return data_.train_tokens(d); }, weight);
    optim::AdamWConfig config = optimizer_.config();
    config.lr = learning_rate(schedule(), index);
    optimizer_.set_config(config);
    optimizer_.zero_grad();
    const double local_loss = model_.forward(batch.view());
    model_.backward();
    // The optimizer's share of the step, timed apart: from the backward's end on the device to the step's
    // (grad_norm waits for it). The wait costs a launch gap, microseconds against a step's hundreds of ms.
    model_.synchronize();
    const Clock::time_point optimizer_began = Clock::now();
    optimizer_.step();
    StepReport report;
    report.grad_norm = optimizer_.grad_norm();
    report.optimizer_seconds = seconds_since(optimizer_began);
    position_ = plan.end;
    report.step = optimizer_.step_count();
    // Each rank's loss is (dp/N) x its share of the NLL sum: the global mean is their sum over dp.
    report.loss = comm::sum_over_ranks(group_, local_loss) / group_.size();
    report.lr = config.lr;
    report.tokens = options_.tokens_per_step;
    return report;
  }

  Schedule schedule() const {
    Schedule s = options_.schedule;
    s.total_steps = options_.steps;
    return s;
  }

  // The mean NLL over the fixed validation batches: the first eval_batches steps of the validation shard in
  // file order, forward only. A stop request (on any rank, polled between batches) abandons it unreported, so
  // that a long evaluation does not hold up the save and exit the request asks for.
  void evaluate(const std::function<bool()>& stop_requested) {
    const PlanOptions options{options_.tokens_per_step, options_.seq_len, group_.size(), false, 0};
    DataPosition at;
    double nll = 0;
    std::int64_t targets = 0;
    for (std::int64_t b = 0; b < options_.eval_batches; ++b) {
      if (comm::any_rank(group_, stop_requested && stop_requested())) return;
      const StepPlan plan = plan_step(validation_lengths_, options, at);
      at = plan.end;
      const HostBatch batch =
          build_batch(rank_rows(plan, group_.rank(), group_.size()), data_.validation_documents(),
                      [this](const Document& d) { return data_.validation_tokens(d); }, 1.0);
      nll += model_.forward(batch.view(), false);
      targets += plan.targets;
    }
    const double total = comm::sum_over_ranks(group_, nll);
    if (observer_) observer_->on_eval({optimizer_.step_count(), targets > 0 ? total / targets : 0.0,
                                       options_.eval_batches * options_.tokens_per_step});
  }

  // Generation on rank 0 from the start of the first non-empty validation document (Dataset makes sure there
  // is one), by the rollout engine on the trainer's parameters in place; the other ranks wait at the next
  // collective. The draws are keyed by (seed, step), so a resumed run samples what the straight run did. A stop
  // request on rank 0 (polled between tokens; only rank 0 generates, so no collective) abandons it unreported, as
  // an evaluation is, so that a long sample does not hold up the save and exit the request asks for.
  void sample(const std::function<bool()>& stop_requested) {
    if (group_.rank() != 0) return;
    const std::vector<Document>& documents = data_.validation_documents();
    const Document& first = *std::find_if(documents.begin(), documents.end(), [](const Document& d) { return d.length > 0; });
    const std::span<const std::int32_t> source = data_.validation_tokens(first);
    rollout::Request request;
    request.id = static_cast<std::uint64_t>(optimizer_.step_count());
    request.prompt.assign(source.begin(), source.begin() + std::min<std::int64_t>(options_.prompt_tokens, first.length));
    request.max_new_tokens = static_cast<std::int32_t>(options_.sample_tokens);
    request.sampling = {.temperature = options_.temperature, .seed = options_.seed};
    rollout::Engine engine(options_.config, model_options(), params(),
                           {.max_batch = 1, .max_length = std::ssize(request.prompt) + options_.sample_tokens});
    SampleReport report;
    report.step = optimizer_.step_count();
    report.prompt = request.prompt;
    engine.submit(request);
    while (!engine.idle()) {
      if (stop_requested && stop_requested()) return;
      engine.step();
    }
    report.completion = engine.take_finished().front().tokens;
    report.prompt_text = data_.vocabulary().decode(report.prompt);
    report.completion_text = data_.vocabulary().decode(report.completion);
    if (observer_) observer_->on_sample(report);
  }

  TrainerState state() const {
    return {optimizer_.step_count(), position_, options_.seed, options_.tokens_per_step, options_.seq_len,
            group_.size(), model::config_to_hf_json(options_.config), data_.fingerprint()};
  }

  fs::path save() {
    const Clock::time_point began = Clock::now();
    const fs::path dir = save_step_directory(
        group_, options_.checkpoint_root, optimizer_.step_count(), kStateFile,
        [this](const fs::path& temp) { optim::save_checkpoint(optimizer_, temp / "optimizer"); },
        [this](const fs::path& temp) {
          model::save_hf_model(temp / "model", options_.config, params(), param_dtype(group_.device()));
          optim::write_new_file(temp / kStateFile, state_to_json(state()));
        });
    if (observer_) observer_->on_save({optimizer_.step_count(), dir, seconds_since(began), bytes_under(dir)});
    return dir;
  }

  fs::path resume(const fs::path& path) {
    fs::path dir;
    TrainerState saved;
    collectively(group_, [&] {
      dir = resolve_train_checkpoint(path);
      saved = state_from_json(optim::read_text_file(dir / kStateFile), (dir / kStateFile).string());
      const std::string current = model::config_to_hf_json(options_.config);
      if (saved.config_json != current) {
        throw InvalidArgument("resume", "checkpoint " + dir.string() +
                                            " holds a model of another config (differs in: " +
                                            config_differences(saved.config_json, current) + ")");
      }
      auto must_match = [&](const char* flag, std::int64_t was, std::int64_t now) {
        if (was != now) {
          throw InvalidArgument("resume", std::string("checkpoint ") + dir.string() + " was trained with --" + flag +
                                              " " + std::to_string(was) + ", this run has " + std::to_string(now));
        }
      };
      check_resume_step(dir, saved.step, options_.steps, "is the step to train to");
      must_match("seq-len", saved.seq_len, options_.seq_len);
      must_match("tokens-per-step", saved.tokens_per_step, options_.tokens_per_step);
      if (saved.seed != options_.seed) {
        throw InvalidArgument("resume", "checkpoint " + dir.string() + " was trained with --seed " +
                                            std::to_string(saved.seed) + ", this run has " + std::to_string(options_.seed));
      }
      if (saved.data_fingerprint != data_.fingerprint()) {
        throw InvalidArgument("resume", "checkpoint " + dir.string() + " was trained on other training shards than " +
                                            options_.data.string());
      }
      try {
        check_position(train_lengths_, plan_options_, saved.data);
      } catch (const InvalidArgument& e) {
        optim::invalid_json_file("trainer state " + (dir / kStateFile).string(), "data: " + e.rule());
      }
    });
    optim::load_checkpoint(optimizer_, dir / "optimizer");
    if (optimizer_.step_count() != saved.step) {
      throw Failure("checkpoint " + dir.string() + " is inconsistent: trainer.json says step " +
                    std::to_string(saved.step) + ", the optimizer's checkpoint step " +
                    std::to_string(optimizer_.step_count()));
    }
    position_ = saved.data;
    return dir;
  }

  comm::Group& group_;
  const TrainOptions& options_;
  Observer* observer_;
  Dataset data_;
  std::vector<std::int64_t> train_lengths_, validation_lengths_;
  PlanOptions plan_options_;
  optim::DistributedAdamW optimizer_;
  model::Model model_;
  DataPosition position_;
};

}  // namespace

void check_options(const TrainOptions& options, int dp_size) {
  model::validate(options.config);
  if (options.steps < 0) throw InvalidArgument("steps", "must be >= 0; got " + std::to_string(options.steps));
  check_plan_options({options.tokens_per_step, options.seq_len, dp_size, true, options.seed});
  Schedule schedule = options.schedule;
  schedule.total_steps = options.steps;
  check_schedule(schedule);
  optim::check_config({options.schedule.lr, options.beta1, options.beta2, options.eps, options.weight_decay, options.clip});
  auto non_negative = [](const char* flag, std::int64_t value) {
    if (value < 0) throw InvalidArgument(flag, "must be >= 0; got " + std::to_string(value));
  };
  non_negative("save-every", options.save_every);
  non_negative("eval-every", options.eval_every);
  non_negative("sample-every", options.sample_every);
  if (options.sample_tokens < 1) throw InvalidArgument("sample-tokens", "must be >= 1; got " + std::to_string(options.sample_tokens));
  // The rollout engine that samples counts positions (prompt and completion) in 32 bits.
  if (options.sample_tokens > INT32_MAX - options.prompt_tokens) {
    throw InvalidArgument("sample-tokens", "must be at most " + std::to_string(INT32_MAX - options.prompt_tokens) +
                                               " (with the " + std::to_string(options.prompt_tokens) +
                                               "-token prompt, 2^31 - 1 positions); got " +
                                               std::to_string(options.sample_tokens));
  }
  if (options.eval_batches < 1) throw InvalidArgument("eval-batches", "must be >= 1; got " + std::to_string(options.eval_batches));
  if (options.prompt_tokens < 1) throw InvalidArgument("prompt-tokens", "must be >= 1; got " + std::to_string(options.prompt_tokens));
  if (!(options.temperature >= 0) || !std::isfinite(options.temperature)) {
    throw InvalidArgument("temperature", "must be >= 0 (0: greedy); got " + std::to_string(options.temperature));
  }
  if (options.save_every > 0 && options.checkpoint_root.empty()) {
    throw InvalidArgument("save-every", "needs --ckpt, the directory to save into");
  }
  if (options.cpu_threads < 0) throw InvalidArgument("threads", "must be >= 0; got " + std::to_string(options.cpu_threads));
}

std::int64_t sample_state_bytes(const TrainOptions& options, Device device) {
  // As sample() builds its engine: one slot of the prompt's tokens and the completion, parameters' dtype.
  return model::InferenceState::bytes(options.config, {.device = device, .dtype = param_dtype(device)}, 1,
                                      1 + options.sample_tokens);
}

TrainResult train(comm::Group& group, const TrainOptions& options, Observer* observer,
                  const std::function<bool()>& stop_requested) {
  check_options(options, group.size());
  std::unique_ptr<Trainer> trainer;
  collectively(group, [&] {
    if (group.rank() == 0) check_checkpoint_root(options.checkpoint_root, !options.resume.empty());
    trainer = std::make_unique<Trainer>(group, options, observer);
  });
  return trainer->run(stop_requested);
}

std::string state_to_json(const TrainerState& state) {
  nlohmann::ordered_json j = {
      {"format", kStateFormat},
      {"version", kStateVersion},
      {"step", state.step},
      {"data", {{"epoch", state.data.epoch}, {"index", state.data.index}, {"offset", state.data.offset}}},
      // Every random draw (initial weights, document order, samples) is a pure function of the seed, the
      // epoch and the step: the seed is the whole generator state.
      {"seed", state.seed},
      {"tokens_per_step", state.tokens_per_step},
      {"seq_len", state.seq_len},
      {"dp_size", state.dp_size},
      {"data_fingerprint", state.data_fingerprint},
      {"config", nlohmann::ordered_json::parse(state.config_json)},
  };
  return j.dump(2) + "\n";
}

TrainerState state_from_json(const std::string& text, const std::string& source) {
  const std::string file = "trainer state " + source;
  using optim::integer_field;
  constexpr std::int64_t kMax = INT64_MAX;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (!j.is_object()) optim::invalid_json_file(file, "it is not a JSON object");
    optim::only_known_fields(j,
                             {"format", "version", "step", "data", "seed", "tokens_per_step", "seq_len", "dp_size",
                              "data_fingerprint", "config"},
                             "", file);
    const std::string format = optim::string_field(j, "format", "", file);
    if (format != kStateFormat) optim::invalid_json_file(file, "not a trainer state (format '" + format + "')");
    integer_field(j, "version", kStateVersion, kStateVersion, "", file);
    TrainerState state;
    state.step = integer_field(j, "step", 0, kMax, "", file);
    const nlohmann::json& data = optim::field(j, "data", "", file);
    optim::only_known_fields(data, {"epoch", "index", "offset"}, "data.", file);
    state.data = {integer_field(data, "epoch", 0, kMax, "data.", file),
                  integer_field(data, "index", 0, kMax, "data.", file),
                  integer_field(data, "offset", 0, kMax, "data.", file)};
    // Any unsigned 64-bit seed (--seed takes them all); the reader below refuses the rest by name.
    const nlohmann::json& seed = optim::field(j, "seed", "", file);
    state.seed = seed.is_number_unsigned() ? seed.get<std::uint64_t>() : integer_field(j, "seed", 0, kMax, "", file);
    state.tokens_per_step = integer_field(j, "tokens_per_step", 1, kMax, "", file);
    state.seq_len = integer_field(j, "seq_len", 1, kMax, "", file);
    state.dp_size = static_cast<int>(integer_field(j, "dp_size", 1, INT_MAX, "", file));
    state.data_fingerprint = optim::string_field(j, "data_fingerprint", "", file);
    const std::string config = optim::field(j, "config", "", file).dump();
    state.config_json = model::config_to_hf_json(model::config_from_hf_json(config, source));
    return state;
  } catch (const nlohmann::json::exception& e) {
    optim::invalid_json_file(file, e.what());
  } catch (const InvalidArgument& e) {
    optim::invalid_json_file(file, e.what());
  }
}

fs::path resolve_train_checkpoint(const fs::path& path) { return resolve_step_directory(path, kStateFile); }

}  // namespace deltatrain::train
