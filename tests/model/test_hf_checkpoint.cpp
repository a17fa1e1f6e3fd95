// The model in HF's format: save/load round trips (f32 bitwise, through bf16, from f16/f64 files), the
// sharded index form, the multimodal checkpoints' names, a tied lm_head, and every refusal (missing, extra,
// misshaped, unsupported dtype, truncated), each leaving the destination untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "deltatrain/core/error.h"
#include "deltatrain/model/hf_checkpoint.h"
#include "deltatrain/optim/safetensors.h"
#include "model_testing.h"

namespace deltatrain::model {
namespace {

namespace fs = std::filesystem;
using testing::random_config;
using testing::SeededTest;
using testing::TempDir;

// bf16 round-to-nearest-even, written independently of the library's bit trick: via fp64 rounding.
float round_to_bf16(float x) {
  if (x == 0 || !std::isfinite(x)) return x;
  int exponent = 0;
  std::frexp(static_cast<double>(x), &exponent);
  const double quantum = std::ldexp(1.0, exponent - 8);
  return static_cast<float>(std::nearbyint(static_cast<double>(x) / quantum) * quantum);
}

float bf16_value(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}

std::vector<std::byte> bytes_of(const TensorView& view) {
  std::vector<std::byte> out(view.nbytes());
  std::memcpy(out.data(), view.data, out.size());
  return out;
}

// A tensor of a hand-made checkpoint file, owning its bytes.
struct Tensor {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
};

// Every parameter of `store` (f32) as F32 tensors named as the model names them.
std::vector<Tensor> tensors_of(const ParamStore& store) {
  std::vector<Tensor> out;
  for (const ParamInfo& info : store.infos())
    out.push_back({info.name, DType::f32, info.shape, bytes_of(store.param(info.name))});
  return out;
}

void write_file(const fs::path& path, const std::vector<Tensor>& tensors) {
  std::vector<optim::TensorToWrite> list;
  for (const Tensor& t : tensors) list.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
  optim::write_safetensors(path, list, {{"format", "pt"}});
}

class HfCheckpoint : public SeededTest {
 protected:
  // A random config; `tied` -1 leaves the tie random.
  Config config(int tied = -1) {
    Config c = random_config(rng_);
    if (tied >= 0) c.tie_word_embeddings = tied == 1;
    return c;
  }
  // A store of random parameters.
  ParamStore filled(const Config& c, DType dtype = DType::f32) {
    ParamStore store(c, dtype);
    store.init(0.5, rng_());
    return store;
  }
  fs::path fresh_dir(const std::string& name) {
    const fs::path path = temp_.path() / name;
    fs::create_directory(path);
    return path;
  }
  // Expects load_hf_weights to fail with `Error` whose message holds every word, leaving `destination` as it was.
  template <class Error>
  void expect_refused(const fs::path& dir, const Config& c, const ParamStore& destination,
                      const std::vector<std::string>& words, const std::string& argument = "") {
    const std::vector<std::byte> before = bytes_of(destination.param_buffer());
    try {
      load_hf_weights(dir, c, destination.params());
      ADD_FAILURE() << "the load was not refused";
    } catch (const Error& e) {
      for (const std::string& word : words) {
        EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what() << "\n  lacks: " << word;
      }
      if constexpr (std::is_same_v<Error, InvalidArgument>) {
        if (!argument.empty()) {
          EXPECT_EQ(e.argument(), argument);
        }
      }
    }
    EXPECT_TRUE(bytes_of(destination.param_buffer()) == before) << "the destination was written";
  }
  TempDir temp_;
};

TEST_F(HfCheckpoint, F32RoundTripIsBitwise) {
  for (int tied : {0, 1}) {
    const Config c = config(tied);
    const ParamStore source = filled(c);
    const fs::path dir = temp_.path() / ("model-" + std::to_string(tied));
    save_hf_model(dir, c, source.params(), DType::f32);
    EXPECT_EQ(load_config(dir.string()), c);
    EXPECT_FALSE(fs::exists(temp_.path() / (".tmp-model-" + std::to_string(tied))));
    const optim::SafetensorsHeader header = optim::read_safetensors_header(dir / "model.safetensors");
    EXPECT_EQ(header.tensors.size(), source.infos().size());
    EXPECT_EQ(header.metadata.at("format"), "pt");

    ParamStore loaded = filled(c);
    load_hf_weights(dir, c, loaded.params());
    EXPECT_TRUE(bytes_of(loaded.param_buffer()) == bytes_of(source.param_buffer()));
    ParamStore wide(c, DType::f64);
    load_hf_weights(dir, c, wide.params());
    const float* a = source.param_buffer().ptr<float>();
    const double* b = wide.param_buffer().ptr<double>();
    for (std::int64_t i = 0; i < source.numel(); ++i) ASSERT_EQ(static_cast<double>(a[i]), b[i]) << i;

    // Nothing is overwritten.
    EXPECT_THROW(save_hf_model(dir, c, loaded.params(), DType::f32), Failure);
    load_hf_weights(dir, c, loaded.params());
    EXPECT_TRUE(bytes_of(loaded.param_buffer()) == bytes_of(source.param_buffer()));
  }
}

TEST_F(HfCheckpoint, Bf16FileHoldsRoundedValues) {
  const Config c = config();
  const ParamStore source = filled(c);
  const fs::path dir = temp_.path() / "bf16";
  save_hf_model(dir, c, source.params(), DType::bf16);
  for (const optim::SafetensorsEntry& entry : optim::read_safetensors_header(dir / "model.safetensors").tensors) {
    EXPECT_EQ(entry.dtype, DType::bf16) << entry.name;
  }
  ParamStore as_f32 = filled(c);
  ParamStore as_bf16(c, DType::bf16);
  load_hf_weights(dir, c, as_f32.params());
  load_hf_weights(dir, c, as_bf16.params());
  const float* original = source.param_buffer().ptr<float>();
  const float* f32 = as_f32.param_buffer().ptr<float>();
  const auto* bf16 = as_bf16.param_buffer().ptr<std::uint16_t>();
  for (std::int64_t i = 0; i < source.numel(); ++i) {
    ASSERT_EQ(f32[i], round_to_bf16(original[i])) << i;
    ASSERT_EQ(bf16_value(bf16[i]), f32[i]) << i;
  }
  // A bf16 store saves to f32 exactly, and back.
  const fs::path again = temp_.path() / "from-bf16";
  save_hf_model(again, c, as_bf16.params(), DType::f32);
  ParamStore back(c, DType::f32);
  load_hf_weights(again, c, back.params());
  EXPECT_TRUE(bytes_of(back.param_buffer()) == bytes_of(as_f32.param_buffer()));
}

TEST_F(HfCheckpoint, ReadsF16AndF64Files) {
  const Config c = config();
  const ParamStore source = filled(c);
  std::vector<Tensor> f64 = tensors_of(source), f16 = tensors_of(source);
  for (std::size_t t = 0; t < f64.size(); ++t) {
    const auto* values = reinterpret_cast<const float*>(f64[t].bytes.data());
    const std::size_t n = f64[t].bytes.size() / sizeof(float);
    std::vector<std::byte> wide(n * 8), half(n * 2);
    for (std::size_t i = 0; i < n; ++i) {
      const double d = values[i];
      const _Float16 h = static_cast<_Float16>(values[i]);
      std::memcpy(wide.data() + 8 * i, &d, 8);
      std::memcpy(half.data() + 2 * i, &h, 2);
    }
    f64[t].dtype = DType::f64;
    f64[t].bytes = std::move(wide);
    f16[t].dtype = DType::f16;
    f16[t].bytes = std::move(half);
  }
  write_file(fresh_dir("f64") / "model.safetensors", f64);
  write_file(fresh_dir("f16") / "model.safetensors", f16);
  ParamStore loaded(c, DType::f32), halves(c, DType::f64);
  load_hf_weights(temp_.path() / "f64", c, loaded.params());
  EXPECT_TRUE(bytes_of(loaded.param_buffer()) == bytes_of(source.param_buffer()));
  load_hf_weights(temp_.path() / "f16", c, halves.params());
  const float* original = source.param_buffer().ptr<float>();
  const double* got = halves.param_buffer().ptr<double>();
  for (std::int64_t i = 0; i < source.numel(); ++i) {
    ASSERT_EQ(got[i], static_cast<double>(static_cast<_Float16>(original[i]))) << i;
  }
}

TEST_F(HfCheckpoint, MissingTensorIsRefusedByName) {
  const Config c = config(0);
  const ParamStore source = filled(c);
  std::vector<Tensor> tensors = tensors_of(source);
  const std::size_t drop = std::uniform_int_distribution<std::size_t>(0, tensors.size() - 1)(rng_);
  const std::string name = tensors[drop].name;
  tensors.erase(tensors.begin() + static_cast<std::ptrdiff_t>(drop));
  const fs::path dir = fresh_dir("missing");
  write_file(dir / "model.safetensors", tensors);
  expect_refused<InvalidArgument>(dir, c, filled(c), {name, "missing", "model.safetensors"}, name);
}

TEST_F(HfCheckpoint, ExtraTensorIsRefusedByName) {
  const Config c = config();
  const ParamStore source = filled(c);
  std::vector<Tensor> tensors = tensors_of(source);
  tensors.insert(tensors.begin() + 1,
                 Tensor{"model.layers.0.mlp.extra_proj.weight", DType::f32, {2, 3}, std::vector<std::byte>(24)});
  const fs::path dir = fresh_dir("extra");
  write_file(dir / "model.safetensors", tensors);
  expect_refused<InvalidArgument>(dir, c, filled(c),
                                  {"model.layers.0.mlp.extra_proj.weight", "model.safetensors", "not a parameter"},
                                  "model.layers.0.mlp.extra_proj.weight");
}

TEST_F(HfCheckpoint, WrongShapeIsRefusedByName) {
  const Config c = config();
  const ParamStore source = filled(c);
  std::vector<Tensor> tensors = tensors_of(source);
  const std::size_t t = std::uniform_int_distribution<std::size_t>(0, tensors.size() - 1)(rng_);
  tensors[t].shape[0] += 1;
  std::int64_t numel = 1;
  for (std::int64_t d : tensors[t].shape) numel *= d;
  tensors[t].bytes.resize(static_cast<std::size_t>(numel) * 4);
  const fs::path dir = fresh_dir("shape");
  write_file(dir / "model.safetensors", tensors);
  expect_refused<InvalidArgument>(dir, c, filled(c), {tensors[t].name, "shape", "the config needs"}, tensors[t].name);
}

TEST_F(HfCheckpoint, UnsupportedDtypeIsRefusedByName) {
  const Config c = config();
  std::vector<Tensor> tensors = tensors_of(filled(c));
  const std::size_t t = std::uniform_int_distribution<std::size_t>(0, tensors.size() - 1)(rng_);
  tensors[t].dtype = DType::i32;  // same size as F32
  const fs::path dir = fresh_dir("dtype");
  write_file(dir / "model.safetensors", tensors);
  expect_refused<InvalidArgument>(dir, c, filled(c), {tensors[t].name, "I32"}, tensors[t].name);
}

TEST_F(HfCheckpoint, TruncatedFileIsRefusedByName) {
  const Config c = config();
  const fs::path dir = temp_.path() / "truncated";
  save_hf_model(dir, c, filled(c).params(), DType::f32);
  const fs::path file = dir / "model.safetensors";
  fs::resize_file(file, fs::file_size(file) - 1 - std::uniform_int_distribution<std::uintmax_t>(0, 100)(rng_));
  expect_refused<Failure>(dir, c, filled(c), {file.string(), "truncated"});
  fs::resize_file(file, 5);  // not even the header's length
  expect_refused<Failure>(dir, c, filled(c), {file.string()});
}

TEST_F(HfCheckpoint, RefusesADirectoryWithoutWeights) {
  const Config c = config();
  const fs::path dir = fresh_dir("empty");
  expect_refused<InvalidArgument>(dir, c, filled(c), {"model.safetensors", dir.string()}, "dir");
}

TEST_F(HfCheckpoint, ReadsShardsThroughTheIndex) {
  const Config c = config();
  const ParamStore source = filled(c);
  const std::vector<Tensor> tensors = tensors_of(source);
  const int shards = 3;
  std::vector<std::vector<Tensor>> files(shards);
  nlohmann::json weight_map = nlohmann::json::object();
  for (const Tensor& t : tensors) {
    const int s = static_cast<int>(std::uniform_int_distribution<int>(0, shards - 1)(rng_));
    files[s].push_back(t);
    weight_map[t.name] = "model-0000" + std::to_string(s + 1) + "-of-00003.safetensors";
  }
  const fs::path dir = fresh_dir("sharded");
  for (int s = 0; s < shards; ++s)
    write_file(dir / ("model-0000" + std::to_string(s + 1) + "-of-00003.safetensors"), files[s]);
  auto write_index = [&](const nlohmann::json& map) {
    std::ofstream(dir / "model.safetensors.index.json", std::ios::trunc)
        << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump(2);
  };
  write_index(weight_map);
  ParamStore loaded = filled(c);
  load_hf_weights(dir, c, loaded.params());
  EXPECT_TRUE(bytes_of(loaded.param_buffer()) == bytes_of(source.param_buffer()));

  // An index that places a tensor in the wrong shard, or names a shard that is not there, is refused.
  nlohmann::json wrong = weight_map;
  const std::string& moved = tensors.front().name;
  const std::string home = wrong[moved];
  wrong[moved] = home == "model-00001-of-00003.safetensors" ? "model-00002-of-00003.safetensors"
                                                            : "model-00001-of-00003.safetensors";
  write_index(wrong);
  expect_refused<Failure>(dir, c, filled(c), {moved, "model.safetensors.index.json"});
  wrong = weight_map;
  wrong[moved] = "model-00009-of-00009.safetensors";
  write_index(wrong);
  expect_refused<Failure>(dir, c, filled(c), {"model-00009-of-00009.safetensors"});
  wrong = weight_map;
  wrong[moved] = "../elsewhere.safetensors";
  write_index(wrong);
  expect_refused<Failure>(dir, c, filled(c), {"../elsewhere.safetensors"});
  write_index(nlohmann::json::array());
  expect_refused<Failure>(dir, c, filled(c), {"weight_map"});
}

TEST_F(HfCheckpoint, ReadsTheMultimodalCheckpointsNames) {
  const Config c = config(1);
  const ParamStore source = filled(c);
  std::vector<Tensor> tensors = tensors_of(source);
  for (Tensor& t : tensors) t.name = "model.language_model." + t.name.substr(std::string("model.").size());
  // transformers' state dict carries the tied lm_head too; the vision tower and the MTP head are skipped.
  tensors.push_back({"lm_head.weight", DType::f32, tensors.front().shape, tensors.front().bytes});
  tensors.push_back({"model.visual.blocks.0.attn.qkv.weight", DType::bf16, {6, 2}, std::vector<std::byte>(24)});
  tensors.push_back({"model.visual.merger.linear_fc1.bias", DType::f32, {3}, std::vector<std::byte>(12)});
  tensors.push_back({"mtp.fc.weight", DType::bf16, {4, 8}, std::vector<std::byte>(64)});
  std::shuffle(tensors.begin(), tensors.end(), rng_);
  const fs::path dir = fresh_dir("multimodal");
  write_file(dir / "model.safetensors", tensors);
  ParamStore loaded = filled(c);
  load_hf_weights(dir, c, loaded.params());
  EXPECT_TRUE(bytes_of(loaded.param_buffer()) == bytes_of(source.param_buffer()));

  // One parameter under both names is refused.
  tensors.push_back({"model.norm.weight", DType::f32, {c.hidden_size}, std::vector<std::byte>(4 * c.hidden_size)});
  const fs::path twice = fresh_dir("twice");
  write_file(twice / "model.safetensors", tensors);
  expect_refused<InvalidArgument>(twice, c, filled(c), {"model.norm.weight", "model.language_model.norm.weight"});
}

TEST_F(HfCheckpoint, TiedLmHeadMustEqualTheEmbedding) {
  const Config c = config(1);
  const ParamStore source = filled(c);
  std::vector<Tensor> tensors = tensors_of(source);
  Tensor head{"lm_head.weight", DType::bf16, tensors.front().shape, {}};
  // In bf16 beside an f32 embedding: equal when the embedding's values are bf16 values.
  auto* embedding = reinterpret_cast<float*>(tensors.front().bytes.data());
  const std::size_t n = tensors.front().bytes.size() / 4;
  head.bytes.resize(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    embedding[i] = round_to_bf16(embedding[i]);
    std::uint32_t bits;
    std::memcpy(&bits, &embedding[i], 4);
    const auto high = static_cast<std::uint16_t>(bits >> 16);
    std::memcpy(head.bytes.data() + 2 * i, &high, 2);
  }
  tensors.push_back(head);
  const fs::path dir = fresh_dir("tied");
  write_file(dir / "model.safetensors", tensors);
  ParamStore loaded = filled(c);
  load_hf_weights(dir, c, loaded.params());
  EXPECT_TRUE(bytes_of(loaded.param("model.embed_tokens.weight")) == tensors.front().bytes);

  const std::size_t changed = std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_);
  tensors.back().bytes[2 * changed] ^= std::byte{1};
  const fs::path differs = fresh_dir("tied-differs");
  write_file(differs / "model.safetensors", tensors);
  expect_refused<InvalidArgument>(differs, c, filled(c), {"lm_head.weight", "differs from the embedding"},
                                  "lm_head.weight");

  // Untied, lm_head.weight is a parameter of its own: without it the load is refused.
  Config untied = c;
  untied.tie_word_embeddings = false;
  tensors.pop_back();
  const fs::path no_head = fresh_dir("untied");
  write_file(no_head / "model.safetensors", tensors);
  expect_refused<InvalidArgument>(no_head, untied, filled(untied), {"lm_head.weight", "missing"}, "lm_head.weight");
}

TEST_F(HfCheckpoint, SaveChecksItsArguments) {
  const Config c = config();
  const ParamStore source = filled(c);
  EXPECT_THROW(save_hf_model(temp_.path() / "f64", c, source.params(), DType::f64), InvalidArgument);
  Config other = c;
  other.intermediate_size += 1;  // the views no longer have the config's shapes
  EXPECT_THROW(save_hf_model(temp_.path() / "other", other, source.params(), DType::f32), InvalidArgument);
  EXPECT_FALSE(fs::exists(temp_.path() / "f64"));
  EXPECT_FALSE(fs::exists(temp_.path() / "other"));
  // A missing parent directory is created; a trailing slash names the same directory.
  save_hf_model(temp_.path() / "a" / "b" / "model/", c, source.params(), DType::f32);
  EXPECT_TRUE(fs::exists(temp_.path() / "a" / "b" / "model" / "config.json"));
}

}  // namespace
}  // namespace deltatrain::model
