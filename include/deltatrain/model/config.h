// The hybrid GDN model's configuration: the Qwen3.5 text model (Qwen3_5TextConfig in HF transformers) with a
// dense SwiGLU MLP. Layers are Gated DeltaNet ("linear_attention") or gated softmax attention
// ("full_attention"); by default layer i is full attention when (i + 1) % full_attention_interval == 0.
//
// Field names follow HF's config.json, so a config reads and writes as HF's does.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace deltatrain::model {

enum class LayerKind : std::uint8_t { linear_attention, full_attention };
const char* layer_kind_name(LayerKind kind);  // "linear_attention", "full_attention" (HF's layer_types)

struct Config {
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;  // the dense MLP's width
  std::vector<LayerKind> layer_types;  // one per layer; num_hidden_layers = its size
  // Gated attention layers.
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  double rope_theta = 1e7;
  double partial_rotary_factor = 0.25;  // the fraction of head_dim that RoPE rotates
  // Gated DeltaNet layers.
  int linear_num_key_heads = 0;
  int linear_num_value_heads = 0;
  int linear_key_head_dim = 0;
  int linear_value_head_dim = 0;
  int linear_conv_kernel_dim = 4;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;  // std of the normal initialisation of linear and embedding weights

  int num_hidden_layers() const { return static_cast<int>(layer_types.size()); }
  int rotary_dim() const;                           // head_dim * partial_rotary_factor
  std::int64_t linear_key_dim() const { return std::int64_t{linear_num_key_heads} * linear_key_head_dim; }
  std::int64_t linear_value_dim() const { return std::int64_t{linear_num_value_heads} * linear_value_head_dim; }
  std::int64_t linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }  // q | k | v channels
  // The GDN block's input projections side by side (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), as one product.
  std::int64_t linear_in_proj_dim() const {
    return linear_conv_dim() + linear_value_dim() + 2 * std::int64_t{linear_num_value_heads};
  }

  bool operator==(const Config&) const = default;  // every field, exactly (a config.json round trip keeps them)
};

// Layer types for `layers` layers with full attention every `full_attention_interval`-th layer.
std::vector<LayerKind> interval_layer_types(int layers, int full_attention_interval);

// InvalidArgument naming the field when a value is out of range or head counts do not divide.
void validate(const Config& config);

// Built-in shapes: "tiny" (1.65M parameters, for tests and CPU demos; head dims the GPU kernels
// take) and "qwen3.5-0.8b" (Qwen3.5-0.8B's text model).
std::vector<std::string> preset_names();
Config preset(std::string_view name);  // InvalidArgument listing the presets for an unknown name

// HF's config.json: a Qwen3_5TextConfig, or a Qwen3_5Config whose text_config is one (Qwen3_5ForCausalLM
// and Qwen3_5ForConditionalGeneration checkpoints), or a Qwen3NextConfig with a dense MLP. Fields that do not
// change the model (token ids, architectures, dtype, ...) are ignored; a field that would change it and
// that this model does not implement (attention_bias, a rope type other than default, MoE experts, ...)
// raises InvalidArgument naming `source` and the field.
Config config_from_hf_json(const std::string& text, const std::string& source);
// A config.json that transformers loads as Qwen3_5ForCausalLM.
std::string config_to_hf_json(const Config& config);

// A preset name, a config.json file, or a directory holding one (a saved model).
Config load_config(const std::string& name_or_path);

}  // namespace deltatrain::model
