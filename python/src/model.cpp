// The model's binding, `_deltatrain.model`: a model with its own host parameters and gradients (a ParamStore),
// built from a preset or an HF config, loaded from and saved to HF safetensors, run forward to the loss or the
// logits and backward to the gradients. Parameters and gradients come back as NumPy arrays viewing the
// store's memory (writable: a caller may set weights in place). The GIL is released while the model runs.
#include <nanobind/ndarray.h>
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
#include "deltatrain/model/model.h"
#include "deltatrain/model/params.h"
#include "tensor.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace deltatrain::python {
namespace {

using model::Config;
using model::ParamStore;

DType model_dtype(const std::string& name) {
  if (name == "float32") return DType::f32;
  if (name == "float64") return DType::f64;
  throw InvalidArgument("dtype", "the CPU model computes in \"float32\" or \"float64\", got \"" + name + "\"");
}

DType file_dtype(const std::string& name) {
  if (name == "float32") return DType::f32;
  if (name == "bfloat16") return DType::bf16;
  throw InvalidArgument("dtype", "a saved model is \"float32\" or \"bfloat16\", got \"" + name + "\"");
}

// A model and the store it is bound to, as one Python object.
class PyModel {
 public:
  PyModel(const std::string& config, const std::string& dtype, int cpu_threads, bool recompute,
          std::int64_t loss_chunk, std::uint64_t seed, bool batch_invariant)
      : config_(model::load_config(config)),
        store_(config_, model_dtype(dtype)),
        model_(config_, {.dtype = store_.dtype(), .cpu_threads = cpu_threads, .loss_chunk = loss_chunk,
                         .recompute = recompute, .batch_invariant = batch_invariant}) {
    store_.init(config_.initializer_range, seed);
    model_.bind(store_.params(), store_.grads());
  }

  std::string config_json() const { return model::config_to_hf_json(config_); }
  std::vector<std::string> param_names() const {
    std::vector<std::string> names;
    for (const model::ParamInfo& info : store_.infos()) names.push_back(info.name);
    return names;
  }

  void load(const std::string& dir) {
    nb::gil_scoped_release unlocked;
    model::load_hf_weights(dir, config_, store_.params());
  }
  void save(const std::string& dir, const std::string& dtype) {
    const DType file = file_dtype(dtype);
    nb::gil_scoped_release unlocked;
    model::save_hf_model(dir, config_, store_.params(), file);
  }

  double forward(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& cu_seqlens,
                 const std::optional<std::vector<std::int32_t>>& targets,
                 const std::optional<std::vector<double>>& weights, bool training) {
    const model::Batch batch{tokens, cu_seqlens, targets ? std::span(*targets) : std::span<const std::int32_t>(),
                             weights ? std::span(*weights) : std::span<const double>()};
    nb::gil_scoped_release unlocked;
    return model_.forward(batch, training);
  }
  void backward() {
    nb::gil_scoped_release unlocked;
    model_.backward();
  }
  void zero_grads() { store_.zero_grads(); }

  nb::object logits(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& cu_seqlens) {
    const auto T = static_cast<std::int64_t>(tokens.size());
    nb::module_ np = nb::module_::import_("numpy");
    nb::object out = np.attr("empty")(nb::make_tuple(T, config_.vocab_size), dtype_name_numpy());
    TensorArgs args;
    const TensorView view = args.output(out, "logits");
    {
      nb::gil_scoped_release unlocked;
      model_.logits({tokens, cu_seqlens}, view);
    }
    return out;
  }

  nb::object token_logprobs() {
    const std::span<const double> values = model_.token_logprobs();
    nb::module_ np = nb::module_::import_("numpy");
    nb::object out = np.attr("empty")(values.size(), "float64");
    TensorArgs args;
    const TensorView view = args.output(out, "logprobs");
    std::copy(values.begin(), values.end(), view.ptr<double>());
    return out;
  }

  TensorView param(const std::string& name) const { return store_.param(name); }
  TensorView grad(const std::string& name) const { return store_.grad(name); }
  const char* dtype_name_numpy() const { return store_.dtype() == DType::f64 ? "float64" : "float32"; }

 private:
  Config config_;
  ParamStore store_;
  model::Model model_;
};

// A NumPy array viewing a tensor of the store, keeping the model alive while the array lives.
nb::object numpy_view(const TensorView& v, nb::handle owner) {
  std::vector<std::size_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
  const nb::dlpack::dtype dtype = v.dtype == DType::f64 ? nb::dtype<double>() : nb::dtype<float>();
  nb::ndarray<nb::numpy> array(v.data, shape.size(), shape.data(), owner, nullptr, dtype);
  return nb::cast(array, nb::rv_policy::reference_internal, owner);
}

constexpr const char* kModelDoc = R"(The Qwen3.5-style hybrid GDN model on the CPU, with its own parameters.

Model(config, *, dtype="float32", cpu_threads=0, recompute=False, loss_chunk=1024, seed=0, batch_invariant=False)

config: a preset ("tiny", "qwen3.5-0.8b"), an HF config.json, or a directory holding one. The parameters
start from HF's initialisation drawn from `seed`; load() replaces them with a saved model's. batch_invariant:
every token's logits computed from its own prefix alone, the same way in any batch (slower products); with a
batch-invariant Engine on the same parameters, token_logprobs() of a completion equal the engine's untempered
logprobs bit for bit (true on-policy RL).
Token ids and cu_seqlens are sequences of ints (a packed batch: sequence n is tokens
[cu_seqlens[n], cu_seqlens[n + 1])).)";

}  // namespace

void bind_model(nb::module_& m) {
  register_error_translators();
  nb::module_ sub = m.def_submodule("model", "The hybrid GDN language model (CPU)");
  nb::class_<PyModel>(sub, "Model", kModelDoc)
      .def(nb::init<const std::string&, const std::string&, int, bool, std::int64_t, std::uint64_t, bool>(),
           "config"_a, nb::kw_only(), "dtype"_a = "float32", "cpu_threads"_a = 0, "recompute"_a = false,
           "loss_chunk"_a = 1024, "seed"_a = 0, "batch_invariant"_a = false)
      .def_prop_ro("config_json", &PyModel::config_json, "The config as HF's config.json text.")
      .def("param_names", &PyModel::param_names, "Every parameter's HF name, in the model's order.")
      .def("load", &PyModel::load, "dir"_a, "Load every parameter from an HF model directory (safetensors).")
      .def("save", &PyModel::save, "dir"_a, "dtype"_a = "float32",
           "Save as an HF model directory (config.json + model.safetensors); `dir` must not exist.")
      .def("forward", &PyModel::forward, "tokens"_a, "cu_seqlens"_a, "targets"_a.none() = nb::none(),
           "weights"_a.none() = nb::none(), "training"_a = true,
           "The loss sum_t weights[t] * -log p(targets[t]); targets default to the next token of the same\n"
           "sequence (-1: none), weights to the mean over tokens with a target. training keeps what\n"
           "backward() needs.")
      .def("backward", &PyModel::backward, "Add d loss / d parameter to the gradients (after a training forward).")
      .def("zero_grads", &PyModel::zero_grads)
      .def("logits", &PyModel::logits, "tokens"_a, "cu_seqlens"_a, "The logits [T, vocab] as a NumPy array.")
      .def("token_logprobs", &PyModel::token_logprobs, "log p(target) per token of the last forward (float64).")
      .def(
          "param", [](nb::handle self, const std::string& name) {
            return numpy_view(nb::cast<PyModel&>(self).param(name), self);
          },
          "name"_a, "A parameter as a writable NumPy array viewing the model's memory.")
      .def(
          "grad", [](nb::handle self, const std::string& name) {
            return numpy_view(nb::cast<PyModel&>(self).grad(name), self);
          },
          "name"_a, "A parameter's gradient as a NumPy array viewing the model's memory.");
  sub.def("preset_names", &model::preset_names);
  sub.def(
      "param_count", [](const std::string& config) { return model::param_count(model::load_config(config)); },
      "config"_a);
}

}  // namespace deltatrain::python
