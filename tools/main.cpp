// deltatrain: the command line. Each subcommand is a thin file over the library.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "deltatrain/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"deltatrain: Gated DeltaNet training runtime for colocated RL"};
  app.require_subcommand(1);
  deltatrain::tools::add_info_command(app);
  CLI::App* bench = app.add_subcommand("bench", "measure a component on this machine");
  bench->require_subcommand(1);
  deltatrain::tools::add_bench_gdn_command(*bench);
  deltatrain::tools::add_bench_memsaver_command(*bench);
  deltatrain::tools::add_optim_command(app);
  deltatrain::tools::add_ckpt_command(app);
  deltatrain::tools::add_model_command(app);
  deltatrain::tools::add_train_command(app);
  deltatrain::tools::add_generate_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const deltatrain::Error& e) {
    std::fprintf(stderr, "deltatrain: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deltatrain: unexpected error: %s\n", e.what());
    return 1;
  }
  return 0;
}
