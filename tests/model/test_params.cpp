// The parameter list (HF's names, shapes and order), its count against an independent formula, the
// deterministic initialisation (per parameter streams, dtypes, distributions), ParamStore's views, and the
// FLOPs per token (cost.h) against sums over the parameter list.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>

#include "deltatrain/core/error.h"
#include "deltatrain/model/cost.h"
#include "deltatrain/model/params.h"
#include "model_testing.h"

namespace deltatrain::model {
namespace {

using testing::random_config;
using testing::SeededTest;

using Shape = std::vector<std::int64_t>;

// bf16 round-to-nearest-even, written independently of the library's bit trick: via fp64 rounding.
float round_to_bf16(float x) {
  if (x == 0 || !std::isfinite(x)) return x;
  int exponent = 0;
  std::frexp(static_cast<double>(x), &exponent);         // |x| in [2^(e-1), 2^e)
  const double quantum = std::ldexp(1.0, exponent - 8);  // 8 significant bits
  return static_cast<float>(std::nearbyint(static_cast<double>(x) / quantum) * quantum);
}

float bf16_value(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}

const ParamInfo& find(const std::vector<ParamInfo>& infos, const std::string& name) {
  for (const ParamInfo& info : infos) {
    if (info.name == name) return info;
  }
  throw std::runtime_error("no parameter " + name);
}

std::vector<std::string> layer_names(const std::vector<ParamInfo>& infos, int layer) {
  const std::string prefix = "model.layers." + std::to_string(layer) + ".";
  std::vector<std::string> names;
  for (const ParamInfo& info : infos) {
    if (info.name.rfind(prefix, 0) == 0) names.push_back(info.name.substr(prefix.size()));
  }
  return names;
}

// The parameter count from the config's fields, written without param_infos.
std::int64_t count_by_formula(const Config& c) {
  const std::int64_t h = c.hidden_size, nv = c.linear_num_value_heads;
  const std::int64_t qk = std::int64_t{c.linear_num_key_heads} * c.linear_key_head_dim;
  const std::int64_t vd = nv * c.linear_value_head_dim;
  const std::int64_t conv = 2 * qk + vd;
  const std::int64_t gdn =
      conv * h + vd * h + 2 * nv * h + conv * c.linear_conv_kernel_dim + 2 * nv + c.linear_value_head_dim + h * vd;
  const std::int64_t q = std::int64_t{c.num_attention_heads} * c.head_dim;
  const std::int64_t kv = std::int64_t{c.num_key_value_heads} * c.head_dim;
  const std::int64_t attention = 2 * q * h + 2 * kv * h + h * q + 2 * c.head_dim;
  const std::int64_t common = 2 * h + 3 * h * c.intermediate_size;
  std::int64_t total = c.vocab_size * h + h + (c.tie_word_embeddings ? 0 : c.vocab_size * h);
  for (LayerKind kind : c.layer_types) total += common + (kind == LayerKind::linear_attention ? gdn : attention);
  return total;
}

TEST(ParamInfos, Qwen35_08bNamesShapesAndOrder) {
  const std::vector<ParamInfo> infos = param_infos(preset("qwen3.5-0.8b"));
  ASSERT_EQ(infos.size(), 1u + 18 * 14 + 6 * 11 + 1);
  EXPECT_EQ(infos.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(infos.front().shape, (Shape{248320, 1024}));
  EXPECT_EQ(infos.back().name, "model.norm.weight");  // tied: no lm_head.weight
  EXPECT_EQ(
      layer_names(infos, 0),
      (std::vector<std::string>{
          "input_layernorm.weight", "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
          "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.conv1d.weight",
          "linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.norm.weight", "linear_attn.out_proj.weight",
          "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}));
  EXPECT_EQ(layer_names(infos, 3),
            (std::vector<std::string>{"input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                      "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                                      "self_attn.k_norm.weight", "post_attention_layernorm.weight",
                                      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}));
  // The shapes model.md records from transformers.
  const std::pair<const char*, Shape> shapes[] = {
      {"model.layers.0.linear_attn.in_proj_qkv.weight", {6144, 1024}},
      {"model.layers.0.linear_attn.in_proj_z.weight", {2048, 1024}},
      {"model.layers.0.linear_attn.in_proj_b.weight", {16, 1024}},
      {"model.layers.0.linear_attn.in_proj_a.weight", {16, 1024}},
      {"model.layers.0.linear_attn.conv1d.weight", {6144, 1, 4}},
      {"model.layers.0.linear_attn.A_log", {16}},
      {"model.layers.0.linear_attn.dt_bias", {16}},
      {"model.layers.0.linear_attn.norm.weight", {128}},
      {"model.layers.0.linear_attn.out_proj.weight", {1024, 2048}},
      {"model.layers.3.self_attn.q_proj.weight", {4096, 1024}},
      {"model.layers.3.self_attn.k_proj.weight", {512, 1024}},
      {"model.layers.3.self_attn.v_proj.weight", {512, 1024}},
      {"model.layers.3.self_attn.o_proj.weight", {1024, 2048}},
      {"model.layers.3.self_attn.q_norm.weight", {256}},
      {"model.layers.3.self_attn.k_norm.weight", {256}},
      {"model.layers.23.input_layernorm.weight", {1024}},
      {"model.layers.23.post_attention_layernorm.weight", {1024}},
      {"model.layers.22.mlp.gate_proj.weight", {3584, 1024}},
      {"model.layers.22.mlp.up_proj.weight", {3584, 1024}},
      {"model.layers.22.mlp.down_proj.weight", {1024, 3584}},
      {"model.norm.weight", {1024}},
  };
  for (const auto& [name, shape] : shapes) EXPECT_EQ(find(infos, name).shape, shape) << name;
  std::set<std::string> unique;
  for (const ParamInfo& info : infos) EXPECT_TRUE(unique.insert(info.name).second) << info.name;
}

TEST(ParamInfos, KindsFollowTheNames) {
  Config c = preset("tiny");
  c.tie_word_embeddings = false;
  const std::vector<ParamInfo> infos = param_infos(c);
  EXPECT_EQ(infos.back().name, "lm_head.weight");
  EXPECT_EQ(infos.back().shape, (Shape{4096, 128}));
  auto ends = [](const std::string& name, const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (const ParamInfo& info : infos) {
    ParamKind expected;
    const std::string& n = info.name;
    if (n == "model.embed_tokens.weight") {
      expected = ParamKind::embedding;
    } else if (n == "lm_head.weight") {
      expected = ParamKind::lm_head;
    } else if (ends(n, "layernorm.weight") || ends(n, "q_norm.weight") || ends(n, "k_norm.weight") ||
               n == "model.norm.weight") {
      expected = ParamKind::norm;
    } else if (ends(n, "linear_attn.norm.weight")) {
      expected = ParamKind::gated_norm;
    } else if (ends(n, "conv1d.weight")) {
      expected = ParamKind::gdn_conv;
    } else if (ends(n, "A_log") || ends(n, "dt_bias")) {
      expected = ParamKind::gdn_decay;
    } else if (n.find("linear_attn.") != std::string::npos) {
      expected = ParamKind::gdn_linear;
    } else if (n.find("self_attn.") != std::string::npos) {
      expected = ParamKind::attention;
    } else {
      expected = ParamKind::mlp;
      EXPECT_NE(n.find(".mlp."), std::string::npos) << n;
    }
    EXPECT_EQ(info.kind, expected) << n << " is " << param_kind_name(info.kind);
  }
}

class Params : public SeededTest {};

TEST_F(Params, CountMatchesAnIndependentFormula) {
  EXPECT_EQ(count_by_formula(preset("qwen3.5-0.8b")), 752'393'024);
  for (int i = 0; i < 200; ++i) {
    const Config c = random_config(rng_);
    std::int64_t sum = 0;
    for (const ParamInfo& info : param_infos(c)) sum += info.numel();
    EXPECT_EQ(param_count(c), sum);
    EXPECT_EQ(param_count(c), count_by_formula(c));
  }
  Config bad = preset("tiny");
  bad.linear_num_value_heads = 3;
  EXPECT_THROW(param_infos(bad), InvalidArgument);
}

TEST_F(Params, InitIsDeterministicPerSeedAndName) {
  const std::uint64_t seed = rng_();
  const ParamInfo a{"model.layers.0.mlp.up_proj.weight", {64, 32}, ParamKind::mlp};
  const ParamInfo b{"model.layers.1.mlp.up_proj.weight", {64, 32}, ParamKind::mlp};
  std::vector<float> first(2048), again(2048), other_name(2048), other_seed(2048);
  init_param(a, 0.02, seed, DType::f32, first.data());
  init_param(b, 0.02, seed, DType::f32, other_name.data());  // drawing b first must not change a
  init_param(a, 0.02, seed, DType::f32, again.data());
  init_param(a, 0.02, seed + 1, DType::f32, other_seed.data());
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other_name);
  EXPECT_NE(first, other_seed);
}

TEST_F(Params, DtypesHoldTheSameValuesRounded) {
  const std::uint64_t seed = rng_();
  const ParamInfo info{"model.layers.2.linear_attn.out_proj.weight", {100, 77}, ParamKind::gdn_linear};
  const std::size_t n = 7700;
  std::vector<double> f64(n);
  std::vector<float> f32(n);
  std::vector<std::uint16_t> bf16(n);
  init_param(info, 0.05, seed, DType::f64, f64.data());
  init_param(info, 0.05, seed, DType::f32, f32.data());
  init_param(info, 0.05, seed, DType::bf16, bf16.data());
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(f32[i], static_cast<float>(f64[i])) << i;
    ASSERT_EQ(bf16_value(bf16[i]), round_to_bf16(f32[i])) << i;
  }
  EXPECT_THROW(init_param(info, 0.05, seed, DType::i32, f32.data()), InvalidArgument);
  try {
    init_param(info, 0.05, seed, DType::f32, nullptr);
    ADD_FAILURE() << "null data accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "data");
  }
}

TEST_F(Params, DistributionsFollowHfsScheme) {
  const std::uint64_t seed = rng_();
  const std::size_t n = 200'000;
  std::vector<double> v(n);
  // Normal(0, std) weights: mean, std and kurtosis of a large sample.
  const double std_dev = 0.02 + 0.01 * std::uniform_real_distribution<double>(0, 1)(rng_);
  init_param({"model.embed_tokens.weight", {2000, 100}, ParamKind::embedding}, std_dev, seed, DType::f64, v.data());
  double mean = 0, m2 = 0, m4 = 0;
  for (double x : v) mean += x;
  mean /= n;
  for (double x : v) {
    m2 += (x - mean) * (x - mean);
    m4 += std::pow(x - mean, 4);
  }
  m2 /= n;
  m4 /= n;
  EXPECT_LT(std::abs(mean), 5 * std_dev / std::sqrt(static_cast<double>(n)));
  EXPECT_NEAR(std::sqrt(m2) / std_dev, 1.0, 0.01);
  EXPECT_NEAR(m4 / (m2 * m2), 3.0, 0.1);
  // A_log = log U(0.01, 16).
  init_param({"model.layers.0.linear_attn.A_log", {static_cast<std::int64_t>(n)}, ParamKind::gdn_decay}, std_dev, seed,
             DType::f64, v.data());
  double a_mean = 0;
  for (double x : v) {
    ASSERT_GE(x, std::log(0.01));
    ASSERT_LT(x, std::log(16.0));
    a_mean += std::exp(x);
  }
  EXPECT_NEAR(a_mean / n, (0.01 + 16) / 2, 0.1);
  // Constants.
  const std::pair<ParamInfo, double> constants[] = {
      {{"model.layers.0.linear_attn.dt_bias", {16}, ParamKind::gdn_decay}, 1.0},
      {{"model.layers.0.linear_attn.norm.weight", {16}, ParamKind::gated_norm}, 1.0},
      {{"model.layers.0.input_layernorm.weight", {16}, ParamKind::norm}, 0.0},
      {{"model.norm.weight", {16}, ParamKind::norm}, 0.0},
  };
  for (const auto& [info, value] : constants) {
    init_param(info, std_dev, seed, DType::f64, v.data());
    for (int i = 0; i < 16; ++i) EXPECT_EQ(v[i], value) << info.name;
  }
}

TEST_F(Params, StoreViewsOneContiguousBuffer) {
  const Config c = random_config(rng_);
  for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
    ParamStore store(c, dtype);
    EXPECT_EQ(store.numel(), param_count(c));
    EXPECT_EQ(store.grad_dtype(), dtype == DType::bf16 ? DType::f32 : dtype);
    const TensorView params = store.param_buffer();
    const TensorView grads = store.grad_buffer();
    EXPECT_EQ(params.numel(), store.numel());
    EXPECT_EQ(params.dtype, dtype);
    EXPECT_EQ(grads.dtype, store.grad_dtype());
    std::int64_t offset = 0;
    for (const ParamInfo& info : store.infos()) {
      const TensorView p = store.param(info.name);
      const TensorView g = store.grads()(info.name);
      EXPECT_EQ(p.data, static_cast<char*>(params.data) + offset * dtype_size(dtype)) << info.name;
      EXPECT_EQ(g.data, static_cast<char*>(grads.data) + offset * dtype_size(store.grad_dtype())) << info.name;
      EXPECT_EQ(store.params()(info.name).data, p.data);
      ASSERT_EQ(p.ndim, static_cast<int>(info.shape.size()));
      for (int d = 0; d < p.ndim; ++d) EXPECT_EQ(p.shape[d], info.shape[d]);
      EXPECT_TRUE(p.is_contiguous());
      EXPECT_EQ(p.dtype, dtype);
      offset += info.numel();
    }
    try {
      store.param("model.layers.99.mlp.up_proj.weight");
      ADD_FAILURE() << "unknown name accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), "name");
      EXPECT_NE(std::string(e.what()).find("model.layers.99.mlp.up_proj.weight"), std::string::npos);
    }
    EXPECT_THROW(store.grad("nope"), InvalidArgument);
  }
  EXPECT_THROW(ParamStore(c, DType::i64), InvalidArgument);
}

TEST_F(Params, StoreInitEqualsInitParamAndZeroGrads) {
  const Config c = random_config(rng_);
  const std::uint64_t seed = rng_();
  ParamStore store(c, DType::f32);
  store.init(c.initializer_range, seed);
  for (const ParamInfo& info : store.infos()) {
    std::vector<float> alone(static_cast<std::size_t>(info.numel()));
    init_param(info, c.initializer_range, seed, DType::f32, alone.data());
    ASSERT_EQ(std::memcmp(alone.data(), store.param(info.name).data, alone.size() * sizeof(float)), 0) << info.name;
  }
  const TensorView grads = store.grad_buffer();
  float* g = grads.ptr<float>();
  for (std::int64_t i = 0; i < grads.numel(); ++i) ASSERT_EQ(g[i], 0.0f);
  for (std::int64_t i = 0; i < grads.numel(); ++i) g[i] = 1.5f;
  store.zero_grads();
  for (std::int64_t i = 0; i < grads.numel(); ++i) ASSERT_EQ(g[i], 0.0f);
  EXPECT_THROW(store.init(-1.0, seed), InvalidArgument);
}

TEST(GdnCost, FlopModelOfGdnKernelsMd) {
  EXPECT_NEAR(gdn_forward_flops_per_token_head(128, 128), 182'955, 0.5);
  EXPECT_EQ(gdn_backward_flops_per_token_head(128, 128), 507'904);
}

class Cost : public SeededTest {};

TEST_F(Cost, PartsAgainstTheParameterListAndTheCausalMask) {
  std::vector<Config> configs = {preset("tiny"), preset("qwen3.5-0.8b")};
  for (int i = 0; i < 50; ++i) configs.push_back(random_config(rng_));
  for (const Config& c : configs) {
    const std::int64_t seq_len = std::uniform_int_distribution<std::int64_t>(1, 5000)(rng_);
    // Projection weights, from the parameter list; every other kind is not a product per token.
    double projections = 0, embedding = 0;
    for (const ParamInfo& info : param_infos(c)) {
      if (info.kind == ParamKind::gdn_linear || info.kind == ParamKind::attention || info.kind == ParamKind::mlp) {
        projections += static_cast<double>(info.numel());
      }
      if (info.kind == ParamKind::embedding) embedding = static_cast<double>(info.numel());
    }
    // Query-key pairs of a causal sequence, counted one position at a time.
    double pairs = 0;
    for (std::int64_t t = 1; t <= seq_len; ++t) pairs += static_cast<double>(t);
    int full = 0, linear = 0;
    for (LayerKind kind : c.layer_types) (kind == LayerKind::full_attention ? full : linear)++;
    const double heads_dim = static_cast<double>(c.num_attention_heads) * c.head_dim;
    const double gdn_heads = static_cast<double>(linear) * c.linear_num_value_heads;
    const double K = c.linear_key_head_dim, V = c.linear_value_head_dim, C = 64;

    const TokenFlops fwd = forward_flops_per_token(c, seq_len);
    const TokenFlops train = training_flops_per_token(c, seq_len);
    const double rel = 1e-12;
    EXPECT_NEAR(fwd.matmul, 2 * projections, rel * fwd.matmul);
    EXPECT_NEAR(train.matmul, 6 * projections, rel * train.matmul);
    EXPECT_EQ(fwd.lm_head, 2 * embedding);  // vocab x hidden, tied or not
    EXPECT_EQ(train.lm_head, 6 * embedding);
    const double attention = full * 2.0 * 2.0 * heads_dim * pairs / static_cast<double>(seq_len);
    EXPECT_NEAR(fwd.attention, attention, rel * attention + 1e-9);
    EXPECT_NEAR(train.attention, 3.5 * attention, rel * attention + 1e-9);
    const double gdn_fwd = gdn_heads * (2 * (3 * C * K + 2 * C * V + 3 * K * V) + 2 * C * C / 3);
    const double gdn_bwd = gdn_heads * (18 * C * K + 10 * C * V + 16 * K * V + 4 * C * C);
    EXPECT_NEAR(fwd.gdn, gdn_fwd, rel * gdn_fwd + 1e-9);
    EXPECT_NEAR(train.gdn, gdn_fwd + gdn_bwd, rel * (gdn_fwd + gdn_bwd) + 1e-9);
    EXPECT_EQ(fwd.total(), fwd.matmul + fwd.attention + fwd.gdn + fwd.lm_head);
    if (!c.tie_word_embeddings) {  // the "6N" rule over the weights that multiply, lm_head included
      double multiplying = 0;
      for (const ParamInfo& info : param_infos(c)) {
        if (info.kind != ParamKind::embedding && info.shape.size() == 2)
          multiplying += static_cast<double>(info.numel());
      }
      EXPECT_NEAR(train.matmul + train.lm_head, 6 * multiplying, rel * train.matmul);
    }
  }
  try {
    forward_flops_per_token(preset("tiny"), 0);
    ADD_FAILURE() << "seq_len 0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "seq_len");
  }
  Config bad = preset("tiny");
  bad.hidden_size = 0;
  EXPECT_THROW(training_flops_per_token(bad, 16), InvalidArgument);
}

}  // namespace
}  // namespace deltatrain::model
