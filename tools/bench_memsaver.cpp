// Placeholder until the memsaver component lands; replaced by its real command.
#include "commands.h"
#include "deltatrain/core/error.h"

namespace deltatrain::tools {

void add_bench_memsaver_command(CLI::App& parent) {
  parent.add_subcommand("memsaver", "(not built yet)")->callback([] { throw Unavailable("memsaver", "not built yet"); });
}

}  // namespace deltatrain::tools
