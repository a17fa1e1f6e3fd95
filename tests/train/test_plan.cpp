// Batch planning against an independent model of the data stream: every document in each epoch's order,
// token by token. Random document lengths (empty ones too), sequence lengths and rank counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "deltatrain/core/error.h"
#include "deltatrain/train/plan.h"
#include "train_testing.h"

namespace deltatrain::train {
namespace {

using Token = std::pair<std::int64_t, std::int64_t>;  // (document, offset)

// The first `count` tokens of the stream from the start, with the document order of each epoch.
std::vector<Token> stream(const std::vector<std::int64_t>& lengths, const PlanOptions& options, std::int64_t count) {
  std::vector<Token> out;
  for (std::int64_t epoch = 0; static_cast<std::int64_t>(out.size()) < count; ++epoch) {
    for (std::int64_t d : epoch_order(static_cast<std::int64_t>(lengths.size()), options.seed, epoch, options.shuffle)) {
      for (std::int64_t i = 0; i < lengths[d] && static_cast<std::int64_t>(out.size()) < count; ++i) out.push_back({d, i});
    }
  }
  return out;
}

std::vector<Token> tokens_of(const StepPlan& plan) {
  std::vector<Token> out;
  for (const auto& row : plan.rows) {
    for (const Piece& p : row) {
      for (std::int64_t i = 0; i < p.length; ++i) out.push_back({p.document, p.offset + i});
    }
  }
  return out;
}

struct Case {
  std::vector<std::int64_t> lengths;
  PlanOptions options;
};

Case random_case(std::mt19937_64& rng, int dp_size) {
  Case c;
  const int documents = std::uniform_int_distribution<int>(1, 12)(rng);
  for (int d = 0; d < documents; ++d) c.lengths.push_back(std::uniform_int_distribution<int>(0, 90)(rng));
  c.lengths[std::uniform_int_distribution<int>(0, documents - 1)(rng)] += 1;  // not every document empty
  c.options.seq_len = std::uniform_int_distribution<int>(2, 40)(rng);
  c.options.dp_size = dp_size;
  c.options.tokens_per_step = c.options.seq_len * 4 * std::uniform_int_distribution<int>(1, 3)(rng);
  c.options.shuffle = rng() % 2 == 0;
  c.options.seed = rng();
  return c;
}

TEST(Plan, StepsFollowTheStreamAndPackRowsWithinDocuments) {
  std::mt19937_64 rng(testing::test_seed());
  for (int trial = 0; trial < 200; ++trial) {
    const Case c = random_case(rng, 1);
    const int steps = 6;
    const std::vector<Token> expected = stream(c.lengths, c.options, steps * c.options.tokens_per_step);
    std::vector<Token> planned;
    DataPosition at;
    for (int s = 0; s < steps; ++s) {
      const StepPlan plan = plan_step(c.lengths, c.options, at);
      ASSERT_EQ(plan.rows.size(), static_cast<std::size_t>(c.options.tokens_per_step / c.options.seq_len));
      std::int64_t targets = 0;
      for (const auto& row : plan.rows) {
        std::int64_t used = 0;
        for (const Piece& p : row) {
          ASSERT_GT(p.length, 0);
          ASSERT_LE(p.offset + p.length, c.lengths[p.document]) << "a piece runs past its document";
          used += p.length;
          // A token has a target unless it is its document's last.
          for (std::int64_t i = p.offset; i < p.offset + p.length; ++i) targets += i + 1 < c.lengths[p.document];
        }
        ASSERT_EQ(used, c.options.seq_len);
      }
      EXPECT_EQ(plan.targets, targets);
      const std::vector<Token> step_tokens = tokens_of(plan);
      planned.insert(planned.end(), step_tokens.begin(), step_tokens.end());
      EXPECT_EQ(plan_step(c.lengths, c.options, at).end, plan.end) << "not deterministic";
      at = plan.end;
    }
    ASSERT_EQ(planned, expected) << "trial " << trial;
  }
}

TEST(Plan, ResumingFromAStoredPositionContinuesTheSameSteps) {
  std::mt19937_64 rng(testing::test_seed());
  for (int trial = 0; trial < 100; ++trial) {
    const Case c = random_case(rng, 1);
    std::vector<StepPlan> straight;
    DataPosition at;
    for (int s = 0; s < 8; ++s) {
      straight.push_back(plan_step(c.lengths, c.options, at));
      at = straight.back().end;
    }
    const int k = std::uniform_int_distribution<int>(1, 7)(rng);
    DataPosition stored = straight[k - 1].end;  // as a checkpoint at step k holds it
    for (int s = k; s < 8; ++s) {
      const StepPlan again = plan_step(c.lengths, c.options, stored);
      ASSERT_EQ(tokens_of(again), tokens_of(straight[s]));
      ASSERT_EQ(again.targets, straight[s].targets);
      stored = again.end;
    }
  }
}

TEST(Plan, OneTwoAndFourRanksCoverTheSameSequences) {
  std::mt19937_64 rng(testing::test_seed());
  for (int trial = 0; trial < 100; ++trial) {
    Case c = random_case(rng, 1);
    const StepPlan one = plan_step(c.lengths, c.options, {});
    for (int dp : {2, 4}) {
      c.options.dp_size = dp;
      const StepPlan many = plan_step(c.lengths, c.options, {});
      std::vector<std::vector<Piece>> gathered;
      std::set<std::int64_t> sizes;
      for (int r = 0; r < dp; ++r) {
        const auto rows = rank_rows(many, r, dp);
        sizes.insert(static_cast<std::int64_t>(rows.size()));
        gathered.insert(gathered.end(), rows.begin(), rows.end());
      }
      EXPECT_EQ(sizes.size(), 1u) << "ranks got unequal shares";
      ASSERT_EQ(gathered.size(), one.rows.size());
      for (std::size_t i = 0; i < gathered.size(); ++i) {
        ASSERT_EQ(gathered[i].size(), one.rows[i].size());
        for (std::size_t j = 0; j < gathered[i].size(); ++j) {
          EXPECT_EQ(gathered[i][j].document, one.rows[i][j].document);
          EXPECT_EQ(gathered[i][j].offset, one.rows[i][j].offset);
          EXPECT_EQ(gathered[i][j].length, one.rows[i][j].length);
        }
      }
      EXPECT_EQ(many.targets, one.targets);
      EXPECT_EQ(many.end, one.end);
    }
  }
}

TEST(Plan, EpochOrderIsASeededPermutation) {
  std::mt19937_64 rng(testing::test_seed());
  const std::uint64_t seed = rng();
  const std::vector<std::int64_t> a = epoch_order(50, seed, 0, true);
  std::vector<std::int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (std::int64_t i = 0; i < 50; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_EQ(epoch_order(50, seed, 0, true), a);
  EXPECT_NE(epoch_order(50, seed, 1, true), a);
  EXPECT_EQ(epoch_order(5, seed, 3, false), (std::vector<std::int64_t>{0, 1, 2, 3, 4}));
}

TEST(Plan, RefusesStepsThatCannotBeSplitNamingTheFlag) {
  const std::vector<std::int64_t> lengths{10, 20};
  auto flag_of = [&](PlanOptions o) {
    try {
      plan_step(lengths, o, {});
    } catch (const InvalidArgument& e) {
      return e.argument();
    }
    return std::string("accepted");
  };
  EXPECT_EQ(flag_of({.tokens_per_step = 100, .seq_len = 32, .dp_size = 1}), "tokens-per-step");
  EXPECT_EQ(flag_of({.tokens_per_step = 64, .seq_len = 32, .dp_size = 4}), "tokens-per-step");
  EXPECT_EQ(flag_of({.tokens_per_step = 64, .seq_len = 1, .dp_size = 1}), "seq-len");
  EXPECT_EQ(flag_of({.tokens_per_step = 128, .seq_len = 32, .dp_size = 4}), "accepted");
  const std::vector<std::int64_t> empty{0, 0};
  EXPECT_THROW(plan_step(empty, {.tokens_per_step = 8, .seq_len = 4}, {}), InvalidArgument);
}

}  // namespace
}  // namespace deltatrain::train
