#include "deltatrain/rollout/engine.h"

#include <algorithm>
#include <set>
#include <string>
#include <utility>

#include "arena.h"  // model/: the logits' memory, from the model's allocator
#include "deltatrain/core/error.h"

namespace deltatrain::rollout {

const char* finish_reason_name(FinishReason reason) { return reason == FinishReason::stop ? "stop" : "length"; }

StepPlan plan_step(std::span<const SlotPhase> slots, std::span<const std::int64_t> waiting_prompt_lengths,
                   std::int64_t max_prefill_tokens) {
  StepPlan plan;
  std::vector<std::int64_t> free;
  for (std::size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] == SlotPhase::finished) plan.retire.push_back(static_cast<std::int64_t>(s));
    if (slots[s] != SlotPhase::running) free.push_back(static_cast<std::int64_t>(s));
  }
  std::int64_t tokens = 0;
  for (std::size_t w = 0; w < waiting_prompt_lengths.size() && plan.admit.size() < free.size(); ++w) {
    if (!plan.admit.empty() && tokens + waiting_prompt_lengths[w] > max_prefill_tokens) break;
    tokens += waiting_prompt_lengths[w];
    plan.admit.push_back({w, free[plan.admit.size()]});
  }
  return plan;
}

Engine::Engine(const model::Config& config, const model::ModelOptions& model_options,
               const model::TensorLookup& params, const EngineOptions& options)
    : config_(config), options_(options) {
  model::validate(config);
  if (options.max_batch < 1) throw InvalidArgument("max_batch", "must be at least 1, got " + std::to_string(options.max_batch));
  if (options.max_length < 1 || options.max_length > INT32_MAX)
    throw InvalidArgument("max_length", "must be in [1, 2^31 - 1], got " + std::to_string(options.max_length));
  if (options.cache_budget < 0)
    throw InvalidArgument("cache_budget", "must be >= 0 bytes (0: no limit), got " + std::to_string(options.cache_budget));
  if (options.max_prefill_tokens < 1)
    throw InvalidArgument("max_prefill_tokens", "must be at least 1, got " + std::to_string(options.max_prefill_tokens));
  const std::int64_t bytes = model::InferenceState::bytes(config, model_options, options.max_batch, options.max_length);
  if (options.cache_budget > 0 && bytes > options.cache_budget) {
    throw InvalidArgument("max_batch", std::to_string(options.max_batch) + " slots of max_length " +
                                           std::to_string(options.max_length) + " take " + std::to_string(bytes) +
                                           " bytes, over the cache_budget of " + std::to_string(options.cache_budget));
  }
  model::ModelOptions engine_options = model_options;
  if (model_options.device.type != DeviceType::cpu && model_options.stream == nullptr && model_options.cuda_graphs) {
    stream_ = std::make_unique<model::DeviceStream>(model_options.device);
    engine_options.stream = stream_->get();
  }
  model_ = std::make_unique<model::Model>(config, engine_options);
  model_->bind(params);
  state_ = std::make_unique<model::InferenceState>(config, engine_options, options.max_batch, options.max_length);
  logits_memory_ = std::make_unique<model::Arena>(engine_options.device, engine_options.memory);
  logits_ = logits_memory_->allocate(engine_options.dtype, {options.max_batch, config.vocab_size});
  overlap_ = options.overlap_steps && engine_options.device.type != DeviceType::cpu;
  if (overlap_) next_tokens_ = logits_memory_->allocate(DType::i32, {options.max_batch});
  slots_.resize(options.max_batch);
}

Engine::~Engine() = default;

void Engine::validate_request(const Request& r) const {
  const std::string where = "request " + std::to_string(r.id);
  if (r.prompt.empty()) throw InvalidArgument(where + ": prompt", "must hold at least one token");
  for (std::size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= config_.vocab_size) {
      throw InvalidArgument(where + ": prompt", "token " + std::to_string(i) + " is " + std::to_string(r.prompt[i]) +
                                                    ", outside the vocabulary [0, " +
                                                    std::to_string(config_.vocab_size) + ")");
    }
  }
  for (const std::int32_t t : r.stop_tokens) {
    if (t < 0 || t >= config_.vocab_size) {
      throw InvalidArgument(where + ": stop_tokens", std::to_string(t) + " is outside the vocabulary [0, " +
                                                         std::to_string(config_.vocab_size) + ")");
    }
  }
  if (r.max_new_tokens < 1) {
    throw InvalidArgument(where + ": max_new_tokens", "must be at least 1, got " + std::to_string(r.max_new_tokens));
  }
  // The last token is drawn from logits and never fed back, so the slot holds prompt + max_new_tokens - 1.
  const std::int64_t needed = std::ssize(r.prompt) + r.max_new_tokens - 1;
  if (needed > options_.max_length) {
    throw InvalidArgument(where + ": prompt", "of " + std::to_string(r.prompt.size()) + " tokens plus max_new_tokens " +
                                                  std::to_string(r.max_new_tokens) +
                                                  " - 1 must fit a slot's max_length (" +
                                                  std::to_string(options_.max_length) + ")");
  }
  validate(r.sampling, where + ": sampling");
  const auto same_id = [&](const Request& other) { return other.id == r.id; };
  const bool in_slots = std::any_of(slots_.begin(), slots_.end(),
                                    [&](const std::optional<Running>& s) { return s && s->request.id == r.id; });
  if (in_slots || std::any_of(waiting_.begin(), waiting_.end(), same_id)) {
    throw InvalidArgument(where + ": id", "is already queued or running (ids name completions and key the draws)");
  }
}

void Engine::submit(const Request& request) {
  validate_request(request);
  waiting_.push_back(request);
}

bool Engine::idle() const {
  return waiting_.empty() && std::none_of(slots_.begin(), slots_.end(), [](const auto& s) { return s.has_value(); });
}

std::vector<Completion> Engine::take_finished() { return std::exchange(finished_, {}); }

TensorView Engine::logit_rows(std::int64_t rows) const {
  return TensorView::contiguous(logits_.data, logits_.dtype, {rows, config_.vocab_size}, logits_.device);
}

std::vector<RowSampling> Engine::sampling_rows(std::span<const std::int32_t> slots, int ahead) const {
  std::vector<RowSampling> rows(slots.size());
  for (std::size_t n = 0; n < slots.size(); ++n) {
    const Running& r = *slots_[slots[n]];
    const SamplingParams& p = r.request.sampling;
    const auto index = static_cast<std::uint64_t>(r.completion.tokens.size()) + static_cast<std::uint64_t>(ahead);
    rows[n] = {p, uniform(p.seed, r.request.id, index), r.request.untempered_logprobs};
  }
  return rows;
}

std::int64_t Engine::accept(std::span<const std::int32_t> slots, const std::vector<Sample>& samples) {
  std::int64_t accepted = 0;
  for (std::size_t n = 0; n < slots.size(); ++n) {
    Running& r = *slots_[slots[n]];
    if (r.finished) continue;
    Completion& c = r.completion;
    const Sample& s = samples[n];
    c.tokens.push_back(s.token);
    c.logprobs.push_back(s.logprob);
    if (r.request.untempered_logprobs) c.untempered_logprobs.push_back(s.untempered_logprob);
    ++accepted;
    const auto& stops = r.request.stop_tokens;
    if (std::find(stops.begin(), stops.end(), s.token) != stops.end()) {
      c.finish = FinishReason::stop;
      r.finished = true;
    } else if (std::ssize(c.tokens) >= r.request.max_new_tokens) {
      c.finish = FinishReason::length;
      r.finished = true;
    }
  }
  return accepted;
}

// The batch stays the same: nothing waiting could take a free slot, and every sequence of the in-flight step is
// still running and wants a token after the one in flight (a sequence at its max_new_tokens must not take another
// position; one that stops on a token is found only when its sample is read, and then runs one step more).
bool Engine::continues_on_device() const {
  if (in_flight_.empty()) return false;
  const bool slot_free = std::any_of(slots_.begin(), slots_.end(), [](const auto& s) { return !s.has_value(); });
  if (!waiting_.empty() && slot_free) return false;
  return std::all_of(in_flight_.begin(), in_flight_.end(), [&](std::int32_t slot) {
    const Running& r = *slots_[slot];
    return !r.finished && std::ssize(r.completion.tokens) + 1 < r.request.max_new_tokens;
  });
}

std::int64_t Engine::step() {
  void* const stream = model_->options().stream;
  std::int32_t* const device_tokens = overlap_ ? next_tokens_.ptr<std::int32_t>() : nullptr;
  if (continues_on_device()) {
    // Queue the next step from the in-flight step's tokens (the decode copies them into its input before the
    // sampling below overwrites them: one stream), then read the in-flight step's samples while the GPU works.
    const std::span<const std::int32_t> slots = in_flight_;  // the same slots stay in flight
    const TensorView logits = logit_rows(std::ssize(slots));
    model_->decode(device_tokens, slots, *state_, logits);
    sampler_.launch(logits, sampling_rows(slots, 1), stream, device_tokens);
    return accept(slots, sampler_.collect());
  }
  std::int64_t generated = 0;
  if (!in_flight_.empty()) {
    generated += accept(in_flight_, sampler_.collect());
    in_flight_.clear();
  }

  std::vector<SlotPhase> phases(slots_.size(), SlotPhase::free);
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    if (slots_[s]) phases[s] = slots_[s]->finished ? SlotPhase::finished : SlotPhase::running;
  }
  std::vector<std::int64_t> lengths;
  for (const Request& r : waiting_) lengths.push_back(std::ssize(r.prompt));
  const StepPlan plan = plan_step(phases, lengths, options_.max_prefill_tokens);

  for (const std::int64_t slot : plan.retire) {
    finished_.push_back(std::move(slots_[slot]->completion));
    slots_[slot].reset();
    state_->release(slot);
  }
  // Decoded this step: the sequences already running (the admitted ones draw their first token from the prefill).
  std::vector<std::int32_t> decode_slots, decode_tokens;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    if (slots_[s] && !slots_[s]->finished) {
      decode_slots.push_back(static_cast<std::int32_t>(s));
      decode_tokens.push_back(slots_[s]->completion.tokens.back());
    }
  }
  if (!plan.admit.empty()) {
    std::vector<std::int32_t> tokens, cu{0}, slots;
    for (const Admission& a : plan.admit) {
      const Request& r = waiting_[a.waiting];
      tokens.insert(tokens.end(), r.prompt.begin(), r.prompt.end());
      cu.push_back(static_cast<std::int32_t>(tokens.size()));
      slots.push_back(static_cast<std::int32_t>(a.slot));
    }
    model_->prefill({tokens, cu}, slots, *state_, logit_rows(std::ssize(slots)));
    // Admission takes the requests off the queue only once their prefill succeeded.
    for (std::size_t i = 0; i < plan.admit.size(); ++i) {
      const Request& r = waiting_[plan.admit[i].waiting];
      Completion started;
      started.id = r.id;
      slots_[plan.admit[i].slot] = Running{r, std::move(started), false};
    }
    generated += accept(slots, sampler_.sample(logit_rows(std::ssize(slots)), sampling_rows(slots, 0), stream));
    waiting_.erase(waiting_.begin(), waiting_.begin() + static_cast<std::ptrdiff_t>(plan.admit.size()));
  }
  if (!decode_slots.empty()) {
    const TensorView logits = logit_rows(std::ssize(decode_slots));
    model_->decode(decode_tokens, decode_slots, *state_, logits);
    if (overlap_) {
      sampler_.launch(logits, sampling_rows(decode_slots, 0), stream, device_tokens);
      in_flight_ = std::move(decode_slots);
    } else {
      generated += accept(decode_slots, sampler_.sample(logits, sampling_rows(decode_slots, 0), stream));
    }
  }
  return generated;
}

std::vector<Completion> Engine::generate(std::span<const Request> requests) {
  std::set<std::uint64_t> ids;
  for (const Request& r : requests) {
    validate_request(r);
    if (!ids.insert(r.id).second) {
      throw InvalidArgument("request " + std::to_string(r.id) + ": id", "appears twice in the requests");
    }
  }
  for (const Request& r : requests) waiting_.push_back(r);
  while (!idle()) step();
  std::vector<Completion> done = take_finished();
  std::vector<Completion> ordered;
  for (const Request& r : requests) {
    const auto it = std::find_if(done.begin(), done.end(), [&](const Completion& c) { return c.id == r.id; });
    ordered.push_back(std::move(*it));
    done.erase(it);
  }
  // Completions of requests submitted earlier stay for take_finished().
  finished_ = std::move(done);
  return ordered;
}

}  // namespace deltatrain::rollout
