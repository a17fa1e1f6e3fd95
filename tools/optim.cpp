// Placeholder until the optim component lands; replaced by its real command.
#include "commands.h"
#include "deltatrain/core/error.h"

namespace deltatrain::tools {

void add_optim_command(CLI::App& parent) {
  parent.add_subcommand("optim", "(not built yet)")->callback([] { throw Unavailable("optim", "not built yet"); });
}

}  // namespace deltatrain::tools
