// `deltatrain train`: data-parallel training of the hybrid GDN model on every rank that mpirun starts (one
// rank without mpirun). Rank 0 prints a progress line per step (a bar on a terminal), writes the JSONL log
// and, at the end, the loss chart (python -m deltatrain.charts) when --log is given.

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "run_support.h"
#include "deltatrain/comm/nccl_group.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "deltatrain/model/config.h"
#include "deltatrain/model/cost.h"
#include "deltatrain/train/trainer.h"

namespace deltatrain::tools {
namespace {

namespace fs = std::filesystem;

struct TrainArgs {
  std::string config;
  std::string data;
  std::int64_t steps = 100;
  std::int64_t tokens_per_step = 4096;
  std::int64_t seq_len = 256;
  double lr = 3e-3;
  std::int64_t warmup = 10;
  std::string schedule = "cosine";
  double min_lr_ratio = 0.1;
  double weight_decay = 0.1;
  double clip = 1.0;
  std::string ckpt;
  std::int64_t save_every = 0;
  std::string resume;
  std::int64_t eval_every = 0;
  std::int64_t eval_batches = 4;
  std::int64_t sample_every = 0;
  std::int64_t sample_tokens = 48;
  double temperature = 0;
  std::string log;
  std::string chart;
  std::uint64_t seed = 1234;
  int threads = 0;
  double peak_flops = 0;
  std::string device = "cpu";
};

double gib(double bytes) { return bytes / (1ull << 30); }

// Rank 0's view of training: the console and the JSONL log.
class Reporter : public train::Observer {
 public:
  Reporter(const TrainArgs& args, const train::TrainOptions& options)
      : args_(args),
        steps_(options.steps),
        flops_per_token_(model::training_flops_per_token(options.config, options.seq_len).total()),
        peak_flops_(args.peak_flops > 0 ? args.peak_flops : known_peak_flops(args.device)),
        terminal_(progress_on_terminal()),
        log_(args.log, !args.resume.empty()) {}

  void on_start(const train::StartReport& start) override {
    log_.start();
    first_step_ = start.step;
    std::printf("training %lld parameters on %d rank%s, %lld training tokens; %s step %lld of %lld\n",
                static_cast<long long>(start.parameters), start.dp_size, start.dp_size == 1 ? "" : "s",
                static_cast<long long>(start.train_tokens),
                start.resumed_from.empty() ? "starting at" : ("resumed from " + start.resumed_from.string() + " at").c_str(),
                static_cast<long long>(start.step), static_cast<long long>(steps_));
    if (!start.resumed_from.empty()) {
      std::printf("loaded %.2f GiB in %.2f s (%.2f GiB/s)\n", gib(start.resume_bytes), start.resume_seconds,
                  gib(start.resume_bytes) / start.resume_seconds);
      write({{"kind", "resume"}, {"step", start.step}, {"dir", start.resumed_from.string()},
             {"seconds", start.resume_seconds}, {"bytes", start.resume_bytes}});
    }
    std::fflush(stdout);
  }

  void on_step(const train::StepReport& r) override {
    const double tokens_per_s = r.seconds > 0 ? r.tokens / r.seconds : 0;
    const double done = static_cast<double>(r.step - first_step_);
    const double eta = done > 0 ? r.elapsed / done * static_cast<double>(steps_ - r.step) : -1;
    const double mfu = peak_flops_ > 0 ? flops_per_token_ * tokens_per_s / peak_flops_ : 0;
    std::string extra;
    if (mfu > 0) extra += "  mfu " + fixed(100 * mfu, 1) + "%";
    // The GPU's memory in use after the step, as its driver counts it (the step's arenas stay allocated, so
    // this is the step's peak plus the CUDA context).
    const double device_bytes = args_.device == "cuda" ? device_memory_in_use() : 0;
    if (device_bytes > 0) extra += "  mem " + fixed(gib(device_bytes), 1) + " GiB";
    char line[256];
    std::snprintf(line, sizeof line, "step %lld/%lld  loss %.4f  lr %.2e  gnorm %.3f  tok/s %.0f%s  eta %s",
                  static_cast<long long>(r.step), static_cast<long long>(steps_), r.loss, r.lr, r.grad_norm,
                  tokens_per_s, extra.c_str(), duration_text(eta).c_str());
    if (terminal_) {
      constexpr int kWidth = 24;
      const int filled = steps_ > 0 ? static_cast<int>(kWidth * r.step / steps_) : kWidth;
      std::printf("\r[%s%s] %s\x1b[K", std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(), line);
      bar_open_ = true;
    } else {
      std::printf("%s\n", line);
    }
    std::fflush(stdout);
    nlohmann::ordered_json row = {{"kind", "train"}, {"step", r.step}, {"loss", r.loss}, {"lr", r.lr},
                                  {"grad_norm", r.grad_norm}, {"tokens", r.tokens}, {"seconds", r.seconds},
                                  {"optimizer_seconds", r.optimizer_seconds}, {"tokens_per_s", tokens_per_s},
                                  {"elapsed", r.elapsed}};
    if (mfu > 0) row["mfu"] = mfu;
    if (device_bytes > 0) row["device_memory_bytes"] = device_bytes;
    write(row);
  }

  void on_eval(const train::EvalReport& r) override {
    end_bar();
    std::printf("eval step %lld  val_loss %.4f  (%lld tokens)\n", static_cast<long long>(r.step), r.val_loss,
                static_cast<long long>(r.tokens));
    write({{"kind", "eval"}, {"step", r.step}, {"val_loss", r.val_loss}, {"tokens", r.tokens}});
  }

  void on_sample(const train::SampleReport& r) override {
    end_bar();
    std::printf("sample step %lld: %s|%s\n", static_cast<long long>(r.step), printable(r.prompt_text).c_str(),
                printable(r.completion_text).c_str());
    write({{"kind", "sample"}, {"step", r.step}, {"prompt", valid_utf8(r.prompt_text)},
           {"text", valid_utf8(r.completion_text)}, {"tokens", r.completion}});
  }

  void on_save(const train::SaveReport& r) override {
    end_bar();
    std::printf("saved %s: %.2f GiB in %.2f s (%.2f GiB/s)\n", r.dir.string().c_str(), gib(r.bytes), r.seconds,
                gib(r.bytes) / r.seconds);
    write({{"kind", "save"}, {"step", r.step}, {"dir", r.dir.string()}, {"seconds", r.seconds}, {"bytes", r.bytes}});
  }

  void end_bar() {
    if (bar_open_) std::printf("\n");
    bar_open_ = false;
    std::fflush(stdout);
  }

 private:
  void write(const nlohmann::ordered_json& row) { log_.write(row); }
  // Byte-level tokens can split a UTF-8 character; JSON needs valid text, so bad bytes become U+FFFD.
  static std::string valid_utf8(const std::string& text) {
    return nlohmann::json::parse(nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace))
        .get<std::string>();
  }
  static std::string fixed(double value, int decimals) {
    char text[32];
    std::snprintf(text, sizeof text, "%.*f", decimals, value);
    return text;
  }
  static double device_memory_in_use() {
    const std::uint64_t total = cuda_info().gpus.empty() ? 0 : cuda_info().gpus.front().memory_bytes;
    return total > 0 ? static_cast<double>(total - comm::cuda_free_bytes()) : 0;
  }
  static std::string printable(const std::string& text) {
    std::string out;
    for (char c : text) out += c == '\n' ? std::string("\\n") : std::string(1, c);
    return out;
  }

  const TrainArgs& args_;
  std::int64_t steps_;
  std::int64_t first_step_ = 0;
  double flops_per_token_;
  double peak_flops_;
  bool terminal_;
  bool bar_open_ = false;
  JsonlLog log_;
};

train::TrainOptions make_options(const TrainArgs& args) {
  if (!(args.peak_flops >= 0) || !std::isfinite(args.peak_flops)) {
    throw InvalidArgument("--peak-flops", "must be finite and >= 0 (0: the device's known peak, else no MFU), got " +
                                              std::to_string(args.peak_flops));
  }
  train::TrainOptions o;
  o.config = load_config_flag(args.config);
  o.data = args.data;
  o.steps = args.steps;
  o.tokens_per_step = args.tokens_per_step;
  o.seq_len = args.seq_len;
  o.schedule.lr = args.lr;
  o.schedule.warmup = args.warmup;
  o.schedule.kind = train::parse_schedule_kind(args.schedule);
  o.schedule.min_lr_ratio = args.min_lr_ratio;
  o.weight_decay = args.weight_decay;
  o.clip = args.clip;
  o.seed = args.seed;
  o.checkpoint_root = args.ckpt;
  o.save_every = args.save_every;
  o.resume = resume_path(args.resume, args.ckpt);
  o.eval_every = args.eval_every;
  o.eval_batches = args.eval_batches;
  o.sample_every = args.sample_every;
  o.sample_tokens = args.sample_tokens;
  o.temperature = args.temperature;
  o.cpu_threads = args.threads == 0 ? default_threads() : args.threads;  // a negative count is refused by name
  return o;
}

void run_train_command(const TrainArgs& args) {
  run_collective_command(
      [&](int rank, int ranks) {
        const train::TrainOptions options = make_options(args);
        train::check_options(options, ranks);  // before the reporter computes FLOPs from them
        // The group first: its device (the host, or this rank's GPU) is the memory the checks below are about.
        const std::unique_ptr<comm::Group> group = make_group(args.device);
        const double floats_per_token =
            static_cast<double>(options.config.hidden_size) * options.config.num_hidden_layers();
        check_fits_in_memory("--tokens-per-step",
                             static_cast<double>(options.tokens_per_step / ranks) * 4.0 * floats_per_token,
                             "each rank's share, one float per hidden unit and layer kept for the backward",
                             group->device());
        if (options.sample_every > 0) {
          // Rank 0's samples: the rollout engine allocates them up front, which would fail mid-run as
          // "std::bad_alloc" on rank 0 alone. Every rank checks (against its own device, the same kind as rank 0's),
          // so that the refusal is every rank's rather than one rank's abort.
          check_fits_in_memory("--sample-tokens",
                               static_cast<double>(train::sample_state_bytes(options, group->device())),
                               "a sample's key/value caches and recurrent states, its prompt's first token and " +
                                   std::to_string(options.sample_tokens) + " more",
                               group->device());
        }
        std::unique_ptr<Reporter> reporter;  // on every rank's watch: a log rank 0 cannot open stops them all
        comm::collectively(*group, [&] {
          if (rank == 0) reporter = std::make_unique<Reporter>(args, options);
        });
        const train::TrainResult result = train::train(*group, options, reporter.get(), stop_requested);
        if (rank == 0) {
          reporter->end_bar();
          print_result(std::string(result.stopped ? "stopped on a signal" : "done") + " at step " +
                           std::to_string(result.step),
                       result.digest);
        }
      },
      args.log, args.chart);
}

}  // namespace

void add_train_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("train", "train the model data-parallel on every rank that mpirun starts (or one rank)");
  auto args = std::make_shared<TrainArgs>();
  cmd->add_option("--config", args->config, "a preset (tiny, qwen3.5-0.8b), a config.json, or a model directory")->required();
  cmd->add_option("--data", args->data, "directory of train-*.bin, val.bin and vocab.bin (prepare_text.py)")->required();
  cmd->add_option("--steps", args->steps, "train until the optimizer's step reaches this")->capture_default_str();
  cmd->add_option("--tokens-per-step", args->tokens_per_step, "global tokens per step, a multiple of seq-len x ranks")
      ->capture_default_str();
  cmd->add_option("--seq-len", args->seq_len, "tokens per packed row; no sequence is longer")->capture_default_str();
  cmd->add_option("--lr", args->lr, "peak learning rate")->capture_default_str();
  cmd->add_option("--warmup", args->warmup, "steps of linear warmup")->capture_default_str();
  cmd->add_option("--schedule", args->schedule, "after warmup: cosine (to min-lr-ratio x lr) or constant")
      ->capture_default_str();
  cmd->add_option("--min-lr-ratio", args->min_lr_ratio, "cosine's final rate as a fraction of lr")->capture_default_str();
  cmd->add_option("--weight-decay", args->weight_decay, "AdamW's decoupled weight decay")->capture_default_str();
  cmd->add_option("--clip", args->clip, "clip the global gradient norm to this (0: off)")->capture_default_str();
  CLI::Option* ckpt = cmd->add_option("--ckpt", args->ckpt, "checkpoint root: one directory per step and `latest`");
  cmd->add_option("--save-every", args->save_every, "save every N steps (0: at the end only)")->needs(ckpt);
  cmd->add_option("--resume", args->resume, "a checkpoint directory, a root with `latest`, or `latest` (of --ckpt)");
  cmd->add_option("--eval-every", args->eval_every, "validation loss every N steps (0: never)")->capture_default_str();
  cmd->add_option("--eval-batches", args->eval_batches, "fixed validation batches per evaluation")->capture_default_str();
  cmd->add_option("--sample-every", args->sample_every, "print a generated sample every N steps (0: never)")
      ->capture_default_str();
  cmd->add_option("--sample-tokens", args->sample_tokens, "tokens per sample")->capture_default_str();
  cmd->add_option("--temperature", args->temperature, "sampling temperature (0: greedy)")->capture_default_str();
  cmd->add_option("--log", args->log, "JSONL log: one object per step, evaluation and sample");
  cmd->add_option("--chart", args->chart, "loss chart PNG (default: the log's name with .png; none: no chart)");
  cmd->add_option("--seed", args->seed, "initial weights, data order and samples")
      ->capture_default_str()
      ->check(kNoSign);
  cmd->add_option("--threads", args->threads, "CPU threads per rank (0: the cores divided by the local ranks)")
      ->capture_default_str();
  cmd->add_option("--peak-flops", args->peak_flops,
                  "peak FLOP/s of one rank's device, for MFU (0: the known peak of an H100/H200/A100, else no MFU)")
      ->capture_default_str();
  cmd->add_option("--device", args->device, "cpu (MPI ranks) or cuda (one GPU per rank, NCCL)")->capture_default_str();
  cmd->callback([args] { run_train_command(*args); });
}

}  // namespace deltatrain::tools
