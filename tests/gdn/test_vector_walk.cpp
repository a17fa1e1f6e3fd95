// The order in which a block's threads copy a tile's 16-byte vectors (gdn/cuda/vector_walk.h, behind every tile copy
// of the CUDA kernels): every vector once, each warp on whole rows, and, where the walk goes eight rows a column at a
// time, each quarter warp's accesses in distinct banks.
#include <gtest/gtest.h>

#include <set>
#include <utility>
#include <vector>

#include "cuda/vector_walk.h"

namespace {

using deltatrain::gdn::cuda::VectorAt;
using deltatrain::gdn::cuda::VectorWalk;

// The vectors each thread copies, step by step (inactive steps left out).
template <class Walk>
std::vector<std::vector<VectorAt>> walk_steps(int threads) {
  std::vector<std::vector<VectorAt>> steps(Walk::kSteps);
  for (int j = 0; j < Walk::kSteps; ++j) {
    for (int t = 0; t < threads; ++t) {
      if (Walk::active(t, j)) steps[j].push_back(Walk::at(t, j));
    }
  }
  return steps;
}

// Whether every quarter warp (eight consecutive threads, the unit a 16-byte shared access is served in) of every step
// touches eight distinct groups of four banks.
template <class Walk, int kRowGroups>
bool quarter_warps_conflict_free(int threads) {
  for (int j = 0; j < Walk::kSteps; ++j) {
    for (int first = 0; first < threads; first += 8) {
      std::set<int> groups;
      int accesses = 0;
      for (int t = first; t < first + 8 && t < threads; ++t) {
        if (!Walk::active(t, j)) continue;
        const VectorAt at = Walk::at(t, j);
        groups.insert((at.row * kRowGroups + at.vector) % 8);
        ++accesses;
      }
      if (static_cast<int>(groups.size()) != accesses) return false;
    }
  }
  return true;
}

template <int kThreads, int kRows, int kVectors, int kRowGroups>
void check_walk() {
  using Walk = VectorWalk<kThreads, kRows, kVectors, kRowGroups>;
  SCOPED_TRACE(testing::Message() << kThreads << " threads, " << kRows << " rows of " << kVectors << " vectors, "
                                  << kRowGroups << " groups apart");
  const auto steps = walk_steps<Walk>(kThreads);
  std::set<std::pair<int, int>> seen;
  for (const auto& step : steps) {
    for (const VectorAt& at : step) {
      ASSERT_GE(at.row, 0);
      ASSERT_LT(at.row, kRows);
      ASSERT_GE(at.vector, 0);
      ASSERT_LT(at.vector, kVectors);
      ASSERT_TRUE(seen.insert({at.row, at.vector}).second) << "row " << at.row << ", vector " << at.vector << " twice";
    }
  }
  EXPECT_EQ(static_cast<int>(seen.size()), kRows * kVectors) << "every vector copied";
  // A warp of a step covers whole rows (all of each row's vectors it touches), so its global accesses are whole
  // sectors of those rows whatever the order within it.
  if (kThreads % 32 == 0 && 32 % kVectors == 0 && (kRows * kVectors) % kThreads == 0) {
    for (int j = 0; j < Walk::kSteps; ++j) {
      for (int warp = 0; warp < kThreads / 32; ++warp) {
        std::set<std::pair<int, int>> mine;
        std::set<int> rows;
        for (int t = 32 * warp; t < 32 * warp + 32; ++t) {
          const VectorAt at = Walk::at(t, j);
          mine.insert({at.row, at.vector});
          rows.insert(at.row);
        }
        EXPECT_EQ(mine.size(), rows.size() * kVectors) << "step " << j << ", warp " << warp << " splits a row";
      }
    }
  }
  if (Walk::kNarrow) {
    EXPECT_TRUE((quarter_warps_conflict_free<Walk, kRowGroups>(kThreads)));
  }
}

TEST(VectorWalk, CopiesEveryVectorOnceWithWholeRowsPerWarp) {
  // The kernels' tiles: 64-column 16-bit tiles (8 vectors, padded to 9 groups), 128-column ones, float tiles, the
  // swizzled ones (unpadded), the token rows' staging (16 columns, 2 vectors, 3 groups), the state rows' staging.
  check_walk<256, 64, 8, 9>();
  check_walk<256, 64, 16, 17>();
  check_walk<128, 64, 16, 17>();
  check_walk<256, 64, 8, 8>();
  check_walk<256, 64, 16, 16>();
  check_walk<32, 64, 2, 3>();
  check_walk<32, 32, 2, 3>();
  check_walk<32, 16, 16, 17>();
  check_walk<128, 64, 4, 5>();
  check_walk<256, 64, 32, 33>();
  // Shapes the walk must also cover: fewer vectors than threads in the last step, rows that do not divide the threads.
  check_walk<256, 60, 8, 9>();
  check_walk<96, 50, 4, 5>();
  check_walk<32, 7, 3, 4>();
  check_walk<64, 64, 1, 2>();
}

TEST(VectorWalk, NarrowPaddedTilesGoEightRowsAColumnWithoutBankConflicts) {
  using Staging = VectorWalk<32, 64, 2, 3>;  // the token rows' staging: 64 x 16 16-bit, rows 48 bytes apart
  static_assert(Staging::kNarrow);
  EXPECT_TRUE((quarter_warps_conflict_free<Staging, 3>(32)));
  EXPECT_TRUE((quarter_warps_conflict_free<VectorWalk<128, 64, 4, 5>, 5>(128)));  // 16 float columns, padded
  // The same staging walked row-major (what a thread count that is not a multiple of 16 still does): two vectors of
  // each of four rows a quarter warp, which the check sees as the two-way conflict the narrow walk removes.
  using RowMajor = VectorWalk<24, 64, 2, 3>;
  static_assert(!RowMajor::kNarrow);
  EXPECT_FALSE((quarter_warps_conflict_free<RowMajor, 3>(24)));
  // Unpadded narrow rows (two groups apart) stay row-major, where a quarter warp's four rows are contiguous.
  static_assert(!VectorWalk<32, 64, 2, 2>::kNarrow);
  EXPECT_TRUE((quarter_warps_conflict_free<VectorWalk<32, 64, 2, 2>, 2>(32)));
}

}  // namespace
