// deltatrain: the command line. Each subcommand is a thin file over the library.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "commands.h"
#include "deltatrain/core/error.h"

namespace {

// Edits (insertions, deletions, substitutions, swaps of neighbours) that turn `a` into `b`.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The candidates closest to `typed`: those it begins (an abbreviation), else those within a third of their
// length in edits (one typo in a short name, two in a long one).
std::vector<std::string> closest(const std::string& typed, const std::vector<std::string>& candidates) {
  std::vector<std::string> prefixed;
  for (const std::string& c : candidates) {
    if (typed.size() >= 2 && c.size() > typed.size() && c.compare(0, typed.size(), typed) == 0) prefixed.push_back(c);
  }
  if (!prefixed.empty()) return prefixed;
  std::vector<std::string> best;
  std::size_t best_distance = 0;
  for (const std::string& c : candidates) {
    const std::size_t distance = edit_distance(typed, c);
    if (distance > std::max<std::size_t>(1, c.size() / 3)) continue;
    if (best.empty() || distance < best_distance) best.clear(), best_distance = distance;
    if (distance == best_distance) best.push_back(c);
  }
  return best;
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::string text;
  for (std::size_t i = 0; i < names.size(); ++i) {
    text += (i == 0 ? "'" : i + 1 == names.size() ? " or '" : ", '") + names[i] + "'";
  }
  return text;
}

// The parsed commands, the app first and the deepest subcommand (the one that ran) last.
std::vector<const CLI::App*> parsed_commands(const CLI::App& app) {
  std::vector<const CLI::App*> commands{&app};
  while (!commands.back()->get_subcommands().empty()) commands.push_back(commands.back()->get_subcommands().front());
  return commands;
}

// After a parse error: for each argument the deepest parsed command did not take, the subcommand or option
// it was probably meant to be. CLI11 says only that an argument was not expected.
void suggest_corrections(const CLI::App& app) {
  const std::vector<const CLI::App*> commands = parsed_commands(app);
  const CLI::App* command = commands.back();
  std::string path;
  for (const CLI::App* c : commands) path += (path.empty() ? "" : " ") + c->get_name();
  std::vector<std::string> subcommands, options;
  for (const CLI::App* sub : command->get_subcommands([](const CLI::App*) { return true; })) {
    subcommands.push_back(sub->get_name());
  }
  for (const CLI::Option* option : command->get_options()) {
    for (const std::string& name : option->get_lnames()) options.push_back("--" + name);
  }
  for (const std::string& argument : command->remaining()) {
    const bool is_option = argument.size() > 1 && argument[0] == '-';
    if (!is_option && subcommands.empty()) continue;  // a stray value: CLI11's message lists it
    const std::string typed = is_option ? argument.substr(0, argument.find('=')) : argument;
    const std::vector<std::string> matches = closest(typed, is_option ? options : subcommands);
    const char* kind = is_option ? "option" : "subcommand";
    if (!matches.empty()) {
      std::fprintf(stderr, "%s: unknown %s '%s'; did you mean %s?\n", path.c_str(), kind, typed.c_str(),
                   quoted_list(matches).c_str());
    } else if (!is_option) {
      std::fprintf(stderr, "%s: unknown subcommand '%s'; the subcommands are %s\n", path.c_str(), typed.c_str(),
                   quoted_list(subcommands).c_str());
    }
  }
}

// Fields of the library's options whose flag has another name: the first of these flags that the command has.
const std::map<std::string, std::vector<std::string>, std::less<>> kFlagsOfFields = {
    {"max_grad_norm", {"--clip"}},  // train's; rl's is --max-grad-norm, found by the field's own name
    {"cpu_threads", {"--threads"}},
    {"max_batch", {"--batch"}},
    {"dir", {"--init", "--weights"}},  // a model directory: rl's --init, generate's --weights
};

// A refusal from the library names the value by its option's name without dashes (`steps`, `save-every`,
// `config`), by a field (`max_batch`), or by a field of a part (`request 0: sampling.top_p`); where the command
// that ran has a flag for that field (`--top-p`), the message names it as the user typed it.
std::string naming_the_flag(const CLI::App& app, const deltatrain::InvalidArgument& error) {
  const std::string& argument = error.argument();
  if (argument.empty() || argument[0] == '-') return error.what();  // a command's own check, already a flag
  std::string_view field = argument;
  if (const std::size_t part = field.rfind(": "); part != std::string_view::npos) field.remove_prefix(part + 2);
  if (const std::size_t dot = field.rfind('.'); dot != std::string_view::npos) field.remove_prefix(dot + 1);
  std::string own_flag = "--" + std::string(field);
  std::replace(own_flag.begin(), own_flag.end(), '_', '-');
  std::vector<std::string> flags{own_flag};
  if (const auto aliases = kFlagsOfFields.find(field); aliases != kFlagsOfFields.end()) {
    flags.insert(flags.end(), aliases->second.begin(), aliases->second.end());
  }
  const CLI::App* command = parsed_commands(app).back();
  for (const std::string& flag : flags) {
    if (command->get_option_no_throw(flag) != nullptr) return deltatrain::InvalidArgument(flag, error.rule()).what();
  }
  return error.what();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"deltatrain: Gated DeltaNet training runtime for colocated RL", "deltatrain"};
  app.set_version_flag("--version", "deltatrain " DELTATRAIN_VERSION);
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
  deltatrain::tools::add_rl_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() != 0) suggest_corrections(app);
    return app.exit(e);
  } catch (const deltatrain::InvalidArgument& e) {
    std::fprintf(stderr, "deltatrain: %s\n", naming_the_flag(app, e).c_str());
    return 1;
  } catch (const deltatrain::Error& e) {
    std::fprintf(stderr, "deltatrain: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deltatrain: unexpected error: %s\n", e.what());
    return 1;
  }
  return 0;
}
