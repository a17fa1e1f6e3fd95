// `deltatrain generate --config NAME|PATH --weights DIR --prompt-ids 1,2,3 [--prompt-ids ...]`: completions of
// token-id prompts on the CPU by the rollout engine (continuous batching over --batch slots), each token with
// its logprob under the sampling distribution and under the model's plain softmax.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "deltatrain/core/error.h"
#include "deltatrain/model/config.h"
#include "deltatrain/model/hf_checkpoint.h"
#include "deltatrain/model/inference.h"
#include "deltatrain/model/params.h"
#include "deltatrain/rollout/engine.h"

namespace deltatrain::tools {
namespace {

struct GenerateArgs {
  std::string config, weights, dtype = "float32";
  std::vector<std::string> prompts;
  std::vector<std::int32_t> stop_ids;
  std::int32_t max_new_tokens = 32;
  double temperature = 1.0, top_p = 1.0;
  std::int32_t top_k = 0;
  std::uint64_t seed = 0;
  std::int64_t batch = 8, max_length = 0;
  int threads = 0;
  bool json = false;
};

// "1,2,3" -> {1, 2, 3}; InvalidArgument naming --prompt-ids for anything else.
std::vector<std::int32_t> parse_ids(const std::string& text) {
  std::vector<std::int32_t> ids;
  std::stringstream in(text);
  std::string item;
  const auto refuse = [&] {
    throw InvalidArgument("--prompt-ids", "must be comma-separated token ids, got \"" + text + "\"");
  };
  while (std::getline(in, item, ',')) {
    try {
      std::size_t used = 0;
      const long value = std::stol(item, &used);
      if (used != item.size() || value < INT32_MIN || value > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(static_cast<std::int32_t>(value));
    } catch (const std::logic_error&) {
      refuse();
    }
  }
  // getline drops an empty last item ("1,2,"): one id more than commas, or a token is missing.
  if (std::ssize(ids) != std::count(text.begin(), text.end(), ',') + 1) refuse();
  return ids;
}

void generate(const GenerateArgs& args) {
  if (args.max_length < 0) {
    throw InvalidArgument("--max-length", "must be >= 0 (0: the longest prompt + max-new-tokens - 1), got " +
                                              std::to_string(args.max_length));
  }
  const DType dtype = args.dtype == "float64" ? DType::f64 : DType::f32;
  const model::Config config = load_config_flag(args.config);
  model::ParamStore store(config, dtype);
  model::load_hf_weights(args.weights, config, store.params());

  std::vector<rollout::Request> requests;
  std::int64_t longest = 0;
  for (std::size_t i = 0; i < args.prompts.size(); ++i) {
    rollout::Request r;
    r.id = i;
    r.prompt = parse_ids(args.prompts[i]);
    r.max_new_tokens = args.max_new_tokens;
    r.stop_tokens = args.stop_ids;
    r.sampling = {.temperature = args.temperature, .top_p = args.top_p, .top_k = args.top_k, .seed = args.seed};
    r.untempered_logprobs = true;
    longest = std::max<std::int64_t>(longest, std::ssize(r.prompt));
    requests.push_back(std::move(r));
  }
  // By default a slot holds the longest prompt and its completion.
  const std::int64_t max_length = args.max_length > 0 ? args.max_length : longest + std::max(args.max_new_tokens, 1) - 1;
  const model::ModelOptions model_options{.dtype = dtype, .cpu_threads = args.threads};
  const rollout::EngineOptions engine_options{.max_batch = args.batch, .max_length = std::max<std::int64_t>(max_length, 1)};
  // One slot's state times the slots, in double: an absurd --batch would overflow the product in 64 bits.
  check_fits_in_memory(args.max_length > 0 ? "--max-length" : "--max-new-tokens",
                       static_cast<double>(model::InferenceState::bytes(config, model_options, 1,
                                                                        engine_options.max_length)) *
                           static_cast<double>(engine_options.max_batch),
                       "the slots' key/value caches and recurrent states, " + std::to_string(max_length) +
                           " positions per slot",
                       model_options.device);
  rollout::Engine engine(config, model_options, store.params(), engine_options);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<rollout::Completion> out = engine.generate(requests);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::int64_t generated = 0;
  for (const rollout::Completion& c : out) generated += std::ssize(c.tokens);

  if (args.json) {
    nlohmann::ordered_json j;
    j["config"] = args.config;
    j["sampling"] = {{"temperature", args.temperature}, {"top_p", args.top_p}, {"top_k", args.top_k}, {"seed", args.seed}};
    j["completions"] = nlohmann::json::array();
    for (std::size_t i = 0; i < out.size(); ++i) {
      j["completions"].push_back({{"prompt", requests[i].prompt},
                                  {"tokens", out[i].tokens},
                                  {"logprobs", out[i].logprobs},
                                  {"untempered_logprobs", out[i].untempered_logprobs},
                                  {"finish", rollout::finish_reason_name(out[i].finish)}});
    }
    j["tokens"] = generated;
    j["seconds"] = seconds;
    j["tokens_per_second"] = seconds > 0 ? generated / seconds : 0.0;
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::printf("sequence %zu (%zu prompt tokens, finish: %s)\n  tokens:  ", i, requests[i].prompt.size(),
                rollout::finish_reason_name(out[i].finish));
    for (const std::int32_t t : out[i].tokens) std::printf(" %d", t);
    std::printf("\n  logprob: ");
    for (const double l : out[i].logprobs) std::printf(" %.4f", l);
    std::printf("\n  untempered logprob: ");
    for (const double l : out[i].untempered_logprobs) std::printf(" %.4f", l);
    std::printf("\n");
  }
  std::printf("%lld tokens in %.3f s (%.1f tokens/s)\n", static_cast<long long>(generated), seconds,
              seconds > 0 ? generated / seconds : 0.0);
}

}  // namespace

void add_generate_command(CLI::App& parent) {
  CLI::App* command = parent.add_subcommand(
      "generate", "complete token-id prompts on the CPU (rollout engine: continuous batching, sampling, logprobs)");
  auto args = std::make_shared<GenerateArgs>();
  command->add_option("--config", args->config, "a preset (tiny, qwen3.5-0.8b), a config.json, or a directory holding one")
      ->required();
  command->add_option("--weights", args->weights, "an HF model directory (model.safetensors)")->required();
  command->add_option("--prompt-ids", args->prompts, "a prompt's token ids, comma-separated; repeat for more prompts")
      ->required();
  command->add_option("--max-new-tokens", args->max_new_tokens, "tokens to generate per prompt at most")
      ->capture_default_str();
  command->add_option("--temperature", args->temperature, "0: greedy")->capture_default_str();
  command->add_option("--top-p", args->top_p, "nucleus: the most probable tokens up to this mass")->capture_default_str();
  command->add_option("--top-k", args->top_k, "only the k most probable tokens (0: all)")->capture_default_str();
  command->add_option("--seed", args->seed, "the draws' seed (with each prompt's index)")
      ->capture_default_str()
      ->check(kNoSign);
  command->add_option("--stop-ids", args->stop_ids, "token ids that end a sequence")->delimiter(',');
  command->add_option("--batch", args->batch, "slots: sequences decoded together")->capture_default_str();
  command->add_option("--max-length", args->max_length, "positions per slot (0: the longest prompt + max-new-tokens - 1)")
      ->capture_default_str();
  command->add_option("--dtype", args->dtype, "float32 or float64")
      ->check(CLI::IsMember({"float32", "float64"}))
      ->capture_default_str();
  command->add_option("--threads", args->threads, "CPU threads (0: all)")->capture_default_str();
  command->add_flag("--json", args->json, "the completions as JSON");
  command->callback([args] { generate(*args); });
}

}  // namespace deltatrain::tools
