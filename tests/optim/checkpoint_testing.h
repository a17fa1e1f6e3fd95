// Helpers of the checkpoint tests: children that initialise MPI themselves (a singleton), so the tests
// run without mpirun, and the digest of what a checkpoint loads.
#pragma once

#include <mpi.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>

#include "deltatrain/comm/mpi_group.h"
#include "deltatrain/core/error.h"
#include "deltatrain/optim/checkpoint.h"
#include "deltatrain/optim/digest.h"
#include "deltatrain/optim/synthetic.h"

namespace deltatrain::optim {

struct ChildResult {
  bool exited = false;
  int exit_code = -1;
  int signal = 0;
  std::string message;  // what the child wrote before it ended
};

// Runs `body` in a forked child with MPI initialised there; an exception becomes exit code 1 and its text.
inline ChildResult run_child(const std::function<std::string()>& body) {
  int channel[2];
  if (pipe(channel) != 0) throw Failure("pipe failed");
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(120);  // a child that hangs (reading a FIFO, say) ends by SIGALRM instead of hanging the suite
    close(channel[0]);
    int code = 0;
    std::string message;
    try {
      MPI_Init(nullptr, nullptr);
      message = body();
      MPI_Finalize();
    } catch (const std::exception& e) {
      message = e.what();
      code = 1;
    }
    if (!message.empty() && write(channel[1], message.data(), message.size()) < 0) code = 2;
    _exit(code);
  }
  close(channel[1]);
  ChildResult result;
  char buffer[4096];
  for (ssize_t got; (got = read(channel[0], buffer, sizeof buffer)) > 0;) result.message.append(buffer, got);
  close(channel[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  result.exited = WIFEXITED(status);
  result.exit_code = result.exited ? WEXITSTATUS(status) : -1;
  result.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  return result;
}

// "<step> <params sha> <state sha>" of an optimizer that loaded `path`.
inline std::string loaded_digest(const std::filesystem::path& path) {
  const std::unique_ptr<comm::Group> group = comm::make_mpi_group(MPI_COMM_WORLD);
  const SyntheticRegression problem;
  DistributedAdamW optimizer(*group, problem.params(), AdamWConfig{}, DemoOptions{}.layout);
  load_checkpoint(optimizer, path);
  const StateDigest digest = digest_state(optimizer);
  return std::to_string(optimizer.step_count()) + " " + digest.params + " " + digest.state;
}

// A fresh directory name under the system's temporary directory, unique per call (the tests run in parallel).
inline std::filesystem::path fresh_temp_root(const std::string& prefix) {
  const std::uint64_t nonce = (static_cast<std::uint64_t>(std::random_device{}()) << 32) | std::random_device{}();
  return std::filesystem::temp_directory_path() / (prefix + std::to_string(nonce));
}

// A checkpoint of the synthetic demo trained two steps on one rank, saved under `root` by a child; the
// child's message is the loaded_digest of what it saved.
inline ChildResult save_step_2_checkpoint(const std::filesystem::path& root) {
  return run_child([&] {
    DemoOptions options;
    options.steps = 2;
    options.save_at = 2;
    options.checkpoint_root = root;
    const std::unique_ptr<comm::Group> group = comm::make_mpi_group(MPI_COMM_WORLD);
    run_demo(*group, options);
    return loaded_digest(root);
  });
}

}  // namespace deltatrain::optim
