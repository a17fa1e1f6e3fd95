#include "plan.h"

#include <algorithm>

namespace deltatrain::gdn::cuda {
namespace {

// The wgmma passes are built for 16-bit inputs and K <= 128 (float32 tiles and K = 256 do not fit their
// shared memory) over whole warpgroups of columns.
bool wgmma_applies(const PlanInputs& in) {
  return in.wgmma_device && in.wgmma_allowed && in.io != DType::f32 && in.K <= 128 && in.V % kWgmmaColumns == 0;
}

// The fused backward's segments. Its CTAs walk (sequence, segment, value head) back from the state gradient at each
// segment's end (the backward's segment ends pass warms it up or composes it), so where the (sequence,
// value head) units leave SMs idle it takes as many segments as fill one wave. Its step (~14 us a chunk) is 4-7x the
// unfused passes', so it pays only in full waves, and cutting a sequence into segments is how few sequences get them.
// With exact segment starts every segment added the recompute's ends pass and the backward's over all its chunks, so
// a segment had to be long: against the unfused backward on an H100, four segments of 16 chunks took +4.3% (bwd 2/4
// 8 x 4096), of 32 chunks -0.4% (16/32 1 x 8192), of 128 chunks -10% (16/32 1 x 32768; bench/results/
// gdn-h100-fused-fill-segments-ab.md), and with a two-warpgroup recompute (fad978c) four of 32 took 16/32 1 x 8192
// -12.0% (gdn-h100-fused-floor32-ab.md). Bounded warm-ups make a segment's start cost a few chunks, so the floor is
// 16 chunks and the cap 32 segments: bwd 2/4 1 x 32768 then fills a wave (32 segments x 4 heads, 128 CTAs), 0.578 ->
// 0.432 ms (-25.3%), and 2/4 8 x 4096 (four a sequence) 0.486 -> 0.366 ms (-24.6%; gdn-h100-session44-grid-ab.md).
constexpr std::int64_t kFusedSegmentMinChunks = 16;
constexpr std::int64_t kFusedMaxSegments = 32;

// Step 1 of a segmented pass (state_hopper.cu) walks each segment but the last for its end rows and, beyond two
// segments, for its map M. As more row blocks of the ends pass's launch, M's rows take its tiles of V or dO (and
// in the reverse pass a 133 KB CTA, one an SM); in a launch of their own (67 KB at K = 128), a CTA of each shares
// an SM, for one more launch and join in the graph: a fixed cost that short segments do not repay. On an H100, with
// every kernel at the largest shared-memory carveout, apart took 16 segments of 32 chunks (bwd 2/4 1x32768) -2.8%,
// 8 of 64 (fwd 2/8 1x32768) -1.4%, 4 of 128 (bwd 16/32 1x32768, fused) -2.4%, and 16 of 8 (bwd 2/4 1x8192) +2.8%
// (bench/results/gdn-h100-segment-maps-carveout-ab.md). With the threshold at 16, 8 forward segments of 16 (fwd 2/8
// 1x8192) lost 4.2% while 8 of 64 stayed within noise (+0.4%) and 16 backward ones of 32 gained (-2.4%; bench/results/
// gdn-h100-maps-rule-decays-ab.md): the fixed cost is repaid from about 32 chunks a segment.
constexpr std::int64_t kMapsApartMinChunks = 32;

// A segmented forward of two warpgroups a CTA (K = 128, V a multiple of 128): its passes form W (wgmma_pass_forms_w),
// so that prepare neither forms nor writes it (nor, since the segment ends passes form it too, does a training
// forward for its backward), at twice the segments of one-warpgroup CTAs, each step ~1.5x longer. With exact
// segment starts (every segment walked twice) that paid only where the segments held 128 chunks (H100: fwd 16/32
// 1x32768, four of 128, -5.9%, though prepare still wrote W for the backward; 16/64 1x32768, two of 256, -3.5%; 16/32
// 1x8192, four of 32, +7.3%; 2/8 1x32768 and 1x8192, sixteen of 32 and 8, +1.3% and +19.9%: bench/results/
// gdn-h100-two-warpgroup-segments-ab.md). With warm-ups, and the segment ends passes forming W as well, so that no
// prepare writes it: fwd 16/32 1x32768 1.02 -> 0.86 ms (-15.6%), 16/64 1x32768 1.90 -> 1.67 (-11.4%; bench/results/
// gdn-h100-two-warpgroup-segments-copied-starts-ab.md). With warm-ups a segment's ends pass walks a few chunks, so
// the floor is 32 chunks: fwd 16/32 1x8192 (four of 32) -6.4%, 16/64 1x8192 (two of 64) -2.0%, 2/8 1x32768 (sixteen
// of 32) -4.0%, 2/8 8192x4 (four of 32 a sequence) -6.7% (H100, bench/results/gdn-h100-two-warpgroup-floor-32-ab.md).
// Segments of 16 chunks and up to 32 of them (the fused backward's floor and cap) so that a training forward that
// fills fewer SMs than the backward's plan takes that plan, and the backward reads its segment starts from the forward's
// buffer (backward_reuses_forward_starts): one sequence of 2/4 heads and 32768 tokens went from 16 segments of 32
// (64 CTAs) to 32 of 16 (128), eight of 4096 from two one-warpgroup segments to four of two; no anchor forward moves.
// Measured (H100, bench/results/gdn-h100-forward-takes-fused-segments-ab.md): bwd 2/4 1x32768 -6.5%, 2/4 8x4096
// -6.3%, 16/32 1x4096 -6.7% (the backward's state_forward 0.09 -> 0.07 ms), and those forwards -24.6%, -7.2%, -4.4%.
constexpr std::int64_t kTwoWarpgroupSegmentMinChunks = kFusedSegmentMinChunks;
constexpr std::int64_t kTwoWarpgroupMaxSegments = kFusedMaxSegments;
// Every other segmented plan's cap.
constexpr std::int64_t kOneWarpgroupMaxSegments = 16;

// Whether a CTA may take two warpgroups on adjacent 64 columns: K = 128 and V a multiple of 128.
bool two_warpgroups_fit(const PlanInputs& in) { return in.K == 128 && in.V % (2 * kWgmmaColumns) == 0; }

// A sequence's chunks on average: what each sequence's segments share.
std::int64_t chunks_per_sequence(const PlanInputs& in) { return in.chunks / std::max<std::int64_t>(1, in.sequences); }

std::int64_t fused_backward_segments(const PlanInputs& in) {
  const std::int64_t units = std::max<std::int64_t>(1, in.sequences * in.value_heads);
  return std::max<std::int64_t>(
      1, std::min<std::int64_t>(
             {kFusedMaxSegments, in.multiprocessors / units, chunks_per_sequence(in) / kFusedSegmentMinChunks}));
}

// The fused backward (built for K = V = 128) runs one CTA per (sequence, segment, value head) through the chunks, so
// its time is that of its waves (CTAs / SMs rounded up), where the unfused kernels' follows the units themselves.
// Measured on the H200 over 1-8 sequences of 4096 tokens at 16/16 and 16/32 heads, with dq and dk finished in the
// fused kernel (bench/gdn_fused_fill.py, bench/results/gdn-h200-fused-fill-input-grads.json): where its last wave is
// 97% full it takes 0.70-0.76 of the unfused kernels' time, 85% full 0.76-0.81, 73% full 0.81-0.89, 61% full
// 0.89-0.99, 48% full 1.05-1.19, and under that up to 1.35x theirs. So unasked it runs where its waves are at least
// 60% full; bench/NOTES.md, "The fused backward, first form" and after.
bool fused_backward_applies(const PlanInputs& in) {
  if (in.op != Operation::chunk_backward || in.K != 128 || in.V != 128) return false;
  if (in.fused_backward_setting) return *in.fused_backward_setting;
  const std::int64_t ctas = in.sequences * in.value_heads * fused_backward_segments(in);
  const std::int64_t wave_slots = (ctas + in.multiprocessors - 1) / in.multiprocessors * in.multiprocessors;
  return 10 * ctas >= 6 * wave_slots;
}

ExecutionPlan plan_wgmma(const PlanInputs& in) {
  if (fused_backward_applies(in)) {
    // Its one state pass, the recompute, and the kernel itself walk the fused kernel's segments, and nothing pairs.
    // The recompute takes two warpgroups a CTA (K = V = 128 here): its (sequence, segment, head, 64 columns) units
    // are twice the fused kernel's CTAs, which fill 60% of the SMs or more unasked, so they fill the GPU, where the
    // forward's rule takes two as well. With segments, one warpgroup a CTA (118 KB of shared memory: one an SM) would
    // run its pass proper in two waves; two run it in one, and form W themselves instead of reading prepare's (which
    // the backward's segment ends pass still reads).
    ExecutionPlan plan;
    plan.wgmma = true;
    plan.segments = static_cast<int>(fused_backward_segments(in));
    plan.warpgroups = 2;
    plan.fused_backward = true;
    // A group's partial dq and dk meet in one CTA's registers, or a cluster pair's, without the float32 round trip
    // through memory: 1.07 GB at 16/32 heads, 8 x 4096 tokens, and input_grad_kernel's launch (bench/NOTES.md,
    // "dq and dk finished in the fused backward"). Larger groups would need larger clusters; they keep it.
    plan.role_split = in.role_split_requested;
    plan.fused_input_grads = in.group == 1 || in.group == 2;
    return plan;
  }
  ExecutionPlan plan;
  plan.wgmma = true;
  const std::int64_t units = std::max<std::int64_t>(1, in.sequences * in.value_heads * (in.V / kWgmmaColumns));
  if (units >= in.multiprocessors) {
    // The (sequence, head, 64 columns) units fill the GPU by themselves. With K = 128 and V a multiple of 128
    // a CTA takes two on adjacent columns: the two warpgroups share the chunk tiles (W, K, Q, P, the gates)
    // and their copies, the SM interleaves their two latency-bound chains of steps, and half as many CTAs
    // make fewer waves (forward state pass, 16/32 heads, 4 x 8192 tokens: 0.462 -> 0.352 ms on the H200).
    // Where segments are needed, a forward takes two only with long segments (kTwoWarpgroupSegmentMinChunks).
    plan.warpgroups = two_warpgroups_fit(in) ? 2 : 1;
    return plan;
  }
  // Every segment but the last walks its chunks twice (ends with K more rows, then the pass proper), yet
  // two segments already pay on the H200: the ends step carries no Q, P or O, and the pass proper halves
  // (forward 16/32 heads, one sequence of 32768 tokens: 0.837 -> 0.680 ms). A segment of a handful of chunks
  // is mostly pipeline fill.
  auto segments_of = [&](std::int64_t ctas_a_segment, std::int64_t most) {
    return std::min<std::int64_t>({most, in.multiprocessors / ctas_a_segment, chunks_per_sequence(in) / 4});
  };
  const std::int64_t segments = segments_of(units, kOneWarpgroupMaxSegments);
  // The backward runs two passes of L chunk steps each, and s segments make a pass cost about 2 L / s steps
  // (ends, then the pass proper): 2 L in all for one or two segments, 4 L / 3 for three. Where both passes'
  // units fit the SMs together they can instead run unsegmented side by side in L steps.
  if (in.op == Operation::chunk_backward && 2 * units <= in.multiprocessors && segments < 4) {
    plan.paired = true;
    return plan;
  }
  plan.segments = segments >= 2 ? static_cast<int>(segments) : 1;
  if (in.op == Operation::chunk_forward && two_warpgroups_fit(in)) {
    const std::int64_t two_group_segments = segments_of(units / 2, kTwoWarpgroupMaxSegments);
    if (two_group_segments >= 2 && chunks_per_sequence(in) / two_group_segments >= kTwoWarpgroupSegmentMinChunks) {
      plan.warpgroups = 2;
      plan.segments = static_cast<int>(two_group_segments);
    }
  }
  // Prepare is one launch before the segment ends pass. Preparing the last segment's chunks beside that pass, in a
  // second launch over the chunk table, paid while the pass walked whole segments (fwd 16/32 1x32768 1.152 -> 1.070
  // ms); with warm-ups it walks a few chunks and hides little, and each launch's CTAs of the other chunks still
  // started and returned: without it fwd 16/32 1x32768 -7.8%, 16/64 1x32768 -9.4%, 2/8 1x8192 -4.4% (H100,
  // bench/results/gdn-h100-no-late-prepare-ab.md).
  return plan;
}

}  // namespace

bool backward_reuses_forward_starts(const ExecutionPlan& forward, const ExecutionPlan& backward) {
  return forward.wgmma && backward.wgmma && forward.segments > 1 && forward.segments == backward.segments &&
         forward.warpgroups == backward.warpgroups && forward.maps_apart == backward.maps_apart;
}

ExecutionPlan plan_execution(const PlanInputs& in) {
  if (in.op == Operation::recurrent) return {};  // one kernel, no state passes
  if (wgmma_applies(in)) {
    ExecutionPlan plan = plan_wgmma(in);
    plan.maps_apart = plan.segments > 2 && chunks_per_sequence(in) / plan.segments >= kMapsApartMinChunks;
    // The wgmma forward-direction passes form W a chunk ahead from the tiles they hold for U, off the state's chain,
    // where their warpgroups take 64 keys each: prepare's W product and the 16 KB per chunk and head it writes and
    // the pass reads back are gone (bench/NOTES.md, "W formed in the state pass").
    plan.passes_form_w = wgmma_pass_forms_w(in.K, plan.warpgroups);
    // prepare forms W for every pass the call launches that reads it: any (the segment ends passes of either direction
    // included) where the passes do not form it, and the unfused backward's reverse pass proper, which never does.
    const bool reverse_pass_proper = in.op == Operation::chunk_backward && !plan.fused_backward;
    plan.prepare_forms_w = wgmma_pass_reads_w(reverse_pass_proper, in.K, plan.warpgroups);
    return plan;
  }
  ExecutionPlan plan;
  // Warp pairs per CTA of the mma.sync passes: 2 (32 columns of V) when the grid then still fits on the GPU
  // in one wave, so that each SM runs one pair per scheduler couple and none waits for a second wave; else 4
  // (64 columns), so that the chunk tiles are loaded once for more columns. float32 tiles leave shared
  // memory for 2 only.
  const std::int64_t narrow_ctas = in.sequences * in.value_heads * (in.V / 32);
  plan.warp_pairs = in.io == DType::f32 || narrow_ctas <= in.multiprocessors ? 2 : 4;
  return plan;
}

}  // namespace deltatrain::gdn::cuda
