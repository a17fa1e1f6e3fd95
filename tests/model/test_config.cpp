// The model's config: presets, validation, HF config.json in both directions (Qwen3_5TextConfig, the
// multimodal Qwen3_5Config around one, a dense Qwen3NextConfig), and load_config's three forms.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "deltatrain/core/error.h"
#include "deltatrain/model/config.h"
#include "deltatrain/model/params.h"
#include "model_testing.h"

namespace deltatrain::model {
namespace {

using nlohmann::json;
using testing::random_config;
using testing::SeededTest;
using testing::TempDir;

// Runs `call`, expecting InvalidArgument whose argument is `argument` and whose message holds `words`.
template <class Call>
void expect_invalid(Call&& call, const std::string& argument, const std::string& words = "") {
  try {
    call();
    ADD_FAILURE() << "expected InvalidArgument naming '" << argument << "'";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what() << "\n  lacks: " << words;
  }
}

std::vector<std::string> interval_names(int layers, int interval) {
  std::vector<std::string> names;
  for (int i = 0; i < layers; ++i) names.push_back((i + 1) % interval == 0 ? "full_attention" : "linear_attention");
  return names;
}

// The text part of Qwen3.5-0.8B's config.json as HF publishes it (inside "text_config").
json qwen35_08b_text_config() {
  return {{"attention_bias", false},
          {"attention_dropout", 0.0},
          {"attn_output_gate", true},
          {"bos_token_id", nullptr},
          {"dtype", "bfloat16"},
          {"eos_token_id", 248044},
          {"full_attention_interval", 4},
          {"head_dim", 256},
          {"hidden_act", "silu"},
          {"hidden_size", 1024},
          {"initializer_range", 0.02},
          {"intermediate_size", 3584},
          {"layer_types", interval_names(24, 4)},
          {"linear_conv_kernel_dim", 4},
          {"linear_key_head_dim", 128},
          {"linear_num_key_heads", 16},
          {"linear_num_value_heads", 16},
          {"linear_value_head_dim", 128},
          {"mamba_ssm_dtype", "float32"},
          {"max_position_embeddings", 262144},
          {"mlp_only_layers", json::array()},
          {"model_type", "qwen3_5_text"},
          {"mtp_num_hidden_layers", 1},
          {"mtp_use_dedicated_embeddings", false},
          {"num_attention_heads", 8},
          {"num_hidden_layers", 24},
          {"num_key_value_heads", 2},
          {"rms_norm_eps", 1e-6},
          {"tie_word_embeddings", true},
          {"use_cache", true},
          {"vocab_size", 248320},
          {"rope_parameters",
           {{"mrope_interleaved", true},
            {"mrope_section", {11, 11, 10}},
            {"rope_type", "default"},
            {"rope_theta", 10000000},
            {"partial_rotary_factor", 0.25}}}};
}

json qwen35_08b_multimodal_config() {
  return {{"architectures", {"Qwen3_5ForConditionalGeneration"}},
          {"image_token_id", 248056},
          {"model_type", "qwen3_5"},
          {"text_config", qwen35_08b_text_config()},
          {"tie_word_embeddings", true},
          {"transformers_version", "4.57.0.dev0"},
          {"video_token_id", 248057},
          {"vision_config", {{"depth", 12}, {"hidden_size", 768}, {"model_type", "qwen3_5"}}},
          {"vision_end_token_id", 248054},
          {"vision_start_token_id", 248053}};
}

// A Qwen3-Next config.json (legacy RoPE fields) at the tiny preset's shape, with a dense MLP.
json dense_qwen3_next_config() {
  return {{"architectures", {"Qwen3NextForCausalLM"}},
          {"model_type", "qwen3_next"},
          {"vocab_size", 4096},
          {"hidden_size", 128},
          {"intermediate_size", 384},
          {"num_hidden_layers", 4},
          {"full_attention_interval", 4},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 64},
          {"rope_theta", 10000000},
          {"partial_rotary_factor", 0.25},
          {"rope_scaling", nullptr},
          {"linear_num_key_heads", 2},
          {"linear_num_value_heads", 4},
          {"linear_key_head_dim", 64},
          {"linear_value_head_dim", 64},
          {"linear_conv_kernel_dim", 4},
          {"rms_norm_eps", 1e-6},
          {"tie_word_embeddings", true},
          {"hidden_act", "silu"},
          {"num_experts", 0},
          {"decoder_sparse_step", 1},
          {"moe_intermediate_size", 512},
          {"shared_expert_intermediate_size", 512},
          {"num_experts_per_tok", 10},
          {"norm_topk_prob", true},
          {"output_router_logits", false},
          {"router_aux_loss_coef", 0.001},
          {"mlp_only_layers", json::array()},
          {"torch_dtype", "bfloat16"}};
}

Config from(const json& j) { return config_from_hf_json(j.dump(), "test config.json"); }

TEST(Presets, Qwen35_08bHasTransformersParameterCount) {
  const Config c = preset("qwen3.5-0.8b");
  EXPECT_EQ(param_count(c), 752'393'024);  // transformers' Qwen3_5ForCausalLM at this shape
  ASSERT_EQ(c.num_hidden_layers(), 24);
  for (int i = 0; i < 24; ++i) {
    EXPECT_EQ(c.layer_types[i], i % 4 == 3 ? LayerKind::full_attention : LayerKind::linear_attention) << i;
  }
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.linear_conv_dim(), 6144);
  EXPECT_TRUE(c.tie_word_embeddings);
}

TEST(Presets, TinyIsSmallAndValid) {
  const Config c = preset("tiny");
  EXPECT_NO_THROW(validate(c));
  const std::int64_t n = param_count(c);
  EXPECT_GT(n, 500'000);
  EXPECT_LT(n, 2'000'000);
  EXPECT_EQ(c.layer_types, interval_layer_types(4, 4));
  EXPECT_EQ(c.layer_types.back(), LayerKind::full_attention);
}

TEST(Presets, UnknownNameListsThePresets) {
  expect_invalid([] { preset("qwen3.5-9000b"); }, "name", "tiny, qwen3.5-0.8b");
  EXPECT_EQ(preset_names(), (std::vector<std::string>{"tiny", "qwen3.5-0.8b"}));
}

TEST(IntervalLayerTypes, FollowsTheRule) {
  EXPECT_EQ(interval_layer_types(3, 1), std::vector<LayerKind>(3, LayerKind::full_attention));
  EXPECT_EQ(interval_layer_types(2, 3), std::vector<LayerKind>(2, LayerKind::linear_attention));
  expect_invalid([] { interval_layer_types(4, 0); }, "full_attention_interval");
  expect_invalid([] { interval_layer_types(0, 4); }, "layers");
}

TEST(Validate, NamesTheField) {
  struct Case {
    const char* field;
    std::function<void(Config&)> edit;
  };
  const Case cases[] = {
      {"vocab_size", [](Config& c) { c.vocab_size = 0; }},
      {"hidden_size", [](Config& c) { c.hidden_size = -1; }},
      {"intermediate_size", [](Config& c) { c.intermediate_size = 0; }},
      {"layer_types", [](Config& c) { c.layer_types.clear(); }},
      {"num_attention_heads", [](Config& c) { c.num_attention_heads = 0; }},
      {"num_key_value_heads", [](Config& c) { c.num_key_value_heads = 0; }},
      {"num_key_value_heads", [](Config& c) { c.num_key_value_heads = 3; }},  // 4 % 3 != 0
      {"head_dim", [](Config& c) { c.head_dim = 0; }},
      {"partial_rotary_factor", [](Config& c) { c.partial_rotary_factor = 0; }},
      {"partial_rotary_factor", [](Config& c) { c.partial_rotary_factor = 1.5; }},
      {"partial_rotary_factor", [](Config& c) { c.head_dim = 12; }},  // rotary dim 3: odd
      {"rope_theta", [](Config& c) { c.rope_theta = 0; }},
      {"rope_theta", [](Config& c) { c.rope_theta = std::numeric_limits<double>::infinity(); }},
      {"linear_num_key_heads", [](Config& c) { c.linear_num_key_heads = 0; }},
      {"linear_num_value_heads", [](Config& c) { c.linear_num_value_heads = 3; }},  // not a multiple of 2
      {"linear_key_head_dim", [](Config& c) { c.linear_key_head_dim = 0; }},
      {"linear_value_head_dim", [](Config& c) { c.linear_value_head_dim = -4; }},
      {"linear_conv_kernel_dim", [](Config& c) { c.linear_conv_kernel_dim = 0; }},
      {"rms_norm_eps", [](Config& c) { c.rms_norm_eps = 0; }},
      {"rms_norm_eps", [](Config& c) { c.rms_norm_eps = std::nan(""); }},
      {"initializer_range", [](Config& c) { c.initializer_range = -0.02; }},
  };
  for (const Case& k : cases) {
    Config c = preset("tiny");
    k.edit(c);
    expect_invalid([&] { validate(c); }, k.field);
  }
}

class RoundTrip : public SeededTest {};

TEST_F(RoundTrip, PresetsAndRandomConfigsSurviveConfigJson) {
  for (const std::string& name : preset_names()) {
    const Config c = preset(name);
    EXPECT_EQ(config_from_hf_json(config_to_hf_json(c), name), c) << name;
  }
  for (int i = 0; i < 200; ++i) {
    const Config c = random_config(rng_);
    ASSERT_NO_THROW(validate(c));
    const std::string text = config_to_hf_json(c);
    EXPECT_EQ(config_from_hf_json(text, "random"), c) << text;
  }
}

TEST(ToHfJson, IsWhatTransformersLoadsAsQwen35ForCausalLM) {
  const Config c = preset("qwen3.5-0.8b");
  const json j = json::parse(config_to_hf_json(c));
  EXPECT_EQ(j["model_type"], "qwen3_5_text");
  EXPECT_EQ(j["architectures"], json({"Qwen3_5ForCausalLM"}));
  EXPECT_EQ(j["rope_parameters"],
            json({{"rope_type", "default"}, {"rope_theta", 1e7}, {"partial_rotary_factor", 0.25}}));
  EXPECT_EQ(j["layer_types"], json(interval_names(24, 4)));
  EXPECT_EQ(j["num_hidden_layers"], 24);
  EXPECT_EQ(j["hidden_act"], "silu");
  EXPECT_EQ(j["attention_bias"], false);
  EXPECT_EQ(j["dtype"], "float32");
  EXPECT_EQ(j["tie_word_embeddings"], true);
  for (const char* field :
       {"vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "rms_norm_eps", "initializer_range"}) {
    EXPECT_TRUE(j.contains(field)) << field;
  }
  Config bad = c;
  bad.head_dim = 0;
  expect_invalid([&] { config_to_hf_json(bad); }, "head_dim");
}

TEST(FromHfJson, ReadsHfsQwen35MultimodalConfig) {
  EXPECT_EQ(from(qwen35_08b_multimodal_config()), preset("qwen3.5-0.8b"));
  json text = qwen35_08b_text_config();
  EXPECT_EQ(from(text), preset("qwen3.5-0.8b"));
  // The wrapper's tie_word_embeddings decides; alone it is enough.
  json j = qwen35_08b_multimodal_config();
  j["text_config"].erase("tie_word_embeddings");
  EXPECT_TRUE(from(j).tie_word_embeddings);
  j["tie_word_embeddings"] = false;
  EXPECT_FALSE(from(j).tie_word_embeddings);
  j["text_config"]["tie_word_embeddings"] = true;
  expect_invalid([&] { from(j); }, "tie_word_embeddings", "disagrees");
}

// What transformers 5.17's save_pretrained writes for a Qwen3_5ForCausalLM (note the stale top-level
// partial_rotary_factor: the model uses rope_parameters' 0.5).
TEST(FromHfJson, ReadsTheConfigTransformersSaves) {
  const json saved = {
      {"architectures", {"Qwen3_5ForCausalLM"}},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"bos_token_id", nullptr},
      {"dtype", "float32"},
      {"eos_token_id", nullptr},
      {"head_dim", 64},
      {"hidden_act", "silu"},
      {"hidden_size", 128},
      {"initializer_range", 0.02},
      {"intermediate_size", 384},
      {"layer_types", interval_names(6, 3)},
      {"linear_conv_kernel_dim", 3},
      {"linear_key_head_dim", 64},
      {"linear_num_key_heads", 2},
      {"linear_num_value_heads", 2},
      {"linear_value_head_dim", 64},
      {"max_position_embeddings", 32768},
      {"model_type", "qwen3_5_text"},
      {"num_attention_heads", 4},
      {"num_hidden_layers", 6},
      {"num_key_value_heads", 1},
      {"pad_token_id", nullptr},
      {"partial_rotary_factor", 0.25},
      {"rms_norm_eps", 1e-05},
      {"rope_parameters", {{"partial_rotary_factor", 0.5}, {"rope_theta", 12345.5}, {"rope_type", "default"}}},
      {"tie_word_embeddings", false},
      {"transformers_version", "5.17.0"},
      {"use_cache", true},
      {"vocab_size", 4096}};
  Config expected = preset("tiny");
  expected.tie_word_embeddings = false;
  expected.linear_num_value_heads = 2;
  expected.num_key_value_heads = 1;
  expected.layer_types = interval_layer_types(6, 3);
  expected.partial_rotary_factor = 0.5;
  expected.rope_theta = 12345.5;
  expected.rms_norm_eps = 1e-5;
  expected.linear_conv_kernel_dim = 3;
  EXPECT_EQ(from(saved), expected);
}

TEST(FromHfJson, DerivesLayerTypesFromTheInterval) {
  json j = qwen35_08b_text_config();
  j.erase("layer_types");
  EXPECT_EQ(from(j).layer_types, interval_layer_types(24, 4));
  j["full_attention_interval"] = 3;
  EXPECT_EQ(from(j).layer_types, interval_layer_types(24, 3));
  j.erase("full_attention_interval");  // HF's default interval is 4
  EXPECT_EQ(from(j).layer_types, interval_layer_types(24, 4));
  j = qwen35_08b_text_config();
  j["num_hidden_layers"] = 23;
  expect_invalid([&] { from(j); }, "layer_types", "num_hidden_layers is 23");
  j = qwen35_08b_text_config();
  j["layer_types"][2] = "sliding_attention";
  expect_invalid([&] { from(j); }, "layer_types", "sliding_attention");
  j = qwen35_08b_text_config();
  j.erase("num_hidden_layers");  // layer_types alone gives the count
  EXPECT_EQ(from(j).num_hidden_layers(), 24);
  j.erase("layer_types");
  expect_invalid([&] { from(j); }, "num_hidden_layers", "missing");
}

TEST(FromHfJson, AcceptsLegacyRopeFields) {
  json j = qwen35_08b_text_config();
  j.erase("rope_parameters");
  j["rope_theta"] = 1e6;
  j["partial_rotary_factor"] = 0.5;
  j["rope_scaling"] = nullptr;
  const Config c = from(j);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.partial_rotary_factor, 0.5);
  j.erase("partial_rotary_factor");  // HF's default
  EXPECT_EQ(from(j).partial_rotary_factor, 0.25);
  // Both forms: rope_parameters wins, as in transformers.
  j = qwen35_08b_text_config();
  j["rope_theta"] = 1e6;
  j["partial_rotary_factor"] = 1.0;
  EXPECT_EQ(from(j), preset("qwen3.5-0.8b"));
  j = qwen35_08b_text_config();
  j["rope_parameters"].erase("rope_type");
  j["rope_parameters"].erase("mrope_section");
  j["rope_parameters"].erase("mrope_interleaved");
  EXPECT_EQ(from(j), preset("qwen3.5-0.8b"));
  j["rope_parameters"].erase("rope_theta");
  expect_invalid([&] { from(j); }, "rope_parameters.rope_theta", "missing");
}

TEST(FromHfJson, RefusesWhatTheModelDoesNotImplement) {
  struct Case {
    const char* argument;
    std::function<void(json&)> edit;
  };
  const Case cases[] = {
      {"hidden_act", [](json& j) { j["hidden_act"] = "gelu"; }},
      {"attention_bias", [](json& j) { j["attention_bias"] = true; }},
      {"attention_dropout", [](json& j) { j["attention_dropout"] = 0.1; }},
      {"attn_output_gate", [](json& j) { j["attn_output_gate"] = false; }},
      {"rope_parameters.rope_type", [](json& j) { j["rope_parameters"]["rope_type"] = "yarn"; }},
      {"rope_parameters.factor", [](json& j) { j["rope_parameters"]["factor"] = 4.0; }},
      {"rope_scaling",
       [](json& j) {
         j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
       }},
      {"model_type", [](json& j) { j["model_type"] = "llama"; }},
      {"num_experts", [](json& j) { j["num_experts"] = 8; }},  // unknown to Qwen3_5TextConfig
      {"use_sliding_window", [](json& j) { j["use_sliding_window"] = true; }},
  };
  for (const Case& k : cases) {
    json j = qwen35_08b_text_config();
    k.edit(j);
    expect_invalid([&] { from(j); }, k.argument, "test config.json");
  }
}

TEST(FromHfJson, UnknownFieldsAreRefusedByNameAndIgnoredOnesAreNot) {
  json j = qwen35_08b_multimodal_config();
  j["text_config"]["linear_attention_bias"] = true;
  expect_invalid([&] { from(j); }, "text_config.linear_attention_bias", "might change the model");
  j = qwen35_08b_multimodal_config();
  j["quantization_config"] = {{"quant_method", "fp8"}};
  expect_invalid([&] { from(j); }, "quantization_config", "might change the model");
  j = qwen35_08b_text_config();
  for (const char* ignored : {"pad_token_id", "torch_dtype", "transformers_version", "_name_or_path",
                              "max_position_embeddings", "use_cache", "architectures"}) {
    j[ignored] = "anything";
  }
  EXPECT_EQ(from(j), preset("qwen3.5-0.8b"));
}

TEST(FromHfJson, TypeErrorsNameSourceAndField) {
  json j = qwen35_08b_text_config();
  j["hidden_size"] = "1024";
  expect_invalid([&] { from(j); }, "hidden_size", "test config.json");
  j = qwen35_08b_text_config();
  j["rms_norm_eps"] = "tiny";
  expect_invalid([&] { from(j); }, "rms_norm_eps", "must be a number");
  j = qwen35_08b_text_config();
  j["num_attention_heads"] = 8.5;
  expect_invalid([&] { from(j); }, "num_attention_heads", "integer");
  j = qwen35_08b_text_config();
  j["tie_word_embeddings"] = 1;
  expect_invalid([&] { from(j); }, "tie_word_embeddings", "true or false");
  j = qwen35_08b_text_config();
  j["num_key_value_heads"] = 3;  // a rule of validate(), reported with the source
  expect_invalid([&] { from(j); }, "num_key_value_heads", "test config.json");
  j = qwen35_08b_multimodal_config();
  j["text_config"]["num_key_value_heads"] = 3;
  expect_invalid([&] { from(j); }, "text_config.num_key_value_heads", "must divide num_attention_heads");
  j["text_config"].erase("vocab_size");
  expect_invalid([&] { from(j); }, "text_config.vocab_size", "missing");
  j = qwen35_08b_text_config();
  j["vocab_size"] = 0;
  expect_invalid([&] { from(j); }, "vocab_size", "test config.json");
  expect_invalid([] { config_from_hf_json("{\"model_type\": ", "broken.json"); }, "broken.json", "not valid JSON");
  expect_invalid([] { config_from_hf_json("[1, 2]", "list.json"); }, "list.json", "not a JSON object");
  expect_invalid([] { config_from_hf_json("{}", "empty.json"); }, "model_type", "missing");
  j = qwen35_08b_multimodal_config();
  j["text_config"]["model_type"] = "qwen3_5_moe_text";
  expect_invalid([&] { from(j); }, "text_config.model_type", "qwen3_5_text");
}

TEST(FromHfJson, Qwen3NextWithADenseMlp) {
  EXPECT_EQ(from(dense_qwen3_next_config()), preset("tiny"));
  json j = dense_qwen3_next_config();
  j["num_experts"] = 512;
  expect_invalid([&] { from(j); }, "num_experts", "mixture of experts");
  j["decoder_sparse_step"] = 5;  // (i + 1) % 5 == 0 for no layer of 4
  EXPECT_EQ(from(j), preset("tiny"));
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {1, 3};  // the layers step 2 would make MoE
  EXPECT_EQ(from(j), preset("tiny"));
  j["mlp_only_layers"] = {1};
  expect_invalid([&] { from(j); }, "num_experts", "layer 3");
  j.erase("num_experts");  // HF's default is 512 experts
  j.erase("mlp_only_layers");
  j.erase("decoder_sparse_step");
  expect_invalid([&] { from(j); }, "num_experts");
  j = dense_qwen3_next_config();
  j["decoder_sparse_step"] = 0;
  expect_invalid([&] { from(j); }, "decoder_sparse_step");
}

TEST(LoadConfig, PresetFileOrDirectory) {
  EXPECT_EQ(load_config("tiny"), preset("tiny"));
  TempDir dir;
  const Config c = preset("qwen3.5-0.8b");
  { std::ofstream(dir.path() / "config.json") << qwen35_08b_multimodal_config().dump(2); }
  EXPECT_EQ(load_config((dir.path() / "config.json").string()), c);
  EXPECT_EQ(load_config(dir.path().string()), c);
  expect_invalid([&] { load_config((dir.path() / "nothing-here").string()); }, "name_or_path", "tiny, qwen3.5-0.8b");
  expect_invalid([&] { load_config(""); }, "name_or_path", "preset");
  std::filesystem::create_directory(dir.path() / "empty");
  expect_invalid([&] { load_config((dir.path() / "empty").string()); }, "name_or_path");
  { std::ofstream(dir.path() / "bad.json") << R"({"model_type": "qwen3_5_text", "vocab_size": "big"})"; }
  expect_invalid([&] { load_config((dir.path() / "bad.json").string()); }, "vocab_size", "bad.json");
}

}  // namespace
}  // namespace deltatrain::model
