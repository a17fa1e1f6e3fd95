// `deltatrain optim demo`: the distributed optimizer on the built-in synthetic problem, on however
// many ranks mpirun starts (one rank without mpirun). Prints the step, the loss and the SHA-256 of
// the gathered float32 main parameters and of the gathered optimizer state.
#include <mpi.h>

#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "deltatrain/comm/mpi_group.h"
#include "deltatrain/core/error.h"
#include "deltatrain/optim/synthetic.h"

namespace deltatrain::tools {
namespace {

struct DemoArgs {
  std::int64_t steps = 0;
  std::int64_t save_at = -1;
  std::string ckpt;
  std::string resume;
  std::string dtype = "f32";
  bool json = false;
};

// MPI for the lifetime of the command; only this subcommand starts it.
struct MpiSession {
  MpiSession() { MPI_Init(nullptr, nullptr); }
  ~MpiSession() { MPI_Finalize(); }
};

void print(const optim::DemoResult& result, int ranks, bool json) {
  if (json) {
    nlohmann::ordered_json out = {{"ranks", ranks},
                                  {"step", result.step},
                                  {"loss", result.loss},
                                  {"params_sha256", result.digest.params},
                                  {"state_sha256", result.digest.state}};
    if (!result.saved.empty()) out["saved"] = result.saved.string();
    std::printf("%s\n", out.dump().c_str());
    return;
  }
  std::printf("ranks          %d\nstep           %lld\nloss           %.17g\nparams_sha256  %s\nstate_sha256   %s\n",
              ranks, static_cast<long long>(result.step), result.loss, result.digest.params.c_str(),
              result.digest.state.c_str());
  if (!result.saved.empty()) std::printf("saved          %s\n", result.saved.string().c_str());
}

void run_demo_command(const DemoArgs& args) {
  optim::DemoOptions options;
  options.steps = args.steps;
  options.save_at = args.save_at;
  options.checkpoint_root = args.ckpt;
  options.resume_from = args.resume;
  options.problem.dtype = args.dtype == "bf16" ? DType::bf16 : DType::f32;

  MpiSession mpi;
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  try {
    const std::unique_ptr<comm::Group> group = comm::make_mpi_group(MPI_COMM_WORLD);
    const optim::DemoResult result = optim::run_demo(*group, options);
    if (rank == 0) print(result, ranks, args.json);
  } catch (const Error&) {
    // The library raises the same error on every rank: rank 0 reports it, the others just fail.
    if (rank == 0) throw;
    throw CLI::RuntimeError(1);
  }
}

}  // namespace

void add_optim_command(CLI::App& parent) {
  CLI::App* optim = parent.add_subcommand("optim", "the distributed optimizer (ZeRO-1 AdamW)");
  optim->require_subcommand(1);
  CLI::App* demo = optim->add_subcommand(
      "demo", "train the built-in synthetic MLP regression on every rank that mpirun starts (or one rank)");
  auto args = std::make_shared<DemoArgs>();
  demo->add_option("--steps", args->steps, "optimizer steps to run (0: only report, e.g. right after --resume)")
      ->required()
      ->check(CLI::NonNegativeNumber);
  CLI::Option* ckpt = demo->add_option("--ckpt", args->ckpt, "checkpoint root directory to save into");
  demo->add_option("--save-at", args->save_at, "save a checkpoint when the optimizer's step reaches this")
      ->check(CLI::NonNegativeNumber)
      ->needs(ckpt);
  demo->add_option("--resume", args->resume, "load this checkpoint (a step directory, or a root with `latest`) first");
  demo->add_option("--dtype", args->dtype, "model parameter dtype")->check(CLI::IsMember({"f32", "bf16"}));
  demo->add_flag("--json", args->json, "one JSON object instead of text");
  demo->callback([args] { run_demo_command(*args); });
}

}  // namespace deltatrain::tools
