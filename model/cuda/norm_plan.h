// How the norm kernels (norms.cu) lay a row over a warp: the one decision, made here from the row's width, so that
// the launchers only dispatch on it. Plain C++ (no CUDA types), so it is tested on machines without a GPU.
//
// A row is shared by 16 lanes up to 128 columns (the GDN heads' gated norm: a whole warp would leave half its lanes
// idle), else by 32; each lane takes 8 consecutive columns a step. The forward and the backward hold a row of up to
// 4 steps in registers (one round trip to memory) in as many steps as it needs: a kernel compiled for 4 steps holds
// 3 x 4 x 8 floats a thread whether or not a row uses them, 128 registers, 2 blocks an SM, which left the gated
// norm's rows of 128 columns at 1.2 TB/s in training (bench/NOTES.md, Model). Wider rows take the column loops.
#pragma once

#include <cstdint>

namespace deltatrain::model::cuda {

inline constexpr int kNormVector = 8;     // consecutive columns a lane takes per step
inline constexpr int kNormMaxHeldSteps = 4;

struct NormRowPlan {
  int lanes;       // 16 or 32
  int held_steps;  // 1, 2 or 4: the fewest steps that hold the row; 0: too wide to hold, the column loops
  friend bool operator==(const NormRowPlan&, const NormRowPlan&) = default;
};

NormRowPlan plan_norm_row(std::int64_t cols);

}  // namespace deltatrain::model::cuda
