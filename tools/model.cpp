// `deltatrain model ...`: the hybrid GDN model. `model info --config NAME|PATH`: a config's shape, its
// parameters by kind, FLOPs per token (forward and training) and the memory of its training state.
// `model check --config NAME|PATH`: the CPU model's correctness checks (check.h) on random weights.
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "deltatrain/core/error.h"
#include "deltatrain/model/check.h"
#include "deltatrain/model/config.h"
#include "deltatrain/model/cost.h"
#include "deltatrain/model/params.h"

namespace deltatrain::tools {
namespace {

// Bytes of training state per parameter: the bf16 parameter (2), its fp32 gradient (4), and the optimizer's
// fp32 master copy and two Adam moments (12). Activations are not included; neither is the ZeRO-1 split.
constexpr double kParamBytes = 2, kGradBytes = 4, kOptimizerBytes = 12;
constexpr double kTrainingBytesPerParam = kParamBytes + kGradBytes + kOptimizerBytes;

struct InfoArgs {
  std::string config;
  std::int64_t seq_len = 4096;
  bool json = false;
};

nlohmann::ordered_json flops_json(const model::TokenFlops& f) {
  return {
      {"matmul", f.matmul}, {"attention", f.attention}, {"gdn", f.gdn}, {"lm_head", f.lm_head}, {"total", f.total()}};
}

std::string grouped(std::int64_t n) {  // 752393024 -> "752,393,024"
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0 && digits[i - 1] != '-') out += ',';
    out += digits[i];
  }
  return out;
}

void info(const InfoArgs& args) {
  if (args.seq_len < 1) throw InvalidArgument("--seq-len", "must be at least 1; got " + std::to_string(args.seq_len));
  const model::Config c = load_config_flag(args.config);
  const std::vector<model::ParamInfo> infos = model::param_infos(c);

  int linear_layers = 0, full_layers = 0;
  for (model::LayerKind kind : c.layer_types)
    (kind == model::LayerKind::linear_attention ? linear_layers : full_layers)++;
  // Parameters by kind, in the order of the ParamKind enumeration.
  std::map<model::ParamKind, std::int64_t> by_kind;
  std::int64_t total = 0;
  for (const model::ParamInfo& p : infos) {
    by_kind[p.kind] += p.numel();
    total += p.numel();
  }
  const model::TokenFlops forward = model::forward_flops_per_token(c, args.seq_len);
  const model::TokenFlops training = model::training_flops_per_token(c, args.seq_len);
  const double state_bytes = kTrainingBytesPerParam * static_cast<double>(total);
  const double gib = 1024.0 * 1024.0 * 1024.0;

  if (args.json) {
    nlohmann::ordered_json kinds = nlohmann::ordered_json::array();
    for (const auto& [kind, count] : by_kind) {
      kinds.push_back({{"kind", model::param_kind_name(kind)},
                       {"count", count},
                       {"share", static_cast<double>(count) / static_cast<double>(total)}});
    }
    nlohmann::ordered_json out;
    out["config"] = args.config;
    out["model"] = nlohmann::ordered_json::parse(model::config_to_hf_json(c));
    out["layers"] = {
        {"total", c.num_hidden_layers()}, {"linear_attention", linear_layers}, {"full_attention", full_layers}};
    out["parameters"] = {{"by_kind", kinds}, {"total", total}};
    out["flops_per_token"] = {{"seq_len", args.seq_len},
                              {"forward", flops_json(forward)},
                              {"training", flops_json(training)},
                              {"six_n", 6.0 * static_cast<double>(total)}};
    out["training_state"] = {
        {"bytes_per_param", kTrainingBytesPerParam}, {"param_bytes", kParamBytes}, {"grad_bytes", kGradBytes},
        {"optimizer_bytes", kOptimizerBytes},        {"bytes", state_bytes},       {"gib", state_bytes / gib}};
    std::printf("%s\n", out.dump(2).c_str());
    return;
  }

  std::printf("config        %s\n", args.config.c_str());
  std::printf("layers        %d: %d linear_attention (GDN), %d full_attention\n", c.num_hidden_layers(), linear_layers,
              full_layers);
  std::printf("hidden        %lld  intermediate %lld  vocab %lld  embeddings %s\n",
              static_cast<long long>(c.hidden_size), static_cast<long long>(c.intermediate_size),
              static_cast<long long>(c.vocab_size), c.tie_word_embeddings ? "tied" : "untied");
  std::printf("attention     %d q / %d kv heads x %d, RoPE on %d of %d (theta %g)\n", c.num_attention_heads,
              c.num_key_value_heads, c.head_dim, c.rotary_dim(), c.head_dim, c.rope_theta);
  std::printf("gdn           %d key / %d value heads x %d / %d, conv %d\n", c.linear_num_key_heads,
              c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim);
  std::printf("rms_norm_eps  %g\n\n", c.rms_norm_eps);

  std::printf("%-14s %15s %8s\n", "parameters", "count", "share");
  for (const auto& [kind, count] : by_kind) {
    std::printf("  %-12s %15s %7.2f%%\n", model::param_kind_name(kind), grouped(count).c_str(),
                100.0 * static_cast<double>(count) / static_cast<double>(total));
  }
  std::printf("  %-12s %15s\n\n", "total", grouped(total).c_str());

  std::printf("%-14s %13s %13s   (GFLOP per token, seq_len %lld)\n", "FLOPs", "forward", "training",
              static_cast<long long>(args.seq_len));
  const std::pair<const char*, double model::TokenFlops::*> parts[] = {{"matmul", &model::TokenFlops::matmul},
                                                                       {"attention", &model::TokenFlops::attention},
                                                                       {"gdn", &model::TokenFlops::gdn},
                                                                       {"lm_head", &model::TokenFlops::lm_head}};
  for (const auto& [name, part] : parts) {
    std::printf("  %-12s %13.4f %13.4f\n", name, forward.*part / 1e9, training.*part / 1e9);
  }
  std::printf("  %-12s %13.4f %13.4f\n", "total", forward.total() / 1e9, training.total() / 1e9);
  std::printf("  %-12s %13s %13.4f\n\n", "6N", "", 6.0 * static_cast<double>(total) / 1e9);

  std::printf(
      "training state  %.2f GiB: %g B per parameter (bf16 param %g + fp32 grad %g + fp32 master and Adam "
      "moments %g) x %s\n",
      state_bytes / gib, kTrainingBytesPerParam, kParamBytes, kGradBytes, kOptimizerBytes, grouped(total).c_str());
}

struct CheckArgs {
  std::string config;
  std::uint64_t seed = 0;
  std::vector<std::int32_t> lengths = model::CheckOptions{}.sequence_lengths;
  int samples = model::CheckOptions{}.gradient_samples;
  bool json = false;
};

// Prints each check with its error and tolerance; a failed check fails the command.
void check(const CheckArgs& args) {
  const model::Config config = load_config_flag(args.config);
  model::CheckOptions options;
  options.seed = args.seed;
  options.sequence_lengths = args.lengths;
  options.gradient_samples = args.samples;
  const std::vector<model::CheckResult> results = model::run_model_checks(config, options);
  bool all = true;
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  if (!args.json) std::printf("%-16s %-6s %12s %12s  %s\n", "check", "", "error", "tolerance", "detail");
  for (const model::CheckResult& r : results) {
    all = all && r.pass();
    if (args.json) {
      rows.push_back({{"check", r.name}, {"pass", r.pass()}, {"error", r.error}, {"tolerance", r.tolerance},
                      {"detail", r.detail}});
    } else {
      std::printf("%-16s %-6s %12.3e %12.3e  %s\n", r.name.c_str(), r.pass() ? "PASS" : "FAIL", r.error, r.tolerance,
                  r.detail.c_str());
    }
  }
  if (args.json) std::printf("%s\n", nlohmann::ordered_json{{"config", args.config}, {"seed", args.seed},
                                                          {"pass", all}, {"checks", rows}}.dump(1).c_str());
  if (!all) throw Failure("model check: a check failed (seed " + std::to_string(args.seed) + ")");
}

}  // namespace

model::Config load_config_flag(const std::string& config) {
  try {
    return model::load_config(config);
  } catch (const InvalidArgument& e) {
    if (e.argument() != "name_or_path") throw;  // a field of the config.json it read, which the error names
    throw InvalidArgument("config", e.rule());
  }
}

void add_model_command(CLI::App& parent) {
  CLI::App* model_command = parent.add_subcommand("model", "the hybrid GDN model");
  model_command->require_subcommand(1);
  CLI::App* info_command =
      model_command->add_subcommand("info", "a config's shape, parameters, FLOPs per token and training memory");
  auto args = std::make_shared<InfoArgs>();
  info_command
      ->add_option("--config", args->config, "a preset (tiny, qwen3.5-0.8b), a config.json, or a directory holding one")
      ->required();
  info_command->add_option("--seq-len", args->seq_len, "tokens per sequence, for the attention FLOPs")
      ->capture_default_str();
  info_command->add_flag("--json", args->json, "the report as JSON");
  info_command->callback([args] { info(*args); });

  CLI::App* check_command = model_command->add_subcommand(
      "check", "the CPU model against an independent float64 evaluation, finite differences, packing, "
               "determinism and save/load, on random weights");
  auto check_args = std::make_shared<CheckArgs>();
  check_command->add_option("--config", check_args->config, "a preset, a config.json, or a directory holding one")
      ->required();
  check_command->add_option("--seed", check_args->seed, "random weights and tokens")->capture_default_str();
  // CLI::PositiveNumber would print its range as 0 to 1.8e308 (it admits 0.5, not 0): these are counts from 1.
  const CLI::Range count(1, std::numeric_limits<std::int32_t>::max());
  check_command->add_option("--seqlens", check_args->lengths, "lengths of the packed sequences (70,1,13)")
      ->capture_default_str()
      ->delimiter(',')
      ->check(count);
  check_command->add_option("--gradient-samples", check_args->samples, "elements per parameter tensor")
      ->capture_default_str()
      ->check(count);
  check_command->add_flag("--json", check_args->json, "the results as JSON");
  check_command->callback([check_args] { check(*check_args); });
}

}  // namespace deltatrain::tools
