// The trainer: data-parallel training of the hybrid GDN model over a communicator group, with the
// schedule, evaluation, samples and crash-safe, reshardable, bitwise-resumable checkpoints.
//
//   auto group = comm::make_mpi_group(MPI_COMM_WORLD);
//   train::TrainOptions options{.config = model::preset("tiny"), .data = "data/shakespeare", ...};
//   train::TrainResult result = train::train(*group, options, &observer, stop_requested);
//
// Every rank runs the same calls. The library prints nothing: progress goes to the Observer, on every rank
// (callers print on rank 0).
//
// A checkpoint is a directory per step under `checkpoint_root`:
//   step-00000010/model/          config.json + model.safetensors (HF format, float32)
//   step-00000010/optimizer/      the optimizer's sharded checkpoint (optim/checkpoint.h)
//   step-00000010/trainer.json    step, data position, seed and the settings a resume must share
//   latest                        "step-00000010", replaced last
// written as .tmp-step-00000010, fsynced and renamed, so a process killed or a disk that fills mid-save
// leaves the previous checkpoint and `latest` intact.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "deltatrain/comm/group.h"
#include "deltatrain/core/tensor.h"
#include "deltatrain/model/config.h"
#include "deltatrain/optim/digest.h"
#include "deltatrain/train/plan.h"
#include "deltatrain/train/schedule.h"

namespace deltatrain::train {

// The model parameters' dtype, the one place it is chosen: float32 on the CPU (the optimizer keeps float32
// main weights and moments either way). The GPU model will take bf16 here.
inline constexpr DType kParamDType = DType::f32;

struct TrainOptions {
  model::Config config;
  std::filesystem::path data;
  std::int64_t steps = 0;             // train until the optimizer's step reaches this
  std::int64_t tokens_per_step = 0;   // global; a multiple of seq_len * ranks
  std::int64_t seq_len = 0;
  Schedule schedule;                  // total_steps is taken from `steps`
  double weight_decay = 0.1;
  double clip = 1.0;                  // global gradient norm; 0: no clipping
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  std::uint64_t seed = 1234;          // initial weights, data order, samples
  std::filesystem::path checkpoint_root;  // empty: no checkpoints
  std::int64_t save_every = 0;        // 0: only at the end (and on a stop request) when checkpoint_root is set
  std::filesystem::path resume;       // a step directory, or a root whose `latest` names one; empty: fresh start
  std::int64_t eval_every = 0;        // 0: no evaluation
  std::int64_t eval_batches = 4;      // fixed validation batches of tokens_per_step tokens each
  std::int64_t sample_every = 0;      // 0: no samples
  std::int64_t sample_tokens = 48;
  std::int64_t prompt_tokens = 16;    // the prompt: the start of the first validation document
  double temperature = 0;             // 0: greedy
  int cpu_threads = 0;                // 0: all available
};

// InvalidArgument naming the flag (steps, tokens-per-step, seq-len, ...) for values out of range.
void check_options(const TrainOptions& options, int dp_size);

struct StartReport {
  std::int64_t step = 0;     // where training starts (non-zero after a resume)
  std::filesystem::path resumed_from;  // empty for a fresh start
  std::int64_t parameters = 0;
  std::int64_t train_tokens = 0;  // in the training shards
  int dp_size = 1;
};

struct StepReport {
  std::int64_t step = 0;     // the optimizer's step after this one (1 for the first)
  double loss = 0;           // mean over every target of the global batch
  double lr = 0;
  double grad_norm = 0;      // before clipping
  std::int64_t tokens = 0;   // global tokens of this step
  double seconds = 0;        // wall time of this step
  double elapsed = 0;        // since training (re)started
};

struct EvalReport {
  std::int64_t step = 0;
  double val_loss = 0;
  std::int64_t tokens = 0;
};

struct SampleReport {
  std::int64_t step = 0;
  std::vector<std::int32_t> prompt, completion;
  std::string prompt_text, completion_text;  // decoded with the data directory's vocab.bin (empty without it)
};

class Observer {
 public:
  virtual ~Observer() = default;
  virtual void on_start(const StartReport&) {}
  virtual void on_step(const StepReport&) {}
  virtual void on_eval(const EvalReport&) {}
  virtual void on_sample(const SampleReport&) {}
  virtual void on_save(std::int64_t step, const std::filesystem::path& dir) {}
};

struct TrainResult {
  std::int64_t step = 0;
  bool stopped = false;                    // a stop request ended training before `steps`
  std::filesystem::path last_checkpoint;   // the last one this run wrote, if any
  optim::StateDigest digest;               // of the final optimizer state (dp-size independent)
};

// Collective. `stop_requested` is polled on every rank between steps; when it is true on any rank, every
// rank finishes the step, saves (with a checkpoint root) and returns with `stopped`. A failed save raises
// Failure saying why and naming the checkpoint that stays the latest.
TrainResult train(comm::Group& group, const TrainOptions& options, Observer* observer = nullptr,
                  const std::function<bool()>& stop_requested = {});

// The trainer state of a checkpoint (trainer.json).
struct TrainerState {
  std::int64_t step = 0;
  DataPosition data;
  std::uint64_t seed = 0;
  std::int64_t tokens_per_step = 0;
  std::int64_t seq_len = 0;
  int dp_size = 1;             // at save; a resume may use another
  std::string config_json;     // model::config_to_hf_json of the model
  std::string data_fingerprint;
};
std::string state_to_json(const TrainerState& state);
// Failure naming `source` when the text is not a trainer state.
TrainerState state_from_json(const std::string& text, const std::string& source);

// The step directory `path` denotes: itself when it holds trainer.json, else what its `latest` names.
// Failure naming the path otherwise.
std::filesystem::path resolve_train_checkpoint(const std::filesystem::path& path);

}  // namespace deltatrain::train
