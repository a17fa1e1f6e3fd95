// `deltatrain ckpt inspect DIR`: a checkpoint's metadata (step, dp size, hyper-parameters, layout,
// files), optionally with every file's SHA-256 checked.
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "deltatrain/core/error.h"
#include "deltatrain/optim/checkpoint.h"

namespace deltatrain::tools {
namespace {

struct InspectArgs {
  std::string dir;
  bool json = false;
  bool verify = false;
};

void print_text(const std::filesystem::path& dir, const optim::CheckpointMetadata& m,
                const std::vector<std::string>& verdicts) {
  std::printf("checkpoint     %s\nformat         %d%s\nstep           %lld\ndp_size        %d\n", dir.string().c_str(),
              m.format_version, m.digest_checked ? "" : " (metadata.json has no digest of its own: edits to it go unseen)",
              static_cast<long long>(m.step), m.dp_size);
  std::printf("adamw          lr %g  betas (%g, %g)  eps %g  weight_decay %g  max_grad_norm %g\n", m.config.lr,
              m.config.beta1, m.config.beta2, m.config.eps, m.config.weight_decay, m.config.max_grad_norm);
  std::printf("layout         alignment %lld  bucket_numel %lld\n", static_cast<long long>(m.layout.options.alignment),
              static_cast<long long>(m.layout.options.bucket_numel));
  for (std::size_t b = 0; b < m.layout.buffers.size(); ++b) {
    const optim::BufferLayout& buffer = m.layout.buffers[b];
    std::printf("buffer %zu       %s  %lld elements  %zu params  %zu buckets\n", b, dtype_name(buffer.dtype),
                static_cast<long long>(buffer.numel), buffer.params.size(), buffer.buckets.size());
    for (const optim::ParamSlot& p : buffer.params) {
      std::string shape;
      for (std::int64_t d : p.shape) shape += (shape.empty() ? "" : "x") + std::to_string(d);
      std::printf("  %-32s %-14s offset %-10lld bucket %d\n", p.name.c_str(), shape.c_str(),
                  static_cast<long long>(p.offset), p.bucket);
    }
  }
  for (std::size_t f = 0; f < m.files.size(); ++f) {
    std::printf("file           %s  %llu bytes  %s %s%s\n", m.files[f].name.c_str(),
                static_cast<unsigned long long>(m.files[f].bytes),
                optim::file_digest_key(m.digest_piece_bytes), m.files[f].digest.c_str(),
                verdicts.empty() ? "" : ("  " + verdicts[f]).c_str());
  }
}

// The optimizer checkpoint `path` denotes: one (or a root of them) as optim::resolve_checkpoint reads it, or the one
// inside a trainer's or RL loop's step directory (its optimizer/), or a root of those through its `latest`.
std::filesystem::path optimizer_checkpoint(const std::filesystem::path& path) {
  const std::filesystem::path inner = "optimizer";
  if (std::filesystem::is_directory(path / inner)) return optim::resolve_checkpoint(path / inner);
  const std::filesystem::path dir = optim::resolve_checkpoint(path);
  return std::filesystem::is_directory(dir / inner) ? optim::resolve_checkpoint(dir / inner) : dir;
}

void inspect(const InspectArgs& args) {
  const std::filesystem::path dir = optimizer_checkpoint(args.dir);
  const optim::CheckpointMetadata metadata = optim::read_checkpoint_metadata(dir);
  std::vector<std::string> verdicts;
  std::size_t bad = 0;
  if (args.verify) {
    for (const optim::CheckpointFile& file : metadata.files) {
      try {
        optim::verify_checkpoint_file(dir, metadata, file);
        verdicts.push_back("ok");
      } catch (const Failure& e) {
        verdicts.push_back(std::string("BAD: ") + e.what());
        ++bad;
      }
    }
  }
  if (args.json) {
    nlohmann::ordered_json out = nlohmann::ordered_json::parse(optim::metadata_to_json(metadata));
    out["directory"] = dir.string();
    out["metadata_digest_checked"] = metadata.digest_checked;
    if (args.verify) out["verified"] = verdicts;
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    print_text(dir, metadata, verdicts);
  }
  if (bad > 0) {
    throw Failure("checkpoint " + dir.string() + " failed verification: " + std::to_string(bad) + " of " +
                  std::to_string(metadata.files.size()) + " files are damaged");
  }
}

}  // namespace

void add_ckpt_command(CLI::App& parent) {
  CLI::App* ckpt = parent.add_subcommand("ckpt", "optimizer checkpoints");
  ckpt->require_subcommand(1);
  CLI::App* inspect_command = ckpt->add_subcommand("inspect", "print a checkpoint's metadata, including its step");
  auto args = std::make_shared<InspectArgs>();
  inspect_command
      ->add_option("dir", args->dir,
                   "a checkpoint directory, or a root whose `latest` names one (the optimizer's, or a trainer's or "
                   "RL loop's, whose optimizer/ is shown)")
      ->required();
  inspect_command->add_flag("--json", args->json, "the metadata as JSON");
  inspect_command->add_flag("--verify", args->verify, "recompute every file's SHA-256 and compare");
  inspect_command->callback([args] { inspect(*args); });
}

}  // namespace deltatrain::tools
