// Checkpoints as one directory per step under a root, written whole or not at all: the trainer's and the RL
// loop's. A save writes .tmp-step-00000010, fsyncs it, renames it to step-00000010 and then replaces
// `latest`, so a process killed or a disk that fills at any point leaves the previous checkpoint and `latest`
// intact. Nothing that `latest` names (or a later step) is overwritten; a step directory beyond `latest` (a save
// killed after its rename, before `latest` moved) is replaced when that step is saved again
// (optim::save_replaces_leftover), so a resumed run does not stop there.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include "deltatrain/comm/group.h"

namespace deltatrain::train {

// Collective. `write_all_ranks(dir)` runs on every rank (the optimizer's sharded save) and, at the same time on
// a thread of rank 0, `write_leader(dir)` (the model, the state file: it must not communicate), into the
// temporary directory; then rank 0 renames it into place and moves `latest`. Returns the step directory. A failure on any rank raises Failure
// on every rank, saying why and naming the checkpoint that stays the latest (`state_file` marks a step
// directory, e.g. "trainer.json"); the temporary directory is removed.
std::filesystem::path save_step_directory(comm::Group& group, const std::filesystem::path& root, std::int64_t step,
                                          const std::string& state_file,
                                          const std::function<void(const std::filesystem::path&)>& write_all_ranks,
                                          const std::function<void(const std::filesystem::path&)>& write_leader);

// Where a run will save, checked before it trains (InvalidArgument naming `ckpt`, the flag): `root` must be a
// directory that can be created and written, and a run that does not resume must not start in a root whose
// `latest` names another run's checkpoint (it would save beside, and before, that run's steps). Empty: no saves,
// nothing to check. Rank 0's view is the one that matters (it writes the step directories).
void check_checkpoint_root(const std::filesystem::path& root, bool resuming);

// A resume goes forward only: InvalidArgument naming `steps` (the flag) when the checkpoint `dir`, at optimizer step
// `saved_step`, is past `last_step`, the step this run trains to, rather than a run that takes no step and reports
// the checkpoint's step as done. `steps` says how --steps gives `last_step` ("is the step to train to").
void check_resume_step(const std::filesystem::path& dir, std::int64_t saved_step, std::int64_t last_step,
                       const std::string& steps);

// Collective. Whether a run that ends at `step` still has to save: a root is given and the step is not already
// saved there. Rank 0's view decides (it writes the checkpoints), so every rank enters the save or none does.
bool final_save_needed(comm::Group& group, const std::filesystem::path& root, std::int64_t step);

// The step directory `path` denotes: itself when it holds `state_file`, else what its `latest` names.
// Failure naming the path otherwise.
std::filesystem::path resolve_step_directory(const std::filesystem::path& path, const std::string& state_file);

}  // namespace deltatrain::train
