// The cuda backend's execution plan (gdn/cuda/plan.h), on the CPU: the rules it promises, checked over random
// call shapes and device sizes, and the choices it makes on the anchor cells of an H200 (132 SMs), which the
// figures in bench/NOTES.md were measured with; and the memory those plans imply (layout.h): what a call's forward
// keeps in the caller's saved buffer for its backward.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/chunking.h"
#include "cuda/layout.h"
#include "cuda/plan.h"
#include "gdn_testing.h"

namespace deltatrain::gdn::testing {
namespace {

using cuda::ExecutionPlan;
using cuda::kWgmmaColumns;
using cuda::plan_execution;
using cuda::plan_saved;
using cuda::plan_workspace;
using cuda::PlanInputs;
using cuda::Region;
using cuda::SavedLayout;
using cuda::WorkspaceLayout;

constexpr int kH200Multiprocessors = 132;

class CudaPlan : public SeededTest {
 protected:
  // A random call: any operation, dtype and kernel head dims, 1-40 sequences of 1-600 chunks, GVA groups of 1-4
  // value heads, 1-64 value heads, on a device of 1-200 SMs that may or may not run wgmma.
  PlanInputs random_inputs() {
    auto pick = [&](auto lo, auto hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng_); };
    constexpr std::array kOperations{Operation::chunk_forward, Operation::chunk_backward, Operation::recurrent};
    constexpr std::array kDtypes{DType::bf16, DType::f16, DType::f32};
    PlanInputs in;
    in.op = kOperations[pick(0, 2)];
    in.io = kDtypes[pick(0, 2)];
    in.K = std::array{64, 128, 256}[pick(0, 2)];
    in.V = 64 * pick(1, 4) + (pick(0, 3) == 0 ? 32 : 0);  // now and then not a whole warpgroup of columns
    in.sequences = pick(1, 40);
    in.group = pick(1, 4);
    in.value_heads = in.group * pick(1, 64 / in.group);
    in.chunks = in.sequences * pick(1, 600);
    in.multiprocessors = static_cast<int>(pick(1, 200));
    in.wgmma_device = pick(0, 1) == 1;
    in.wgmma_allowed = pick(0, 3) != 0;
    const std::int64_t fused = pick(0, 2);  // DELTATRAIN_CUDA_FUSED_BACKWARD unset, 1 or 0
    if (fused != 0) in.fused_backward_setting = fused == 1;
    in.role_split_requested = pick(0, 2) == 0;  // DELTATRAIN_CUDA_ROLE_SPLIT_BACKWARD=1 now and then
    return in;
  }
};

std::string describe(const PlanInputs& in) {
  return "op " + std::string(operation_name(in.op)) + ", " + dtype_name(in.io) + ", K " + std::to_string(in.K) +
         ", V " + std::to_string(in.V) + ", " + std::to_string(in.sequences) + " sequences, " +
         std::to_string(in.value_heads) + " value heads in groups of " + std::to_string(in.group) + ", " + std::to_string(in.chunks) + " chunks, " +
         std::to_string(in.multiprocessors) + " SMs, wgmma device " + std::to_string(in.wgmma_device) +
         ", allowed " + std::to_string(in.wgmma_allowed) + ", fused backward setting " +
         (in.fused_backward_setting ? std::to_string(*in.fused_backward_setting) : std::string("unset")) +
         ", role split requested " + std::to_string(in.role_split_requested);
}

// The plan of the call `in` describes, for its operation `op`.
ExecutionPlan plan_of(PlanInputs in, Operation op) {
  in.op = op;
  return plan_execution(in);
}

TEST_F(CudaPlan, RulesHoldOnRandomCalls) {
  for (int trial = 0; trial < 5000; ++trial) {
    const PlanInputs in = random_inputs();
    SCOPED_TRACE(describe(in));
    const ExecutionPlan plan = plan_execution(in);
    if (in.op == Operation::recurrent) {
      EXPECT_EQ(plan, ExecutionPlan{}) << "the recurrent step has no state passes to plan";
      continue;
    }
    const bool wgmma_fits = in.io != DType::f32 && in.K <= 128 && in.V % kWgmmaColumns == 0;
    EXPECT_EQ(plan.wgmma, in.wgmma_device && in.wgmma_allowed && wgmma_fits);
    EXPECT_GE(plan.segments, 1);
    EXPECT_LE(plan.segments, 32);
    EXPECT_EQ(plan.maps_apart, plan.segments > 2 && in.chunks / in.sequences / plan.segments >= 32)
        << "M's rows apart from the segment ends pass where more than two segments hold 32 chunks or more each";
    // The wgmma passes form W where each warpgroup takes 64 of its keys, all but the unfused reverse pass proper.
    const bool passes_form_w = plan.wgmma && in.K / plan.warpgroups == 64;
    EXPECT_EQ(plan.passes_form_w, passes_form_w);
    EXPECT_EQ(plan.prepare_forms_w, !passes_form_w || (in.op == Operation::chunk_backward && !plan.fused_backward))
        << "prepare writes W exactly where a pass reads it: the mma.sync passes, the wgmma passes whose warpgroups "
           "take all 128 keys, and the unfused backward's reverse pass proper";
    if (!plan.wgmma) {
      // The mma.sync passes: unsplit, 2 or 4 warp pairs, 2 for float32 and wherever 2 fit in one wave.
      EXPECT_EQ(plan.segments, 1);
      EXPECT_EQ(plan.warpgroups, 1);
      EXPECT_FALSE(plan.paired);
      const std::int64_t narrow_ctas = in.sequences * in.value_heads * (in.V / 32);
      EXPECT_EQ(plan.warp_pairs, in.io == DType::f32 || narrow_ctas <= in.multiprocessors ? 2 : 4);
      EXPECT_FALSE(plan.fused_backward || plan.fused_input_grads || plan.role_split);
      continue;
    }
    const bool fused_fits = in.op == Operation::chunk_backward && in.K == 128 && in.V == 128;
    // The fused kernel's segments: the most (up to 32) whose (sequence, segment, value head) CTAs still fit the SMs,
    // with 16 chunks or more each; none where a segment would hold fewer.
    std::int64_t fused_segments = 1;
    while (fused_segments < 32 && (fused_segments + 1) * in.sequences * in.value_heads <= in.multiprocessors &&
           16 * (fused_segments + 1) <= in.chunks / in.sequences) {
      ++fused_segments;
    }
    // Unasked: where those CTAs fill their waves to 60% or more, counted as a fraction.
    const std::int64_t fused_ctas = in.sequences * in.value_heads * fused_segments;
    const std::int64_t waves = (fused_ctas + in.multiprocessors - 1) / in.multiprocessors;
    const bool waves_full = static_cast<double>(fused_ctas) / static_cast<double>(waves * in.multiprocessors) >= 0.60;
    EXPECT_EQ(plan.fused_backward, fused_fits && in.fused_backward_setting.value_or(waves_full))
        << "fused where the kernel's dims fit and the setting asks, or unset and its waves are full";
    if (plan.fused_backward) {
      // Its recompute pass walks the fused kernel's segments in two warpgroups a CTA, and nothing pairs or prepares
      // late. Unasked, its units (twice the fused CTAs) fill the SMs, so the forward's own rule would take two too.
      const ExecutionPlan forward_plan = plan_of(in, Operation::chunk_forward);
      EXPECT_EQ(plan.segments, fused_segments);
      EXPECT_EQ(plan.warpgroups, 2);
      if (!in.fused_backward_setting) {
        EXPECT_GE(2 * fused_ctas, in.multiprocessors);
        if (fused_segments == 1) {
          EXPECT_EQ(forward_plan.warpgroups, 2);
        }
      }
      EXPECT_FALSE(plan.paired);
      EXPECT_EQ(plan.role_split, in.role_split_requested) << "the fused backward split by role only when asked";
      EXPECT_EQ(plan.fused_input_grads, in.group <= 2) << "dq and dk finished in one CTA or a cluster pair";
      continue;
    }
    EXPECT_FALSE(plan.fused_input_grads);
    EXPECT_FALSE(plan.role_split) << "no fused backward to split";
    const std::int64_t units = in.sequences * in.value_heads * (in.V / kWgmmaColumns);
    if (units >= in.multiprocessors) {
      // Enough (sequence, head, columns) units to fill the GPU: no segments, two warpgroups where K = 128 and
      // the columns pair up.
      EXPECT_EQ(plan.segments, 1);
      EXPECT_FALSE(plan.paired);
      EXPECT_EQ(plan.warpgroups, in.K == 128 && in.V % (2 * kWgmmaColumns) == 0 ? 2 : 1);
      continue;
    }
    // A forward whose segments of two-warpgroup CTAs (up to 32 of them, the fused backward's cap) would hold 16 chunks
    // or more (its floor) takes those (its passes then form W); every other call below a wave takes one warpgroup a
    // CTA, in up to 16 segments.
    const bool two_groups_fit = in.K == 128 && in.V % (2 * kWgmmaColumns) == 0;
    const std::int64_t two_group_segments =  // units is even (2 or more) where two warpgroups fit
        two_groups_fit ? std::min<std::int64_t>({32, in.multiprocessors / (units / 2), in.chunks / in.sequences / 4})
                       : 0;
    const bool long_two_group_segments = in.op == Operation::chunk_forward && two_group_segments >= 2 &&
                                         in.chunks / in.sequences / two_group_segments >= 16;
    if (!long_two_group_segments) {
      EXPECT_LE(plan.segments, 16);
    }
    EXPECT_EQ(plan.warpgroups, long_two_group_segments ? 2 : 1);
    if (long_two_group_segments) {
      EXPECT_EQ(plan.segments, two_group_segments);
    }
    // Segments never make more CTAs than SMs, and each holds four chunks or more of its sequence on average.
    EXPECT_LE(plan.segments * units / plan.warpgroups, in.multiprocessors);
    if (plan.segments > 1) {
      EXPECT_LE(4 * plan.segments, in.chunks / in.sequences);
    }
    if (plan.paired) {
      // Pairing is for the backward, where both passes' units fit the SMs together, and unsegmented.
      EXPECT_EQ(in.op, Operation::chunk_backward);
      EXPECT_LE(2 * units, in.multiprocessors);
      EXPECT_EQ(plan.segments, 1);
    } else if (in.op == Operation::chunk_backward && 2 * units <= in.multiprocessors) {
      EXPECT_GE(plan.segments, 4) << "the backward segments only where that beats pairing (4 or more)";
    }
  }
}

// A call of `op` as a PlanInputs describes it, for the layouts: one row of whole chunks, H from the group.
Problem problem_of(const PlanInputs& in, Operation op, bool l2norm = false) {
  Problem p;
  p.l2norm = l2norm;
  p.op = op;
  p.B = 1;
  p.T = in.chunks * cuda::kChunk;
  p.HV = in.value_heads;
  p.H = in.value_heads / in.group;
  p.K = in.K;
  p.V = in.V;
  p.N = in.sequences;
  p.state_rows = in.sequences;
  p.io_dtype = in.io;
  return p;
}

// The regions a saved buffer may hold, with their names, in a layout of either kind: start_kernel's chunk schedule,
// what prepare writes, then the L2 norm's rows and reciprocal norms that start_kernel writes, then prepare's bounds on
// the chunks' maps.
constexpr std::size_t kKeptRegions = 15;
template <class Layout>
std::array<std::pair<const char*, const Region*>, kKeptRegions> kept_regions(const Layout& l) {
  return {{{"chunk_table", &l.chunk_table},
           {"sequence_chunks", &l.sequence_chunks},
           {"gamma", &l.gamma},
           {"gate_in", &l.gate_in},
           {"gate_out", &l.gate_out},
           {"beta_by_head", &l.beta_by_head},
           {"w", &l.w},
           {"u", &l.u},
           {"p", &l.p},
           {"t", &l.t},
           {"q_normed", &l.q_normed},
           {"k_normed", &l.k_normed},
           {"q_rstd", &l.q_rstd},
           {"k_rstd", &l.k_rstd},
           {"chunk_log_norms", &l.chunk_log_norms}}};
}

// The forward's saved buffer holds exactly what the backward's workspace would hold of start_kernel's and prepare's
// outputs, so that the backward finds everything it reads; the forward finds every region it writes in the buffer or
// its workspace (T, which the mma.sync forward does not read, in the buffer alone); and the buffer's regions are
// disjoint and aligned.
TEST_F(CudaPlan, SavedBufferHoldsWhatTheBackwardsPrepareWrites) {
  for (int trial = 0; trial < 5000; ++trial) {
    const PlanInputs in = random_inputs();
    if (in.op == Operation::recurrent) continue;
    SCOPED_TRACE(describe(in));
    const ExecutionPlan forward = plan_of(in, Operation::chunk_forward), backward = plan_of(in, Operation::chunk_backward);
    ASSERT_EQ(forward.wgmma, backward.wgmma) << "both operations of a call take the same kind of state passes";
    const bool l2norm = trial % 2 == 0;
    const Problem forward_call = problem_of(in, Operation::chunk_forward, l2norm);
    const Problem backward_call = problem_of(in, Operation::chunk_backward, l2norm);
    const SavedLayout saved = plan_saved(backward_call, in.chunks, forward, backward);
    const SavedLayout from_forward = plan_saved(forward_call, in.chunks, forward, backward);
    ASSERT_EQ(saved.bytes, from_forward.bytes) << "both operations lay the buffer out alike";
    for (std::size_t i = 0; i < kKeptRegions; ++i) {
      EXPECT_EQ(kept_regions(saved)[i].second->offset, kept_regions(from_forward)[i].second->offset);
    }
    const WorkspaceLayout alone = plan_workspace(backward_call, false, in.chunks, false, backward);
    const WorkspaceLayout beside = plan_workspace(backward_call, false, in.chunks, false, backward, saved);
    auto aligned = [](const Region& r) { return (r.bytes + 255) / 256 * 256; };
    EXPECT_EQ(alone.bytes - beside.bytes, saved.bytes - aligned(saved.segment_ends) - aligned(saved.segment_starts))
        << "the backward's workspace gives up exactly the buffer's regions but the forward's segment ends and starts, "
           "whose like its reverse passes make there";
    std::vector<Region> taken;
    for (const Region* kept : {&saved.segment_ends, &saved.segment_starts}) {
      if (kept->bytes > 0) taken.push_back(*kept);
    }
    for (std::size_t i = 0; i < kKeptRegions; ++i) {
      const auto [name, kept] = kept_regions(saved)[i];
      SCOPED_TRACE(name);
      EXPECT_EQ(kept->bytes, kept_regions(alone)[i].second->bytes) << "the buffer holds what the workspace would";
      if (kept->bytes == 0) continue;
      EXPECT_EQ(kept_regions(beside)[i].second->bytes, 0u);
      EXPECT_EQ(kept->offset % 256, 0u);
      EXPECT_LE(kept->offset + kept->bytes, saved.bytes);
      taken.push_back(*kept);
    }
    std::sort(taken.begin(), taken.end(), [](const Region& a, const Region& b) { return a.offset < b.offset; });
    for (std::size_t i = 1; i < taken.size(); ++i) EXPECT_LE(taken[i - 1].offset + taken[i - 1].bytes, taken[i].offset);

    const WorkspaceLayout forward_workspace = plan_workspace(forward_call, false, in.chunks, false, forward, saved);
    // What the forward itself uses, in kept_regions' order: the chunk schedule, gamma, both gates, beta by head on the
    // wgmma passes, W where its prepare forms it, U on the mma.sync passes, P, T on the wgmma passes, the L2 norm's
    // rows and reciprocals where the call takes the norm, the chunks' bounds where it or its backward is segmented.
    const bool bounds = forward.segments > 1 || backward.segments > 1;
    const bool forward_uses[kKeptRegions] = {true, true, true, true, true, forward.wgmma, forward.prepare_forms_w,
                                             !forward.wgmma, true, forward.wgmma, l2norm, l2norm, l2norm, l2norm,
                                             bounds};
    for (std::size_t i = 0; i < kKeptRegions; ++i) {
      const auto [name, kept] = kept_regions(saved)[i];
      SCOPED_TRACE(name);
      const bool in_workspace = kept_regions(forward_workspace)[i].second->bytes > 0;
      if (forward_uses[i]) {
        EXPECT_NE(in_workspace, kept->bytes > 0) << "a region the forward writes lies in one place";
      } else {
        EXPECT_FALSE(in_workspace);
      }
    }
    EXPECT_GT(saved.chunk_table.bytes, 0u) << "the backward launches no start_kernel of its own";
    EXPECT_GT(saved.t.bytes, 0u) << "the backward reads T";
    EXPECT_EQ(saved.beta_by_head.bytes > 0, backward.wgmma) << "the wgmma passes scale T by it";
    EXPECT_EQ(saved.q_normed.bytes > 0, l2norm) << "the backward normalises q and k again only without the buffer";
    EXPECT_EQ(saved.chunk_log_norms.bytes > 0, backward.segments > 1) << "the backward's segment ends passes read them";

    // Where the backward's recompute reuses the forward's segment starts, the buffer holds the one direction's ends and
    // starts a forward's workspace would, the forward writes them there alone, and the backward's workspace still holds
    // a set for its reverse passes; elsewhere the buffer holds none.
    if (cuda::backward_reuses_forward_starts(forward, backward)) {
      ASSERT_EQ(forward.segments, backward.segments) << "the same segment ends launch wrote them";
      const WorkspaceLayout forward_alone = plan_workspace(forward_call, false, in.chunks, false, forward);
      EXPECT_GT(saved.segment_ends.bytes, 0u);
      EXPECT_EQ(saved.segment_ends.bytes, forward_alone.segment_ends.bytes);
      EXPECT_EQ(saved.segment_starts.bytes, forward_alone.segment_starts.bytes);
      EXPECT_EQ(saved.segment_starts.bytes > 0, forward.segments > 2) << "two segments compose no start";
      EXPECT_EQ(forward_workspace.segment_ends.bytes + forward_workspace.segment_starts.bytes, 0u);
      EXPECT_EQ(beside.segment_ends.bytes, alone.segment_ends.bytes);
      EXPECT_EQ(beside.segment_starts.bytes, alone.segment_starts.bytes);
    } else {
      EXPECT_EQ(saved.segment_ends.bytes + saved.segment_starts.bytes, 0u);
    }
  }
}

// A segmented call's prepare bounds every chunk's map for its segment ends passes (gdn/cuda/warmup.h): one float per
// (value head, chunk) in its workspace, and nothing where no segment ends pass runs.
TEST_F(CudaPlan, SegmentedCallsKeepEachChunksBound) {
  for (int trial = 0; trial < 5000; ++trial) {
    const PlanInputs in = random_inputs();
    if (in.op == Operation::recurrent) continue;
    SCOPED_TRACE(describe(in));
    const ExecutionPlan plan = plan_of(in, in.op);
    const WorkspaceLayout layout = plan_workspace(problem_of(in, in.op), false, in.chunks, false, plan);
    const bool bounds = plan.segments > 1;
    EXPECT_EQ(layout.chunk_log_norms.bytes, bounds ? static_cast<std::size_t>(in.value_heads * in.chunks) * 4 : 0u);
    if (bounds) {
      EXPECT_EQ(layout.chunk_log_norms.offset % 256, 0u);
      EXPECT_LE(layout.chunk_log_norms.offset + layout.chunk_log_norms.bytes, layout.bytes);
    }
  }
}

// The anchor cells (bf16, K = V = 128, 64-token chunks) on an H200: the choices the recorded figures rest on.
// The anchors' cells: 16 q/k heads, GVA groups of value_heads / 16 (16/16, 16/32) or one group (fewer heads).
PlanInputs anchor(Operation op, std::int64_t value_heads, std::int64_t sequences, std::int64_t tokens_each) {
  PlanInputs in;
  in.op = op;
  in.io = DType::bf16;
  in.sequences = sequences;
  in.value_heads = value_heads;
  in.group = value_heads >= 16 ? value_heads / 16 : value_heads;
  in.chunks = sequences * (tokens_each / 64);
  in.multiprocessors = kH200Multiprocessors;
  in.wgmma_device = true;
  return in;
}

TEST(CudaPlanAnchors, H200Choices) {
  // 32 heads x 2 column blocks = 64 units of one sequence: in the forward, CTAs of two warpgroups (32 a segment) in
  // four segments of 128 chunks, rather than two segments of one warpgroup a CTA; 64 heads, which fill 128 of 132 SMs
  // unsegmented, two segments of 256 chunks in two-warpgroup CTAs; at 8192 tokens four segments of 32 chunks in
  // two-warpgroup CTAs too, and at 4096 tokens four of 16 chunks (the fused backward's plan of that call); at 2048
  // tokens (two-warpgroup segments of 8 chunks) one warpgroup ...
  const ExecutionPlan long_forward = plan_execution(anchor(Operation::chunk_forward, 32, 1, 32768));
  EXPECT_EQ(long_forward.segments, 4);
  EXPECT_EQ(long_forward.warpgroups, 2);
  const ExecutionPlan wide_forward = plan_execution(anchor(Operation::chunk_forward, 64, 1, 32768));
  EXPECT_EQ(wide_forward.segments, 2);
  EXPECT_EQ(wide_forward.warpgroups, 2);
  const ExecutionPlan forward_8192 = plan_execution(anchor(Operation::chunk_forward, 32, 1, 8192));
  EXPECT_EQ(forward_8192.segments, 4);
  EXPECT_EQ(forward_8192.warpgroups, 2);
  const ExecutionPlan forward_4096 = plan_execution(anchor(Operation::chunk_forward, 32, 1, 4096));
  EXPECT_EQ(forward_4096.segments, 4);
  EXPECT_EQ(forward_4096.warpgroups, 2);
  const ExecutionPlan short_forward = plan_execution(anchor(Operation::chunk_forward, 32, 1, 2048));
  EXPECT_EQ(short_forward.segments, 2);
  EXPECT_EQ(short_forward.warpgroups, 1);
  // ... and, where the fused backward's segments would be too short (2048 tokens: two of 16 chunks, 64 CTAs), the
  // backward's two passes side by side instead (128 units fit 132 SMs).
  const ExecutionPlan backward = plan_execution(anchor(Operation::chunk_backward, 32, 1, 2048));
  EXPECT_TRUE(backward.paired);
  EXPECT_EQ(backward.segments, 1);
  // Four sequences of 32 heads fill the GPU: two warpgroups per CTA, no segments.
  const ExecutionPlan filled = plan_execution(anchor(Operation::chunk_forward, 32, 4, 8192));
  EXPECT_EQ(filled.warpgroups, 2);
  EXPECT_EQ(filled.segments, 1);
  // The fused backward unasked where its CTAs fill their waves to 60%: eight sequences of 32 heads (256 CTAs, two
  // waves 97% full; its recompute takes two warpgroups per CTA as the forward would), the 0.8B model's eight of 16
  // heads (128 CTAs, one wave), seven of 32 (224 CTAs, 85%), three of 32 (96 CTAs, 73%) and five of 32 (160 CTAs,
  // 61%); where the (sequence, value head) units are fewer, segments of 16 chunks or more fill the wave: one sequence
  // of 32 heads and 32768 tokens in four (128 CTAs; its recompute's 128 CTAs of two warpgroups, one wave, as the
  // forward's plan of the same call), one of 8192 or 4096 tokens in four, two of 4096 in two, eight of 4 heads and
  // 4096 tokens in four, one of 4 heads and 32768 tokens in 32 (the cap). Not one of 2048 tokens (two segments of 16
  // chunks leave 64 CTAs, 48%), eight of 4 heads and 2048 tokens (two segments: 64 CTAs), nor where
  // DELTATRAIN_CUDA_FUSED_BACKWARD=0. Asked for, one sequence of 2048 tokens takes it in two.
  auto with_setting = [](PlanInputs in, bool fused) {
    in.fused_backward_setting = fused;
    return plan_execution(in);
  };
  const ExecutionPlan eight = plan_execution(anchor(Operation::chunk_backward, 32, 8, 4096));
  EXPECT_TRUE(eight.fused_backward);
  EXPECT_TRUE(plan_execution(anchor(Operation::chunk_backward, 16, 8, 4096)).fused_backward);
  EXPECT_TRUE(plan_execution(anchor(Operation::chunk_backward, 32, 7, 4096)).fused_backward);
  EXPECT_TRUE(plan_execution(anchor(Operation::chunk_backward, 32, 3, 4096)).fused_backward);
  EXPECT_TRUE(plan_execution(anchor(Operation::chunk_backward, 32, 5, 4096)).fused_backward);
  EXPECT_EQ(eight.warpgroups, 2);
  EXPECT_EQ(eight.segments, 1);
  const ExecutionPlan longest = plan_execution(anchor(Operation::chunk_backward, 32, 1, 32768));
  EXPECT_TRUE(longest.fused_backward);
  EXPECT_EQ(longest.segments, 4);
  EXPECT_EQ(longest.warpgroups, 2);
  EXPECT_TRUE(longest.passes_form_w);
  EXPECT_FALSE(longest.prepare_forms_w) << "its segment ends passes form W as its recompute does";
  const ExecutionPlan shorter = plan_execution(anchor(Operation::chunk_backward, 32, 1, 8192));
  EXPECT_TRUE(shorter.fused_backward);
  EXPECT_EQ(shorter.segments, 4);
  EXPECT_EQ(plan_execution(anchor(Operation::chunk_backward, 32, 2, 4096)).segments, 2);
  EXPECT_TRUE(plan_execution(anchor(Operation::chunk_backward, 32, 2, 4096)).fused_backward);
  EXPECT_EQ(plan_execution(anchor(Operation::chunk_backward, 32, 1, 4096)).segments, 4);
  EXPECT_TRUE(plan_execution(anchor(Operation::chunk_backward, 32, 1, 4096)).fused_backward);
  EXPECT_EQ(plan_execution(anchor(Operation::chunk_backward, 4, 8, 4096)).segments, 4);
  EXPECT_TRUE(plan_execution(anchor(Operation::chunk_backward, 4, 8, 4096)).fused_backward);
  EXPECT_FALSE(plan_execution(anchor(Operation::chunk_backward, 32, 1, 2048)).fused_backward);
  EXPECT_FALSE(plan_execution(anchor(Operation::chunk_backward, 4, 8, 2048)).fused_backward);
  EXPECT_FALSE(with_setting(anchor(Operation::chunk_backward, 32, 8, 4096), false).fused_backward);
  const ExecutionPlan one = with_setting(anchor(Operation::chunk_backward, 32, 1, 2048), true);
  EXPECT_TRUE(one.fused_backward);
  EXPECT_EQ(one.segments, 2);
  EXPECT_EQ(one.warpgroups, 2);
  // Both finish dq and dk in the fused kernel (groups of 2, as the model's 16/16 heads' groups of 1); groups of 4 not.
  EXPECT_TRUE(eight.fused_input_grads && one.fused_input_grads);
  EXPECT_TRUE(plan_execution(anchor(Operation::chunk_backward, 16, 8, 4096)).fused_input_grads);
  PlanInputs quartets = anchor(Operation::chunk_backward, 32, 8, 4096);
  quartets.group = 4;
  EXPECT_TRUE(plan_execution(quartets).fused_backward);
  EXPECT_FALSE(plan_execution(quartets).fused_input_grads);
  EXPECT_FALSE(eight.paired || one.paired);
  // DELTATRAIN_CUDA_ROLE_SPLIT_BACKWARD=1 splits a fused backward by role, which finishes dq and dk as the fused one
  // does; where the backward is not fused there is nothing to split.
  PlanInputs split = anchor(Operation::chunk_backward, 32, 8, 4096);
  split.role_split_requested = true;
  EXPECT_TRUE(plan_execution(split).role_split);
  EXPECT_TRUE(plan_execution(split).fused_input_grads);
  EXPECT_FALSE(eight.role_split);
  PlanInputs unfused_split = anchor(Operation::chunk_backward, 32, 1, 2048);
  unfused_split.role_split_requested = true;
  EXPECT_FALSE(plan_execution(unfused_split).role_split);
  // W is formed in the wgmma passes of two warpgroups (64 keys each), the segment ends passes of either direction
  // among them; prepare writes it where one warpgroup takes all 128 keys (short forward segments, the paired passes)
  // and for the unfused backward's reverse pass proper.
  EXPECT_FALSE(eight.prepare_forms_w || filled.prepare_forms_w || one.prepare_forms_w || long_forward.prepare_forms_w);
  EXPECT_TRUE(eight.passes_form_w && filled.passes_form_w && one.passes_form_w && long_forward.passes_form_w);
  EXPECT_FALSE(short_forward.passes_form_w || backward.passes_form_w);
  EXPECT_TRUE(short_forward.prepare_forms_w && backward.prepare_forms_w);
  // The forward keeps for the backward (ForwardOutputs::saved) everything the backward's start_kernel and prepare
  // write, so that the backward skips both; its size per token and value head, beyond the chunk schedule (16 bytes a
  // chunk, 4 a sequence, laid out first) (docs/cuda-backend.md): gamma (8), both gates and beta
  // (4 each), P and T (128 each at bf16), and W (256) where the backward's prepare forms it (which the forward's
  // prepare then forms too: the unfused backward of two warpgroups, whose reverse pass reads it); with the L2 norm, per
  // token and q/k head, the normed q and k (256 each) and their reciprocal norms (4 each).
  const PlanInputs unfused = [&] {
    PlanInputs in = anchor(Operation::chunk_backward, 32, 8, 4096);
    in.fused_backward_setting = false;
    return in;
  }();
  auto saved_per_token_head = [&](const PlanInputs& in, bool l2norm) {
    const Problem call = problem_of(in, Operation::chunk_backward, l2norm);
    const SavedLayout saved = plan_saved(call, in.chunks, plan_of(in, Operation::chunk_forward), plan_execution(in));
    return (saved.bytes - saved.gamma.offset) / static_cast<std::size_t>(call.tokens() * call.HV);
  };
  EXPECT_EQ(saved_per_token_head(anchor(Operation::chunk_backward, 16, 8, 4096), false), 276u);
  EXPECT_EQ(saved_per_token_head(anchor(Operation::chunk_backward, 16, 8, 4096), true), 796u)
      << "the 0.8B model's layers";
  EXPECT_EQ(saved_per_token_head(anchor(Operation::chunk_backward, 32, 8, 4096), false), 276u);
  EXPECT_EQ(saved_per_token_head(anchor(Operation::chunk_backward, 32, 8, 4096), true), 536u)
      << "two value heads a key head";
  EXPECT_EQ(saved_per_token_head(anchor(Operation::chunk_backward, 32, 1, 2048), false), 532u) << "one warpgroup: W";
  EXPECT_EQ(saved_per_token_head(unfused, false), 532u) << "two warpgroups, unfused: the reverse pass reads W";
  // The backward's recompute reads the forward's segment ends and starts where both are segmented alike: one sequence
  // of 32 heads and 8192 or 32768 tokens (four segments of two-warpgroup CTAs, the fused backward), one of 4 heads and
  // 8192 tokens (16 of one, unfused), one of 4 heads and 32768 tokens (32 of two, the fused backward's cap), eight of 4
  // heads and 4096 tokens (four of two a sequence) and one of 32 heads and 4096 tokens (four of two); not the batched
  // cells (none).
  auto reuses_starts = [](const PlanInputs& in) {
    return cuda::backward_reuses_forward_starts(plan_of(in, Operation::chunk_forward),
                                                plan_of(in, Operation::chunk_backward));
  };
  EXPECT_TRUE(reuses_starts(anchor(Operation::chunk_backward, 32, 1, 8192)));
  EXPECT_TRUE(reuses_starts(anchor(Operation::chunk_backward, 32, 1, 32768)));
  EXPECT_TRUE(reuses_starts(anchor(Operation::chunk_backward, 4, 1, 8192)));
  EXPECT_TRUE(reuses_starts(anchor(Operation::chunk_backward, 4, 1, 32768)));
  EXPECT_TRUE(reuses_starts(anchor(Operation::chunk_backward, 4, 8, 4096)));
  EXPECT_TRUE(reuses_starts(anchor(Operation::chunk_backward, 32, 1, 4096)));
  EXPECT_FALSE(reuses_starts(anchor(Operation::chunk_backward, 32, 8, 4096)));
  // Their cost in the buffer, in float32: V x K per (sequence, value head) for every segment's end but the last and,
  // beyond two segments, for every segment's start: 4 heads, 16 segments, 128 x 128, (15 + 16) x 4 x 64 KB = 7.75 MB.
  const PlanInputs four_heads = anchor(Operation::chunk_backward, 4, 1, 8192);
  const SavedLayout four_heads_saved = plan_saved(problem_of(four_heads, Operation::chunk_backward), four_heads.chunks,
                                                  plan_of(four_heads, Operation::chunk_forward),
                                                  plan_execution(four_heads));
  EXPECT_EQ(four_heads_saved.segment_ends.bytes, 15u * 4 * 128 * 128 * 4);
  EXPECT_EQ(four_heads_saved.segment_starts.bytes, 16u * 4 * 128 * 128 * 4);
  // Four heads of one long sequence, unfused: 8 units, 16 segments (the cap), which beats pairing; their 32 chunks
  // each launch M's rows apart from the ends pass, 8 chunks each (8192 tokens) do not, and two segments need no M.
  // Fused (unasked), its 32 segments of 16 chunks keep M's rows in the ends pass.
  const ExecutionPlan few = with_setting(anchor(Operation::chunk_backward, 4, 1, 32768), false);
  EXPECT_EQ(few.segments, 16);
  EXPECT_FALSE(few.paired);
  EXPECT_TRUE(few.maps_apart);
  const ExecutionPlan few_fused = plan_execution(anchor(Operation::chunk_backward, 4, 1, 32768));
  EXPECT_TRUE(few_fused.fused_backward);
  EXPECT_EQ(few_fused.segments, 32);
  EXPECT_FALSE(few_fused.maps_apart);
  EXPECT_FALSE(plan_execution(anchor(Operation::chunk_backward, 4, 1, 8192)).maps_apart);
  EXPECT_TRUE(long_forward.maps_apart) << "four segments of 128 chunks";
  // Eight heads, one sequence: at 32768 tokens 16 forward segments of 32 chunks in two-warpgroup CTAs, M's rows apart;
  // at 8192, 8 one-warpgroup segments of 16 chunks, M's rows in the ends pass.
  const ExecutionPlan eight_heads = plan_execution(anchor(Operation::chunk_forward, 8, 1, 32768));
  EXPECT_EQ(eight_heads.segments, 16);
  EXPECT_EQ(eight_heads.warpgroups, 2);
  EXPECT_TRUE(eight_heads.maps_apart);
  const ExecutionPlan eight_heads_short = plan_execution(anchor(Operation::chunk_forward, 8, 1, 8192));
  EXPECT_EQ(eight_heads_short.segments, 8);
  EXPECT_FALSE(eight_heads_short.maps_apart);
  // DELTATRAIN_CUDA_WGMMA=0 on the same device: the mma.sync passes, 4 warp pairs once 2 would overflow a wave.
  PlanInputs forced = anchor(Operation::chunk_forward, 32, 4, 8192);
  forced.wgmma_allowed = false;
  const ExecutionPlan mma_sync = plan_execution(forced);
  EXPECT_FALSE(mma_sync.wgmma);
  EXPECT_EQ(mma_sync.warp_pairs, 4);
  EXPECT_TRUE(mma_sync.prepare_forms_w);
  const ExecutionPlan mma_sync_backward = plan_of(forced, Operation::chunk_backward);
  const Problem forced_call = problem_of(forced, Operation::chunk_backward);
  const SavedLayout forced_saved = plan_saved(forced_call, forced.chunks, mma_sync, mma_sync_backward);
  EXPECT_EQ(forced_saved.bytes - forced_saved.gamma.offset,
            784u * static_cast<std::size_t>(forced_call.tokens() * forced_call.HV))
      << "W and U (256 bytes each) where the wgmma passes keep beta (4 bytes)";
}

}  // namespace
}  // namespace deltatrain::gdn::testing
