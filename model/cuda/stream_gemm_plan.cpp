#include "stream_gemm_plan.h"

namespace deltatrain::model::cuda {

std::optional<StreamGemmPlan> plan_stream_gemm(const StreamGemmProblem& p, int multiprocessors) {
  const std::int64_t one_wave = std::int64_t{kStreamCtasPerSm} * multiprocessors;
  const std::int64_t feature_tiles = (p.N + kStreamFeatures - 1) / kStreamFeatures;
  const bool applies = p.allowed && p.device_ready && !p.row_invariant && !p.trans_a && p.trans_b &&
                       p.M >= 1 && p.M <= kStreamMaxRows && p.N >= 1 && feature_tiles * kStreamMaxSplits <= one_wave &&
                       p.K >= kStreamChunk && p.K % kStreamChunk == 0 && p.align_a % 16 == 0 &&
                       p.align_b % 16 == 0 && p.lda % 8 == 0 && p.ldb % 8 == 0;
  if (!applies) return std::nullopt;
  // Split K in powers of two up to a cluster while the CTAs still run in one wave (a second, partial wave would
  // cost more than the split gains), each split keeping at least two chunks (a split's fixed cost, its partial
  // sums through distributed shared memory, is about a chunk's).
  StreamGemmPlan plan{feature_tiles, 1};
  const std::int64_t chunks = p.K / kStreamChunk;
  while (plan.splits < kStreamMaxSplits && feature_tiles * plan.splits * 2 <= one_wave && chunks >= 4 * plan.splits)
    plan.splits *= 2;
  return plan;
}

}  // namespace deltatrain::model::cuda
