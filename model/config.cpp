#include "deltatrain/model/config.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <system_error>

#include "deltatrain/core/error.h"
#include "optim/file_io.h"

namespace deltatrain::model {

namespace {

using nlohmann::json;

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

void require(bool ok, const char* field, const std::string& rule) {
  if (!ok) throw InvalidArgument(field, rule);
}

std::string number(double value) {
  json j = value;
  return j.dump();
}

// HF's config.json keys that do not change the text model's shapes or its math: token ids, dtypes, cache and
// output switches, the context length (RoPE here has no scaling, so it does not depend on it), the multi-token
// prediction head (not part of Qwen3_5ForCausalLM; its mtp.* tensors are skipped when loading) and the
// inference-time SSM state dtype.
const std::set<std::string, std::less<>> kIgnoredTextKeys = {"architectures",
                                                             "dtype",
                                                             "torch_dtype",
                                                             "transformers_version",
                                                             "_name_or_path",
                                                             "bos_token_id",
                                                             "eos_token_id",
                                                             "pad_token_id",
                                                             "use_cache",
                                                             "max_position_embeddings",
                                                             "output_attentions",
                                                             "output_hidden_states",
                                                             "return_dict",
                                                             "mamba_ssm_dtype",
                                                             "mtp_num_hidden_layers",
                                                             "mtp_use_dedicated_embeddings",
                                                             "keys_to_ignore_at_inference"};

// Extra keys of Qwen3_5Config (the multimodal wrapper) around its text_config: the vision tower and its tokens.
const std::set<std::string, std::less<>> kIgnoredWrapperKeys = {"vision_config",       "image_token_id",
                                                                "video_token_id",      "vision_start_token_id",
                                                                "vision_end_token_id", "language_model_only"};

// Qwen3NextConfig's mixture-of-experts hyper-parameters, which change nothing when no layer is MoE.
const std::set<std::string, std::less<>> kMoeOnlyKeys = {"moe_intermediate_size", "shared_expert_intermediate_size",
                                                         "num_experts_per_tok",   "norm_topk_prob",
                                                         "output_router_logits",  "router_aux_loss_coef"};

enum class Flavor { qwen3_5, qwen3_next };

// One JSON object of a config.json: typed access by key, and at the end a check that every key was either
// read or is known not to matter.
class Fields {
 public:
  Fields(const json& object, std::string prefix, const std::string& source)
      : object_(object), prefix_(std::move(prefix)), source_(source) {}

  [[noreturn]] void fail(std::string_view key, const std::string& rule) const {
    throw InvalidArgument(prefix_ + std::string(key), "in " + source_ + ": " + rule);
  }

  const json* find(std::string_view key) {
    seen_.insert(std::string(key));
    const auto it = object_.find(std::string(key));
    return it == object_.end() ? nullptr : &*it;
  }
  bool has(std::string_view key) { return find(key) != nullptr; }

  std::int64_t integer(std::string_view key, std::int64_t low, std::int64_t high) {
    const json* value = find(key);
    if (value == nullptr) fail(key, "is missing");
    return integer_value(key, *value, low, high);
  }
  std::int64_t integer_or(std::string_view key, std::int64_t fallback, std::int64_t low, std::int64_t high) {
    const json* value = find(key);
    return value == nullptr ? fallback : integer_value(key, *value, low, high);
  }
  std::int64_t integer_value(std::string_view key, const json& value, std::int64_t low, std::int64_t high) const {
    if (!value.is_number_integer()) fail(key, "must be an integer; got " + value.dump());
    if (value.is_number_unsigned() && value.get<std::uint64_t>() > static_cast<std::uint64_t>(high)) {
      fail(key, "must be at most " + std::to_string(high) + "; got " + value.dump());
    }
    const std::int64_t got = value.get<std::int64_t>();
    if (got < low || got > high) {
      fail(key, "must be in [" + std::to_string(low) + ", " + std::to_string(high) + "]; got " + value.dump());
    }
    return got;
  }

  std::optional<double> real(std::string_view key) {
    const json* value = find(key);
    if (value == nullptr) return std::nullopt;
    return real_value(key, *value);
  }
  double real_value(std::string_view key, const json& value) const {
    if (!value.is_number()) fail(key, "must be a number; got " + value.dump());
    return value.get<double>();
  }

  std::optional<bool> boolean(std::string_view key) {
    const json* value = find(key);
    if (value == nullptr) return std::nullopt;
    if (!value->is_boolean()) fail(key, "must be true or false; got " + value->dump());
    return value->get<bool>();
  }

  std::optional<std::string> string(std::string_view key) {
    const json* value = find(key);
    if (value == nullptr) return std::nullopt;
    if (!value->is_string()) fail(key, "must be a string; got " + value->dump());
    return value->get<std::string>();
  }

  // Every key is read, ignored on purpose, or refused by name.
  void check_unknown(const std::vector<const std::set<std::string, std::less<>>*>& ignored) const {
    for (const auto& [key, value] : object_.items()) {
      if (seen_.count(key)) continue;
      bool skip = false;
      for (const auto* set : ignored) skip = skip || (set != nullptr && set->count(key) > 0);
      if (!skip) {
        fail(key,
             "is not a field this model knows; it might change the model, so the config is refused "
             "(value " +
                 value.dump() + ")");
      }
    }
  }

  const std::string& prefix() const { return prefix_; }

 private:
  const json& object_;
  std::string prefix_;
  const std::string& source_;
  std::set<std::string, std::less<>> seen_;
};

// RoPE: rope_parameters (HF 5.x), or the legacy top-level rope_theta / partial_rotary_factor / rope_scaling.
void read_rope(Fields& fields, Config& config) {
  std::optional<double> theta, factor;
  if (const json* rope = fields.find("rope_parameters"); rope != nullptr && !rope->is_null()) {
    if (!rope->is_object()) fields.fail("rope_parameters", "must be an object; got " + rope->dump());
    for (const auto& [key, value] : rope->items()) {
      const std::string field = "rope_parameters." + key;
      if (key == "rope_type") {
        if (!value.is_string() || value.get<std::string>() != "default") {
          fields.fail(field,
                      "must be \"default\" (RoPE without scaling is what this model implements); got " + value.dump());
        }
      } else if (key == "rope_theta") {
        theta = fields.real_value(field, value);
      } else if (key == "partial_rotary_factor") {
        factor = fields.real_value(field, value);
      } else if (key == "mrope_section") {
        // Multimodal RoPE: for text-only position ids all three position components are equal, so any
        // section split rotates exactly as plain RoPE does.
        if (!value.is_array()) fields.fail(field, "must be a list of integers; got " + value.dump());
        for (const json& item : value) fields.integer_value(field, item, 0, INT_MAX);
      } else if (key == "mrope_interleaved") {
        if (!value.is_boolean()) fields.fail(field, "must be true or false; got " + value.dump());
      } else {
        fields.fail(field, "is not a RoPE parameter this model implements (value " + value.dump() + ")");
      }
    }
  }
  // The legacy top-level fields count only where rope_parameters lacks them, as in transformers (which itself
  // saves a stale top-level partial_rotary_factor of 0.25 beside rope_parameters' own).
  if (const std::optional<double> legacy = fields.real("rope_theta"); legacy && !theta) theta = legacy;
  if (const std::optional<double> legacy = fields.real("partial_rotary_factor"); legacy && !factor) factor = legacy;
  if (const json* scaling = fields.find("rope_scaling"); scaling != nullptr && !scaling->is_null()) {
    fields.fail("rope_scaling", "must be null (RoPE scaling is not implemented); got " + scaling->dump());
  }
  if (!theta) fields.fail("rope_parameters.rope_theta", "is missing (neither rope_parameters nor rope_theta gives it)");
  config.rope_theta = *theta;
  config.partial_rotary_factor = factor.value_or(0.25);  // HF's default for this family
}

void read_layer_types(Fields& fields, Config& config) {
  const bool has_layers = fields.has("num_hidden_layers");
  const std::int64_t layers = has_layers ? fields.integer("num_hidden_layers", 1, INT_MAX) : 0;
  const std::int64_t interval = fields.integer_or("full_attention_interval", 4, 1, INT_MAX);
  if (const json* types = fields.find("layer_types"); types != nullptr && !types->is_null()) {
    if (!types->is_array()) fields.fail("layer_types", "must be a list of layer kinds; got " + types->dump());
    for (const json& type : *types) {
      const std::string name = type.is_string() ? type.get<std::string>() : "";
      if (name == "linear_attention") {
        config.layer_types.push_back(LayerKind::linear_attention);
      } else if (name == "full_attention") {
        config.layer_types.push_back(LayerKind::full_attention);
      } else {
        fields.fail("layer_types",
                    "holds " + type.dump() + "; each must be \"linear_attention\" or \"full_attention\"");
      }
    }
    if (has_layers && layers != static_cast<std::int64_t>(config.layer_types.size())) {
      fields.fail("layer_types", "has " + std::to_string(config.layer_types.size()) +
                                     " entries but num_hidden_layers is " + std::to_string(layers));
    }
    return;
  }
  if (!has_layers) fields.fail("num_hidden_layers", "is missing (and there is no layer_types)");
  config.layer_types = interval_layer_types(static_cast<int>(layers), static_cast<int>(interval));
}

// Qwen3-Next: layer i is MoE when it is not in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step
// == 0. Only a config in which no layer is MoE describes this (dense) model.
void check_dense_mlp(Fields& fields, const Config& config) {
  const std::int64_t experts = fields.integer_or("num_experts", 512, 0, INT_MAX);  // HF's defaults
  const std::int64_t step = fields.integer_or("decoder_sparse_step", 1, 1, INT_MAX);
  std::set<std::int64_t> mlp_only;
  if (const json* list = fields.find("mlp_only_layers"); list != nullptr && !list->is_null()) {
    if (!list->is_array()) fields.fail("mlp_only_layers", "must be a list of layer indices; got " + list->dump());
    for (const json& item : *list) mlp_only.insert(fields.integer_value("mlp_only_layers", item, 0, INT_MAX));
  }
  if (experts == 0) return;
  for (int i = 0; i < config.num_hidden_layers(); ++i) {
    if (!mlp_only.count(i) && (i + 1) % step == 0) {
      fields.fail("num_experts", "is " + std::to_string(experts) + " with decoder_sparse_step " + std::to_string(step) +
                                     ", so layer " + std::to_string(i) +
                                     " would be a mixture of experts; only the dense MLP is implemented (num_experts "
                                     "0, or mlp_only_layers / decoder_sparse_step that leave no layer MoE)");
    }
  }
}

Config read_text_config(Fields& fields, Flavor flavor) {
  Config c;
  c.vocab_size = fields.integer("vocab_size", 1, INT64_MAX);
  c.hidden_size = fields.integer("hidden_size", 1, INT_MAX);
  c.intermediate_size = fields.integer("intermediate_size", 1, INT_MAX);
  read_layer_types(fields, c);
  c.num_attention_heads = static_cast<int>(fields.integer("num_attention_heads", 1, INT_MAX));
  c.num_key_value_heads = static_cast<int>(fields.integer("num_key_value_heads", 1, INT_MAX));
  c.head_dim = static_cast<int>(fields.integer("head_dim", 1, INT_MAX));
  read_rope(fields, c);
  c.linear_num_key_heads = static_cast<int>(fields.integer("linear_num_key_heads", 1, INT_MAX));
  c.linear_num_value_heads = static_cast<int>(fields.integer("linear_num_value_heads", 1, INT_MAX));
  c.linear_key_head_dim = static_cast<int>(fields.integer("linear_key_head_dim", 1, INT_MAX));
  c.linear_value_head_dim = static_cast<int>(fields.integer("linear_value_head_dim", 1, INT_MAX));
  c.linear_conv_kernel_dim = static_cast<int>(fields.integer_or("linear_conv_kernel_dim", 4, 1, INT_MAX));
  c.rms_norm_eps = fields.real("rms_norm_eps").value_or(1e-6);
  c.initializer_range = fields.real("initializer_range").value_or(0.02);
  c.tie_word_embeddings = fields.boolean("tie_word_embeddings").value_or(false);

  if (const auto act = fields.string("hidden_act"); act && *act != "silu") {
    fields.fail("hidden_act", "must be \"silu\" (the SwiGLU MLP); got \"" + *act + "\"");
  }
  if (const auto bias = fields.boolean("attention_bias"); bias && *bias) {
    fields.fail("attention_bias", "must be false (the projections have no bias)");
  }
  if (const auto dropout = fields.real("attention_dropout"); dropout && *dropout != 0) {
    fields.fail("attention_dropout", "must be 0; got " + number(*dropout));
  }
  if (const auto gate = fields.boolean("attn_output_gate"); gate && !*gate) {
    fields.fail("attn_output_gate", "must be true (the attention output is gated)");
  }
  if (flavor == Flavor::qwen3_next) {
    check_dense_mlp(fields, c);
  } else if (const json* list = fields.find("mlp_only_layers"); list != nullptr && !list->is_null()) {
    // Qwen3.5's dense models carry an empty list; every layer's MLP is dense anyway.
    if (!list->is_array()) fields.fail("mlp_only_layers", "must be a list of layer indices; got " + list->dump());
    for (const json& item : *list) fields.integer_value("mlp_only_layers", item, 0, INT_MAX);
  }
  fields.check_unknown({&kIgnoredTextKeys, flavor == Flavor::qwen3_next ? &kMoeOnlyKeys : nullptr});
  return c;
}

}  // namespace

const char* layer_kind_name(LayerKind kind) {
  return kind == LayerKind::full_attention ? "full_attention" : "linear_attention";
}

int Config::rotary_dim() const { return static_cast<int>(head_dim * partial_rotary_factor); }

std::vector<LayerKind> interval_layer_types(int layers, int full_attention_interval) {
  require(layers > 0, "layers", "must be positive; got " + std::to_string(layers));
  require(full_attention_interval > 0, "full_attention_interval",
          "must be positive; got " + std::to_string(full_attention_interval));
  std::vector<LayerKind> types(static_cast<std::size_t>(layers));
  for (int i = 0; i < layers; ++i) {
    types[i] = (i + 1) % full_attention_interval == 0 ? LayerKind::full_attention : LayerKind::linear_attention;
  }
  return types;
}

void validate(const Config& c) {
  auto positive = [](std::int64_t value, const char* field) {
    require(value > 0, field, "must be positive; got " + std::to_string(value));
  };
  positive(c.vocab_size, "vocab_size");
  positive(c.hidden_size, "hidden_size");
  positive(c.intermediate_size, "intermediate_size");
  require(!c.layer_types.empty(), "layer_types", "must name at least one layer (num_hidden_layers >= 1)");
  for (LayerKind kind : c.layer_types) {
    require(kind == LayerKind::linear_attention || kind == LayerKind::full_attention, "layer_types",
            "holds a value that is neither linear_attention nor full_attention");
  }
  positive(c.num_attention_heads, "num_attention_heads");
  positive(c.num_key_value_heads, "num_key_value_heads");
  require(c.num_attention_heads % c.num_key_value_heads == 0, "num_key_value_heads",
          "must divide num_attention_heads (" + std::to_string(c.num_attention_heads) + "); got " +
              std::to_string(c.num_key_value_heads));
  positive(c.head_dim, "head_dim");
  require(std::isfinite(c.rope_theta) && c.rope_theta > 0, "rope_theta",
          "must be a positive number; got " + number(c.rope_theta));
  require(std::isfinite(c.partial_rotary_factor) && c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1,
          "partial_rotary_factor", "must be in (0, 1]; got " + number(c.partial_rotary_factor));
  require(c.rotary_dim() >= 2 && c.rotary_dim() % 2 == 0 && c.rotary_dim() <= c.head_dim, "partial_rotary_factor",
          "must make the rotary dimension head_dim * partial_rotary_factor (" + std::to_string(c.head_dim) + " * " +
              number(c.partial_rotary_factor) + " = " + std::to_string(c.rotary_dim()) +
              ") even, at least 2 and at most head_dim");
  positive(c.linear_num_key_heads, "linear_num_key_heads");
  positive(c.linear_num_value_heads, "linear_num_value_heads");
  require(c.linear_num_value_heads % c.linear_num_key_heads == 0, "linear_num_value_heads",
          "must be a multiple of linear_num_key_heads (" + std::to_string(c.linear_num_key_heads) + "); got " +
              std::to_string(c.linear_num_value_heads));
  positive(c.linear_key_head_dim, "linear_key_head_dim");
  positive(c.linear_value_head_dim, "linear_value_head_dim");
  positive(c.linear_conv_kernel_dim, "linear_conv_kernel_dim");
  require(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0, "rms_norm_eps",
          "must be a positive number; got " + number(c.rms_norm_eps));
  require(std::isfinite(c.initializer_range) && c.initializer_range >= 0, "initializer_range",
          "must be a finite number >= 0; got " + number(c.initializer_range));
}

std::vector<std::string> preset_names() { return {"tiny", "qwen3.5-0.8b"}; }

Config preset(std::string_view name) {
  Config c;
  c.rope_theta = 1e7;
  c.partial_rotary_factor = 0.25;
  c.rms_norm_eps = 1e-6;
  c.linear_conv_kernel_dim = 4;
  c.tie_word_embeddings = true;
  c.initializer_range = 0.02;
  if (name == "tiny") {
    c.vocab_size = 4096;
    c.hidden_size = 128;
    c.intermediate_size = 384;
    c.layer_types = interval_layer_types(4, 4);
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 64;
    c.linear_num_key_heads = 2;
    c.linear_num_value_heads = 4;
    c.linear_key_head_dim = 64;
    c.linear_value_head_dim = 64;
    return c;
  }
  if (name == "qwen3.5-0.8b") {
    c.vocab_size = 248320;
    c.hidden_size = 1024;
    c.intermediate_size = 3584;
    c.layer_types = interval_layer_types(24, 4);
    c.num_attention_heads = 8;
    c.num_key_value_heads = 2;
    c.head_dim = 256;
    c.linear_num_key_heads = 16;
    c.linear_num_value_heads = 16;
    c.linear_key_head_dim = 128;
    c.linear_value_head_dim = 128;
    return c;
  }
  throw InvalidArgument("name",
                        "must be one of the presets " + join(preset_names()) + "; got '" + std::string(name) + "'");
}

Config config_from_hf_json(const std::string& text, const std::string& source) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    throw InvalidArgument(source, std::string("is not valid JSON: ") + e.what());
  }
  if (!root.is_object()) throw InvalidArgument(source, "is not a JSON object");
  Fields top(root, "", source);
  const std::optional<std::string> model_type = top.string("model_type");
  if (!model_type) top.fail("model_type", "is missing");

  Config config;
  std::string prefix;  // where the text model's fields are
  if (*model_type == "qwen3_5_text" || *model_type == "qwen3_next") {
    config = read_text_config(top, *model_type == "qwen3_next" ? Flavor::qwen3_next : Flavor::qwen3_5);
  } else if (*model_type == "qwen3_5") {
    const json* text_config = top.find("text_config");
    if (text_config == nullptr || !text_config->is_object()) {
      top.fail("text_config", "must be an object holding the text model's fields (model_type qwen3_5)");
    }
    Fields inner(*text_config, "text_config.", source);
    prefix = inner.prefix();
    if (const auto inner_type = inner.string("model_type"); inner_type && *inner_type != "qwen3_5_text") {
      inner.fail("model_type", "must be \"qwen3_5_text\"; got \"" + *inner_type + "\"");
    }
    const bool inner_tie = inner.has("tie_word_embeddings");
    config = read_text_config(inner, Flavor::qwen3_5);
    // The wrapper's own tie_word_embeddings is the one transformers ties by.
    if (const std::optional<bool> tie = top.boolean("tie_word_embeddings")) {
      if (inner_tie && *tie != config.tie_word_embeddings) {
        top.fail("tie_word_embeddings", "disagrees with text_config.tie_word_embeddings");
      }
      config.tie_word_embeddings = *tie;
    }
    top.check_unknown({&kIgnoredTextKeys, &kIgnoredWrapperKeys});
  } else {
    top.fail("model_type", "must be \"qwen3_5_text\", \"qwen3_5\" or \"qwen3_next\"; got \"" + *model_type + "\"");
  }
  try {
    validate(config);
  } catch (const InvalidArgument& e) {
    // Name the source, and the field as the file spells it.
    const std::string what = e.what();
    const std::string head = "invalid argument '" + e.argument() + "': ";
    throw InvalidArgument(prefix + e.argument(),
                          "in " + source + ": " + what.substr(std::min(head.size(), what.size())));
  }
  return config;
}

std::string config_to_hf_json(const Config& c) {
  validate(c);
  nlohmann::ordered_json j;
  j["architectures"] = {"Qwen3_5ForCausalLM"};
  j["model_type"] = "qwen3_5_text";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers();
  std::vector<std::string> types;
  for (LayerKind kind : c.layer_types) types.emplace_back(layer_kind_name(kind));
  j["layer_types"] = types;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["rope_parameters"] = {
      {"rope_type", "default"}, {"rope_theta", c.rope_theta}, {"partial_rotary_factor", c.partial_rotary_factor}};
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["linear_num_key_heads"] = c.linear_num_key_heads;
  j["linear_num_value_heads"] = c.linear_num_value_heads;
  j["linear_key_head_dim"] = c.linear_key_head_dim;
  j["linear_value_head_dim"] = c.linear_value_head_dim;
  j["linear_conv_kernel_dim"] = c.linear_conv_kernel_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["initializer_range"] = c.initializer_range;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["dtype"] = "float32";
  return j.dump(2) + "\n";
}

Config load_config(const std::string& name_or_path) {
  const std::vector<std::string> presets = preset_names();
  for (const std::string& name : presets) {
    if (name == name_or_path) return preset(name);
  }
  std::error_code error;
  std::filesystem::path path = name_or_path;
  if (std::filesystem::is_directory(path, error)) path /= "config.json";
  if (name_or_path.empty() || !std::filesystem::is_regular_file(path, error)) {
    throw InvalidArgument("name_or_path", "must be a preset (" + join(presets) +
                                              "), a config.json file or a directory holding one; '" + name_or_path +
                                              "' is none of these");
  }
  return config_from_hf_json(optim::read_text_file(path), path.string());
}

}  // namespace deltatrain::model
