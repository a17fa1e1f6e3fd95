// The cycle benchmark on host pages: the pattern survives a cpu copy and a registered backup, a cycle with
// no backup brings fresh (zeroed) pages, and the resident size follows pause and resume.
#include <gtest/gtest.h>

#include "deltatrain/memsaver/cycle_bench.h"
#include "memsaver_testing.h"

namespace deltatrain::memsaver {
namespace {

CycleBenchReport run(Backup backup, std::size_t bytes) {
  CycleBenchOptions options;
  options.backend = "host";
  options.bytes = bytes;
  options.backup = backup;
  options.cycles = 2;
  options.chunk_bytes = 1 << 20;
  return run_cycle_bench(options);
}

TEST(CycleBench, BackedUpContentsComeBackAndPauseReleasesEveryPage) {
  testing::Random random;
  const std::size_t bytes = random.between(4 << 20, 12 << 20);
  for (Backup backup : {Backup::CpuCopy, Backup::RestoreFrom}) {
    const CycleBenchReport report = run(backup, bytes);
    EXPECT_TRUE(report.contents_restored) << to_string(backup);
    EXPECT_EQ(report.resident_paused, 0u) << to_string(backup);
    EXPECT_GE(report.resident_before, bytes);
    EXPECT_EQ(report.resident_resumed, report.resident_before);
    EXPECT_EQ(report.host_bytes_held, backup == Backup::CpuCopy ? bytes : 0u);
    EXPECT_GT(report.d2h_s, 0);
    EXPECT_GT(report.pause_s, 0);
  }
}

TEST(CycleBench, WithoutBackupThePatternIsGone) {
  const CycleBenchReport report = run(Backup::None, 2 << 20);
  EXPECT_FALSE(report.contents_restored);
  EXPECT_EQ(report.resident_paused, 0u);
  EXPECT_EQ(report.host_bytes_held, 0u);
}

TEST(CycleBench, RejectsEmptyRuns) {
  CycleBenchOptions options;
  options.bytes = 0;
  EXPECT_THROW(run_cycle_bench(options), InvalidArgument);
  options.bytes = 4096;
  options.cycles = 0;
  EXPECT_THROW(run_cycle_bench(options), InvalidArgument);
}

}  // namespace
}  // namespace deltatrain::memsaver
