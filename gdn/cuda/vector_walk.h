// Which 16-byte vector of a row-major tile each thread of a block copies, for mma.cuh's for_each_vector (every tile
// copy between global and shared memory goes through it): pure index arithmetic, built without nvcc too, so that host
// tests check that every vector is copied once and that a quarter warp's accesses fall in distinct banks
// (tests/gdn/test_vector_walk.cpp).
#pragma once

#include "host_device.h"

namespace deltatrain::gdn::cuda {

struct VectorAt {
  int row, vector;  // the vector's row, and its place in the row (vectors, not elements)
};

// A tile of ROWS rows of VECTORS vectors, consecutive rows ROW_GROUPS 16-byte groups apart (VECTORS, or one more
// where padded), copied by threads 0..NTHREADS-1 in kSteps steps each. Row-major (vector i = thread + j x NTHREADS),
// with the row stepping by a constant when NTHREADS is a multiple of VECTORS, so that copy loops cost a few
// instructions a vector. A tile narrower than eight vectors whose rows lie an odd number of groups apart is walked
// eight rows at a time instead, each eight consecutive threads on one column of vectors: a quarter warp's eight
// 16-byte accesses then fall in distinct banks, where row-major they took two vectors of each of four rows of the
// token rows' staging (16 columns, rows 48 bytes apart), a two-way conflict. A warp still covers the same whole rows,
// so its global accesses are the same sectors.
template <int NTHREADS, int ROWS, int VECTORS, int ROW_GROUPS>
struct VectorWalk {
  static constexpr int kTotal = ROWS * VECTORS;
  static constexpr int kSteps = (kTotal + NTHREADS - 1) / NTHREADS;
  static constexpr bool kRowStep = NTHREADS % VECTORS == 0;
  static constexpr int kEightRows = 8 * VECTORS;  // threads over eight rows of a narrow tile
  static constexpr bool kNarrow =
      VECTORS < 8 && ROW_GROUPS % 2 == 1 && NTHREADS % kEightRows == 0 && kTotal % NTHREADS == 0;

  // Whether step j of `thread` copies a vector: all do but the last step's surplus threads.
  static DELTATRAIN_HOST_DEVICE constexpr bool active(int thread, int j) {
    return kTotal % NTHREADS == 0 || thread + j * NTHREADS < kTotal;
  }
  static DELTATRAIN_HOST_DEVICE constexpr VectorAt at(int thread, int j) {
    if constexpr (kNarrow) {
      const int q = thread % kEightRows;
      return {thread / kEightRows * 8 + q % 8 + j * (NTHREADS / VECTORS), q / 8};
    } else {
      const int i = thread + j * NTHREADS;
      return {kRowStep ? thread / VECTORS + j * (NTHREADS / VECTORS) : i / VECTORS, (kRowStep ? thread : i) % VECTORS};
    }
  }
};

}  // namespace deltatrain::gdn::cuda
