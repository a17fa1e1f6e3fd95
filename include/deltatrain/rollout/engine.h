// The rollout engine: generates completions of prompts (token ids) with the model's parameters in place (the
// trainer's, bound by name; nothing is copied or serialised), by continuous batching over cache slots.
//
//   rollout::Engine engine(config, {.dtype = DType::f32}, store.params(), {.max_batch = 8, .max_length = 512});
//   std::vector<rollout::Completion> out = engine.generate(requests);   // in the requests' order
//
// or step by step, with requests arriving while others run:
//
//   engine.submit(request);  ...  while (!engine.idle()) { engine.step(); for (auto& c : engine.take_finished()) ...; }
//
// Each sequence lives in one of max_batch slots of a model::InferenceState (its GDN and conv states, its K/V
// cache of max_length positions). A step retires the finished sequences, admits waiting requests into free
// slots (one packed prefill, which gives each its first token), then decodes one token for every other
// running sequence. The logits stay on the model's device: one BatchSampler call draws every row's token there
// and only the tokens and logprobs come back. What a sequence generates depends only on its request: the
// model's function of its own tokens and the draws keyed by (seed, id, token index); never on the batch around
// it. On a GPU with model_options.cuda_graphs (the default), a decode step replays a CUDA graph recorded for its
// batch size (Model::decode): the same tokens, a fraction of the launches. Graphs need a stream other than the
// legacy default: the caller's (model_options.stream), or else one the engine makes (model::DeviceStream, ordered
// with the legacy stream's work both ways, so weights a trainer updates there are read after the update). With
// EngineOptions::overlap_steps (the default) a GPU step also queues the next decode from its sampled tokens on the
// device before the host reads them, so the GPU does not wait for the host between steps (step() says how).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "deltatrain/model/config.h"
#include "deltatrain/model/inference.h"
#include "deltatrain/model/model.h"
#include "deltatrain/model/params.h"
#include "deltatrain/rollout/sampling.h"

namespace deltatrain::model {
class Arena;
class DeviceStream;
}

namespace deltatrain::rollout {

struct EngineOptions {
  std::int64_t max_batch = 8;         // slots: sequences decoded together
  std::int64_t max_length = 1024;     // positions a slot holds: prompt + max_new_tokens - 1 must fit
  std::int64_t cache_budget = 0;      // bytes the slots' states may take on the device (0: no limit)
  std::int64_t max_prefill_tokens = 4096;  // prompt tokens packed into one prefill (a longer prompt runs alone)
  // On a GPU, queue each decode step before reading the previous step's samples (step()); the same completions
  // either way, bit for bit.
  bool overlap_steps = true;
};

struct Request {
  std::uint64_t id = 0;  // names the completion and keys its draws
  std::vector<std::int32_t> prompt;
  std::int32_t max_new_tokens = 16;  // >= 1
  std::vector<std::int32_t> stop_tokens;  // the first one generated ends the sequence (and is kept)
  SamplingParams sampling;
  bool untempered_logprobs = false;  // also return log p under the model's plain softmax
};

enum class FinishReason : std::uint8_t { stop, length };
const char* finish_reason_name(FinishReason reason);  // "stop", "length"

struct Completion {
  std::uint64_t id = 0;
  std::vector<std::int32_t> tokens;
  std::vector<double> logprobs;             // of each token under the distribution it was drawn from
  std::vector<double> untempered_logprobs;  // when requested: under softmax(logits)
  FinishReason finish = FinishReason::length;
};

// The scheduler's decision for one step: a pure function of the slots and the queue.
enum class SlotPhase : std::uint8_t { free, running, finished };
struct Admission {
  std::size_t waiting = 0;  // index in the queue
  std::int64_t slot = 0;
};
struct StepPlan {
  std::vector<std::int64_t> retire;  // finished slots, freed before admission
  std::vector<Admission> admit;
};
// Every finished slot retires. Waiting requests are admitted first come, first served (none skipped, so no
// request waits behind a later one) into the free slots in increasing order, while their prompts' total stays
// within max_prefill_tokens; the first admission of a step is always allowed, so a long prompt is not stuck.
StepPlan plan_step(std::span<const SlotPhase> slots, std::span<const std::int64_t> waiting_prompt_lengths,
                   std::int64_t max_prefill_tokens);

class Engine {
 public:
  // Binds a model of `config` and `model_options` to `params` (TensorLookup: in place, e.g. the trainer's
  // buffers) and allocates the slots' state once. InvalidArgument names the option whose value is out of range
  // or the state that does not fit cache_budget.
  Engine(const model::Config& config, const model::ModelOptions& model_options, const model::TensorLookup& params,
         const EngineOptions& options);
  ~Engine();

  // Queues a request. InvalidArgument (naming the field, e.g. "request 7: prompt") leaves the engine unchanged.
  void submit(const Request& request);
  // One scheduler step (retire, admit + prefill, decode). Returns the number of tokens generated and accepted into
  // completions. On a GPU a decode step's samples are accepted by the next call: while the batch stays the same, that
  // call queues the following decode step from the sampled tokens on the device before it reads them, so the GPU does
  // not wait for the host between steps (a sequence that stopped runs one step more, whose token is dropped).
  std::int64_t step();
  bool idle() const;  // nothing waiting, nothing in a slot
  std::vector<Completion> take_finished();  // in the order they finished

  // Submits every request (all validated first: one invalid request refuses the call before any work), steps
  // until they are done and returns their completions in the requests' order.
  std::vector<Completion> generate(std::span<const Request> requests);

  const EngineOptions& options() const { return options_; }
  bool uses_cuda_graphs() const { return model_->decode_uses_cuda_graphs(); }  // for decode steps

 private:
  struct Running {
    Request request;
    Completion completion;
    bool finished = false;
  };
  void validate_request(const Request& request) const;
  // How each sequence in `slots` draws its next token, `ahead` draws after those already accepted.
  std::vector<RowSampling> sampling_rows(std::span<const std::int32_t> slots, int ahead) const;
  // Records sample n as the next token of the sequence in slots[n], unless that sequence has finished (a sample of
  // the step past its stop); returns how many it recorded.
  std::int64_t accept(std::span<const std::int32_t> slots, const std::vector<Sample>& samples);
  // Whether the next decode step may be queued from the in-flight step's tokens on the device (see step()).
  bool continues_on_device() const;
  TensorView logit_rows(std::int64_t rows) const;  // the first `rows` rows of logits_

  model::Config config_;
  EngineOptions options_;
  std::unique_ptr<model::DeviceStream> stream_;  // the engine's own, when the caller named none (before model_:
                                                 // destroyed after it)
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<model::InferenceState> state_;
  std::deque<Request> waiting_;
  std::vector<std::optional<Running>> slots_;
  std::vector<Completion> finished_;
  std::unique_ptr<model::Arena> logits_memory_;
  TensorView logits_;  // [max_batch, vocab] in the model's dtype on its device
  BatchSampler sampler_;
  bool overlap_ = false;  // on a GPU: decode steps' samples are launched here and accepted by the next step()
  TensorView next_tokens_;              // int32 [max_batch] on the GPU: the in-flight step's sampled tokens
  std::vector<std::int32_t> in_flight_;  // the slots of the decode step whose samples are in flight (empty: none)
};

}  // namespace deltatrain::rollout
