// One function per subcommand; each lives in its own file and adds itself to the parent command.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "deltatrain/core/tensor.h"
#include "deltatrain/model/config.h"

namespace deltatrain::tools {

// The model config a command's --config names (model::load_config), a refusal naming that flag. Defined in model.cpp.
model::Config load_config_flag(const std::string& config);

// Refuses, naming `flag`, a value that needs at least `bytes` (a lower bound: `what`) on `device` when that is more
// than the device's memory (device_total_memory: this machine's physical memory, or the GPU's), instead of an
// allocation failing later as "std::bad_alloc" or a CUDA error naming nothing. Defined in run_support.cpp.
void check_fits_in_memory(const std::string& flag, double bytes, const std::string& what, Device device);

// For an unsigned option (--seed): CLI11 would read "-1" as 2^64 - 1; a sign is refused instead.
inline const CLI::Validator kNoSign(
    [](std::string& text) {
      return text.find('-') == std::string::npos ? std::string() : "must be >= 0, got " + text;
    },
    "NON-NEGATIVE");

void add_info_command(CLI::App& app);
void add_bench_gdn_command(CLI::App& bench);
void add_bench_memsaver_command(CLI::App& bench);
void add_optim_command(CLI::App& app);
void add_ckpt_command(CLI::App& app);
void add_model_command(CLI::App& app);  // `model info`, `model check`
void add_train_command(CLI::App& app);  // `train`: data-parallel training under mpirun
void add_generate_command(CLI::App& app);  // `generate`: the rollout engine on token-id prompts
void add_rl_command(CLI::App& app);  // `rl`: colocated GRPO under mpirun

}  // namespace deltatrain::tools
