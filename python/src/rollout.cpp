// The rollout engine's binding, `_deltatrain.rollout`: an Engine over a model's parameters in place (a
// `_deltatrain.model.Model`'s, viewed by name, nothing copied), or over parameters of its own built from a config
// and an HF weights directory; generate() completes token-id prompts. The GIL is released while it generates.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "deltatrain/core/error.h"
#include "deltatrain/model/config.h"
#include "deltatrain/model/hf_checkpoint.h"
#include "deltatrain/model/params.h"
#include "deltatrain/rollout/engine.h"
#include "tensor.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace deltatrain::python {
namespace {

class PyEngine {
 public:
  // model: a config (preset name, config.json or directory) with `weights` an HF directory (or None: HF's
  // initialisation from `seed`), or a _deltatrain.model.Model whose parameters are used in place.
  PyEngine(nb::handle model, const std::optional<std::string>& weights, const std::string& dtype, std::int64_t max_batch,
           std::int64_t max_length, std::int64_t cache_budget, std::int64_t max_prefill_tokens, int cpu_threads,
           std::uint64_t seed, bool batch_invariant) {
    const rollout::EngineOptions options{.max_batch = max_batch, .max_length = max_length, .cache_budget = cache_budget,
                                         .max_prefill_tokens = max_prefill_tokens};
    if (nb::isinstance<nb::str>(model)) {
      if (dtype != "float32" && dtype != "float64")
        throw InvalidArgument("dtype", "the CPU model computes in \"float32\" or \"float64\", got \"" + dtype + "\"");
      config_ = model::load_config(nb::cast<std::string>(model));
      store_ = std::make_unique<model::ParamStore>(config_, dtype == "float64" ? DType::f64 : DType::f32);
      if (weights) {
        nb::gil_scoped_release unlocked;
        model::load_hf_weights(*weights, config_, store_->params());
      } else {
        store_->init(config_.initializer_range, seed);
      }
      engine_ = std::make_unique<rollout::Engine>(
          config_, model::ModelOptions{.dtype = store_->dtype(), .cpu_threads = cpu_threads, .batch_invariant = batch_invariant},
          store_->params(), options);
      return;
    }
    if (!nb::hasattr(model, "config_json") || !nb::hasattr(model, "param")) {
      throw InvalidArgument("model", "a config (preset name, config.json or a directory holding one, as a str) or a "
                                     "deltatrain Model, got an object of type " +
                                         nb::cast<std::string>(nb::str(model.type().attr("__name__"))));
    }
    if (weights) throw InvalidArgument("weights", "applies to a config; a Model brings its own parameters");
    config_ = model::config_from_hf_json(nb::cast<std::string>(model.attr("config_json")), "model.config_json");
    // The Model's parameters, viewed by name while the engine binds them; the Model must outlive the engine
    // (keep_alive below).
    TensorArgs args;
    const model::TensorLookup params = [&](std::string_view name) {
      return args.output(model.attr("param")(std::string(name)), "model parameter");
    };
    const DType param_dtype = params("model.embed_tokens.weight").dtype;
    engine_ = std::make_unique<rollout::Engine>(
        config_, model::ModelOptions{.dtype = param_dtype, .cpu_threads = cpu_threads, .batch_invariant = batch_invariant},
        params, options);
  }

  nb::list generate(const std::vector<std::vector<std::int32_t>>& prompts, std::int32_t max_new_tokens,
                    double temperature, double top_p, std::int32_t top_k, std::uint64_t seed,
                    const std::vector<std::int32_t>& stop_tokens, bool untempered_logprobs) {
    std::vector<rollout::Request> requests;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      rollout::Request r;
      r.id = i;
      r.prompt = prompts[i];
      r.max_new_tokens = max_new_tokens;
      r.stop_tokens = stop_tokens;
      r.sampling = {.temperature = temperature, .top_p = top_p, .top_k = top_k, .seed = seed};
      r.untempered_logprobs = untempered_logprobs;
      requests.push_back(std::move(r));
    }
    std::vector<rollout::Completion> out;
    {
      nb::gil_scoped_release unlocked;
      out = engine_->generate(requests);
    }
    nb::list result;
    for (const rollout::Completion& c : out) {
      nb::dict d;
      d["tokens"] = c.tokens;
      d["logprobs"] = c.logprobs;
      if (untempered_logprobs) d["untempered_logprobs"] = c.untempered_logprobs;
      d["finish"] = rollout::finish_reason_name(c.finish);
      result.append(d);
    }
    return result;
  }

 private:
  model::Config config_;
  std::unique_ptr<model::ParamStore> store_;  // only when built from a config
  std::unique_ptr<rollout::Engine> engine_;
};

constexpr const char* kEngineDoc = R"(The rollout engine on the CPU: continuous batching over cache slots.

Engine(model, weights=None, *, dtype="float32", max_batch=8, max_length=1024, cache_budget=0,
       max_prefill_tokens=4096, cpu_threads=0, seed=0, batch_invariant=False)

model: a _deltatrain.model.Model (its parameters are used in place: later changes to them are seen by the
engine), or a config (preset name, config.json, or a directory holding one) with `weights` an HF model
directory (None: random weights from `seed`). max_length: positions per slot (prompt + max_new_tokens - 1
must fit); cache_budget: bytes the slots' states may take (0: no limit). batch_invariant: as Model's; with a
batch-invariant Model on the same parameters, a completion's untempered_logprobs equal the Model's token_logprobs
of it bit for bit (true on-policy RL: the trainer's old log-probabilities are the rollout's).)";

}  // namespace

void bind_rollout(nb::module_& m) {
  register_error_translators();
  nb::module_ sub = m.def_submodule("rollout", "The rollout engine (CPU)");
  nb::class_<PyEngine>(sub, "Engine", kEngineDoc)
      .def(nb::init<nb::handle, const std::optional<std::string>&, const std::string&, std::int64_t, std::int64_t,
                    std::int64_t, std::int64_t, int, std::uint64_t, bool>(),
           "model"_a, "weights"_a.none() = nb::none(), nb::kw_only(), "dtype"_a = "float32", "max_batch"_a = 8,
           "max_length"_a = 1024, "cache_budget"_a = 0, "max_prefill_tokens"_a = 4096, "cpu_threads"_a = 0,
           "seed"_a = 0, "batch_invariant"_a = false, nb::keep_alive<1, 2>())
      .def("generate", &PyEngine::generate, "prompts"_a, nb::kw_only(), "max_new_tokens"_a = 16,
           "temperature"_a = 1.0, "top_p"_a = 1.0, "top_k"_a = 0, "seed"_a = 0,
           "stop_tokens"_a = std::vector<std::int32_t>{}, "untempered_logprobs"_a = false,
           "Complete each prompt (a list of token ids); returns one dict per prompt, in order: tokens, logprobs\n"
           "(under the sampling distribution; 0 for greedy, temperature 0), untempered_logprobs (when asked),\n"
           "finish (\"stop\" or \"length\"). Prompt i's draws are keyed by (seed, i, token index).");
}

}  // namespace deltatrain::python
