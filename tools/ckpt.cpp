// Placeholder until the ckpt component lands; replaced by its real command.
#include "commands.h"
#include "deltatrain/core/error.h"

namespace deltatrain::tools {

void add_ckpt_command(CLI::App& parent) {
  parent.add_subcommand("ckpt", "(not built yet)")->callback([] { throw Unavailable("ckpt", "not built yet"); });
}

}  // namespace deltatrain::tools
