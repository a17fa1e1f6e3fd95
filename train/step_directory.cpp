#include "deltatrain/train/step_directory.h"

#include <fstream>
#include <future>
#include <system_error>

#include "deltatrain/core/error.h"
#include "deltatrain/optim/checkpoint.h"
#include "optim/file_io.h"

namespace deltatrain::train {

namespace fs = std::filesystem;

namespace {
constexpr const char* kLatest = "latest";
}  // namespace

fs::path save_step_directory(comm::Group& group, const fs::path& root, std::int64_t step,
                             const std::string& state_file, const std::function<void(const fs::path&)>& write_all_ranks,
                             const std::function<void(const fs::path&)>& write_leader) {
  const std::string name = optim::checkpoint_dir_name(step);
  const fs::path final_dir = root / name;
  const fs::path temp_dir = root / (".tmp-" + name);
  const bool leader = group.rank() == 0;
  bool replacing = false;  // rank 0: final_dir is a killed save's, which `latest` never named
  try {
    comm::collectively(group, [&] {
      if (!leader) return;
      replacing = optim::save_replaces_leftover(root, step);
      fs::create_directories(root);
      fs::remove_all(temp_dir);  // left by a save that was killed
      fs::create_directory(temp_dir);
    });
    // Rank 0's own files are written on a thread of their own while every rank writes its shards: the disk takes
    // both streams, and neither file waits for the other's last chunks to be fetched, hashed and synced. The
    // future waits for the thread on every path out of this block.
    std::future<void> leader_files;
    if (leader) leader_files = std::async(std::launch::async, [&] { write_leader(temp_dir); });
    write_all_ranks(temp_dir);
    comm::collectively(group, [&] {
      if (!leader) return;
      leader_files.get();
      optim::sync_directory(temp_dir);
      if (replacing) {
        // One atomic exchange: at any kill the step's name holds a complete directory; the leftover, now
        // under the temporary name, is removed here or by the next save.
        optim::exchange_paths(temp_dir, final_dir);
        optim::sync_directory(root);
        fs::remove_all(temp_dir);
      } else {
        optim::rename_no_replace(temp_dir, final_dir);
        optim::sync_directory(root);
      }
      optim::replace_file_atomically(root / kLatest, name + "\n");
    });
  } catch (const Error& e) {
    if (leader) {
      std::error_code ignored;
      fs::remove_all(temp_dir, ignored);  // frees what the failed save took; the previous checkpoints stay
    }
    std::string latest = "none";
    try {
      latest = resolve_step_directory(root, state_file).string();
    } catch (const Error&) {
      // No earlier checkpoint under this root: "none" says so.
    }
    throw Failure("the checkpoint of step " + std::to_string(step) + " was not saved (" + e.what() +
                  "); the latest complete checkpoint is " + latest);
  }
  return final_dir;
}

void check_checkpoint_root(const fs::path& root, bool resuming) {
  if (root.empty()) return;
  std::error_code error;
  fs::create_directories(root, error);
  if (error || !fs::is_directory(root)) {
    throw InvalidArgument("ckpt", "cannot create the checkpoint directory " + root.string() +
                                      (error ? ": " + error.message() : ": it is not a directory"));
  }
  // A save writes temporary files and directories here: a probe file finds a read-only root now, not after training.
  const fs::path probe = root / ".write-probe";
  if (!std::ofstream(probe)) {
    throw InvalidArgument("ckpt", "cannot write in the checkpoint directory " + root.string());
  }
  fs::remove(probe, error);
  if (!resuming && fs::exists(root / kLatest)) {
    throw InvalidArgument("ckpt", root.string() + " already holds another run's checkpoints (and `latest`), " +
                                      "which a fresh run would overwrite; pass --resume latest to continue that " +
                                      "run, or another --ckpt root");
  }
}

fs::path resolve_step_directory(const fs::path& path, const std::string& state_file) {
  if (fs::exists(path / state_file)) return path;
  if (fs::exists(path / kLatest)) {
    std::string name = optim::read_text_file(path / kLatest);
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    const fs::path dir = path / name;
    if (!fs::exists(dir / state_file)) {
      throw Failure("checkpoint root " + path.string() + ": `latest` names " + dir.string() + ", which has no " + state_file);
    }
    return dir;
  }
  throw Failure("no checkpoint at " + path.string() + ": it holds neither " + state_file + " nor " + kLatest);
}

void check_resume_step(const fs::path& dir, std::int64_t saved_step, std::int64_t last_step, const std::string& steps) {
  if (saved_step > last_step) {
    throw InvalidArgument("steps", steps + ", and checkpoint " + dir.string() + " is at step " +
                                       std::to_string(saved_step) + ", past " + std::to_string(last_step));
  }
}

bool final_save_needed(comm::Group& group, const std::filesystem::path& root, std::int64_t step) {
  const bool saved = group.rank() == 0 && std::filesystem::exists(root / optim::checkpoint_dir_name(step));
  return !root.empty() && !comm::any_rank(group, saved);
}

}  // namespace deltatrain::train
