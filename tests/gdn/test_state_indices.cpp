// The recurrent step on a pool of states (state_indices) against the same call on the rows the indices name,
// gathered into a contiguous [N, HV, K, V] initial state, with its final states scattered back on the host: the
// same arithmetic per (sequence, head), so the outputs and the pool must agree bit for bit, and every row no index
// names must come back untouched. Fresh random data, indices in random orders: permutations, rows scattered
// through a larger pool, repeated rows when no final state is written; in place and into a separate pool.
#include <algorithm>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gdn_testing.h"

namespace deltatrain::gdn::testing {
namespace {

struct PoolCase {
  std::string backend;
  DType io;
  bool l2norm;
};

void PrintTo(const PoolCase& c, std::ostream* os) { *os << c.backend << "_" << dtype_name(c.io); }

class StateIndices : public SeededTest, public ::testing::WithParamInterface<PoolCase> {
 protected:
  // Two packed layouts: decode's one token a sequence, and several tokens with an empty sequence among them.
  std::vector<Layout> layouts() const {
    return {packed({1, 1, 1, 1, 1}, 2, 4, 16, 8), packed({3, 1, 0, 5, 2}, 1, 2, 8, 12)};
  }
  Sample sample(const Layout& layout) {
    const DType io = GetParam().io;
    return random_sample(layout, io, io == DType::f64 ? DType::f64 : DType::f32, GetParam().l2norm, false, rng_);
  }
  RunOptions run(bool final_state) const { return {GetParam().backend, true, final_state, 0}; }

  // `count` distinct rows of [0, rows) in a random order.
  std::vector<std::int32_t> distinct_rows(std::int64_t count, std::int64_t rows) {
    std::vector<std::int32_t> all(rows);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng_);
    all.resize(count);
    return all;
  }

  void expect_matches_gathered_call(const Sample& s, const StatePool& pool, bool final_state) {
    const ForwardResult ours = run_recurrent_on_pool(s, pool, run(final_state));
    const ForwardResult expected = run_forward(gathered(s, pool), run(final_state));
    EXPECT_EQ(ours.o.values(), expected.o.values());
    if (final_state) {
      EXPECT_EQ(ours.ht.values(), scattered(pool, s.layout, expected.ht.values()));
    }
  }
};

TEST_P(StateIndices, PermutationInPlace) {
  for (const Layout& layout : layouts()) {
    const Sample s = sample(layout);
    const std::int64_t N = layout.sequences();
    expect_matches_gathered_call(s, random_pool(s, N, distinct_rows(N, N), true, rng_), true);
  }
}

TEST_P(StateIndices, ScatteredRowsOfALargerPool) {
  for (const Layout& layout : layouts()) {
    const Sample s = sample(layout);
    const std::int64_t N = layout.sequences(), rows = 2 * N + 3;
    for (const bool in_place : {true, false}) {
      SCOPED_TRACE(in_place ? "in place" : "into a separate pool");
      expect_matches_gathered_call(s, random_pool(s, rows, distinct_rows(N, rows), in_place, rng_), true);
    }
  }
}

// Without final states nothing is written, so sequences may start from one row.
TEST_P(StateIndices, RepeatedRowsWithoutFinalState) {
  for (const Layout& layout : layouts()) {
    const Sample s = sample(layout);
    const std::int64_t N = layout.sequences(), rows = 2;
    std::uniform_int_distribution<std::int32_t> row(0, rows - 1);
    std::vector<std::int32_t> indices(N);
    for (std::int32_t& index : indices) index = row(rng_);
    indices[1] = indices[0];  // at least one row read twice
    expect_matches_gathered_call(s, random_pool(s, rows, indices, true, rng_), false);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, StateIndices,
                         ::testing::Values(PoolCase{"cpu", DType::f32, true}, PoolCase{"cpu", DType::bf16, false},
                                           PoolCase{"cpu", DType::f64, true}, PoolCase{"reference", DType::f32, true},
                                           PoolCase{"reference", DType::f16, false},
                                           PoolCase{"reference", DType::f64, false}),
                         [](const ::testing::TestParamInfo<PoolCase>& info) {
                           return info.param.backend + "_" + dtype_name(info.param.io);
                         });

}  // namespace
}  // namespace deltatrain::gdn::testing
