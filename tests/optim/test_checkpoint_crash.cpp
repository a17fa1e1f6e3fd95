// Crash safety: a child process saving a checkpoint is SIGKILLed at each stage of the save; the
// previous checkpoint must still load exactly (state and step), `latest` must still name it, and a
// later save of the same step must succeed (once the killed save's directory is in place, by replacing
// it, since `latest` never named it).
// Each child is a fresh process that initialises MPI itself (a singleton), so the test runs without mpirun.
#include <gtest/gtest.h>
#include <mpi.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <functional>

#include "checkpoint_testing.h"
#include "deltatrain/comm/mpi_group.h"
#include "deltatrain/core/error.h"
#include "deltatrain/optim/checkpoint.h"
#include "deltatrain/optim/synthetic.h"

namespace deltatrain::optim {
namespace {

namespace fs = std::filesystem;

// Loads `root`, trains two steps and saves; `on_stage` sees every stage of that save.
void resume_train_and_save(const fs::path& root, const std::function<void(SaveStage)>& on_stage) {
  const std::unique_ptr<comm::Group> group = comm::make_mpi_group(MPI_COMM_WORLD);
  const SyntheticRegression problem;
  DistributedAdamW optimizer(*group, problem.params(), AdamWConfig{}, DemoOptions{}.layout);
  load_checkpoint(optimizer, root);
  for (int i = 0; i < 2; ++i) {
    optimizer.zero_grad();
    problem.forward_backward(optimizer);
    optimizer.step();
  }
  save_checkpoint(optimizer, root, {on_stage});
}

constexpr const char* kStageNames[] = {"shard_partly_written", "shards_written", "metadata_written", "renamed",
                                       "latest_updated"};

std::string stage_name(const ::testing::TestParamInfo<SaveStage>& info) { return kStageNames[static_cast<int>(info.param)]; }

}  // namespace

// gtest prints parameters with this (found by argument-dependent lookup).
void PrintTo(SaveStage stage, std::ostream* out) { *out << kStageNames[static_cast<int>(stage)]; }

namespace {

class KilledSave : public ::testing::TestWithParam<SaveStage> {
 protected:
  void SetUp() override {
    root_ = fresh_temp_root("deltatrain-crash-");
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path root_;
};

TEST_P(KilledSave, LeavesThePreviousCheckpointLoadableAndLatestPointingToIt) {
  const SaveStage stage = GetParam();
  const ChildResult first = save_step_2_checkpoint(root_);
  ASSERT_EQ(first.exit_code, 0) << first.message;

  const ChildResult killed = run_child([&] {
    resume_train_and_save(root_, [stage](SaveStage reached) {
      if (reached == stage) raise(SIGKILL);
    });
    return std::string("the save was not killed");
  });
  ASSERT_EQ(killed.signal, SIGKILL) << "exit " << killed.exit_code << ": " << killed.message;

  std::ifstream latest(root_ / "latest");
  std::string named;
  latest >> named;
  EXPECT_EQ(named, checkpoint_dir_name(2)) << "`latest` still names the previous checkpoint";

  const ChildResult after = run_child([&] { return loaded_digest(root_); });
  ASSERT_EQ(after.exit_code, 0) << after.message;
  EXPECT_EQ(after.message, first.message) << "the previous checkpoint loads with its exact state and step";

  const fs::path second = root_ / checkpoint_dir_name(4);
  if (stage == SaveStage::renamed) {
    // The new directory was complete before `latest` moved: it loads too.
    const ChildResult direct = run_child([&] { return loaded_digest(second); });
    ASSERT_EQ(direct.exit_code, 0) << direct.message;
    EXPECT_EQ(direct.message.substr(0, 2), "4 ");
  } else {
    EXPECT_FALSE(fs::exists(second)) << "a killed save leaves no checkpoint directory";
  }
  // Rerunning the training to the same step saves over the killed save's leftovers, whatever they are.
  const ChildResult again = run_child([&] {
    resume_train_and_save(root_, {});
    return loaded_digest(root_);
  });
  ASSERT_EQ(again.exit_code, 0) << again.message;
  EXPECT_EQ(again.message.substr(0, 2), "4 ") << "a new save over the killed one's leftovers succeeds";
  EXPECT_FALSE(fs::exists(root_ / (".tmp-" + checkpoint_dir_name(4)))) << "the replaced directory is removed";
  // A checkpoint that `latest` names is never overwritten.
  const ChildResult once_more = run_child([&] {
    const std::unique_ptr<comm::Group> group = comm::make_mpi_group(MPI_COMM_WORLD);
    const SyntheticRegression problem;
    DistributedAdamW optimizer(*group, problem.params(), AdamWConfig{}, DemoOptions{}.layout);
    load_checkpoint(optimizer, root_);
    save_checkpoint(optimizer, root_);
    return std::string();
  });
  EXPECT_EQ(once_more.exit_code, 1);
  EXPECT_NE(once_more.message.find("already exists"), std::string::npos) << once_more.message;
}

INSTANTIATE_TEST_SUITE_P(Stages, KilledSave,
                         ::testing::Values(SaveStage::shard_partly_written, SaveStage::shards_written,
                                           SaveStage::metadata_written, SaveStage::renamed),
                         stage_name);

}  // namespace
}  // namespace deltatrain::optim
