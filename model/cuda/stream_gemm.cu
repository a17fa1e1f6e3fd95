// The weight-streaming product of decode (stream_gemm_plan.h says when it runs and how it divides the work):
// y [M, N] = alpha x [M, K] W [N, K]^T (+ beta c) for at most 64 rows of x, where the time is W's bytes over the
// memory bandwidth. cuBLASLt's kernels read the narrow ones (out_proj, down) at 0.3-1 TB/s (bench/NOTES.md, Rollout).
//
// Each CTA, one warpgroup, computes kStreamFeatures outputs (weight rows) for all 64 rows of the row tile over one
// split's run of K chunks: warp w's 16 features come from shared memory as the A fragments of wgmma m64n64k16, x's
// chunk is its B operand (128-byte swizzled, rows past M zero-filled). At 64 rows the product is 64 flops a weight
// byte, more than mma.sync sustains at the memory's pace; wgmma leaves the SM idle for most of a chunk. Weight
// and activation chunks stream through a cp.async pipeline kStreamStages deep, so that 32 KB of each CTA's weight
// is in flight, two CTAs per SM. The splits of one feature tile form a thread block cluster, and its rows are shared
// out among them by groups of 8: each CTA sends its partial sums of every row group, by one bulk copy, into the
// receive buffer of the group's owner, where they land on the owner's mbarrier; the owner adds them in split order.
// No cluster-wide barrier with release semantics (a GPU-scope fence: cooperative_groups' cluster.sync() took a
// tenth of the kernel's samples) and no remote loads. So the result is the same run to run, and a row's result does
// not depend on the other rows (every output element's sum runs in the same order whatever M is).
//
// It launches as a programmatic dependent (deltatrain/core/dependent_launch.h), like decode's other kernels. Most of
// a narrow product's time at decode's batch sizes is the latency before its first chunks arrive; where the caller
// says the kernel before does not write the weight (StreamGemmCall::weight_settled), the weight's share of the
// first pipeline stages is requested before waiting for that kernel, so that latency passes while it ends.
#include <cooperative_groups.h>

#include "common.cuh"
#include "gdn/cuda/wgmma.cuh"
#include "stream_gemm_plan.h"

namespace deltatrain::model::cuda {
namespace {

namespace cg = cooperative_groups;
namespace tiles = gdn::cuda;  // the GDN kernels' tile primitives: Tile, SwizzledTile, cp.async, ldmatrix, wgmma

constexpr int kStreamThreads = 128;  // one warpgroup: warp w takes features 16 w .. 16 w + 15
using WeightTile = tiles::Tile<bf16, kStreamFeatures, kStreamChunk>;
using RowTile = tiles::SwizzledTile<bf16, kStreamMaxRows, kStreamChunk>;
// A stage: x's chunk first (its swizzled block needs 1024-byte alignment), then the weight's.
constexpr int kStageBytes = RowTile::kBytes + WeightTile::kBytes;
static_assert(kStageBytes % 1024 == 0, "every stage's swizzled block starts 1024-byte aligned");
// Partial sums [rows][features] in float, rows padded so that a warp's stores of one accumulator register (4 rows
// x 8 features) fall in distinct banks. A row group's slice (8 rows) is what one bulk copy sends.
constexpr int kPartialLd = kStreamFeatures + 4;
constexpr int kRowGroups = kStreamMaxRows / 8;
constexpr int kSliceBytes = 8 * kPartialLd * 4;
static_assert(kStreamMaxRows * kPartialLd * 4 <= kStreamStages * kStageBytes, "outgoing slices reuse the pipeline");
static_assert(kSliceBytes % 16 == 0 && (kPartialLd * 4) % 16 == 0, "bulk copies move multiples of 16 bytes");
// The receive buffer, after the pipeline (other CTAs may write it while this one still streams): one slice for each
// (row group this CTA owns, split), kRowGroups in all whatever the split count; then its mbarrier.
constexpr int kReceiveAt = kStreamStages * kStageBytes;
constexpr int kReceivedAt = kReceiveAt + kRowGroups * kSliceBytes;
// Dynamic shared memory is only 16-byte aligned: 1024 bytes of slack to align the first stage.
constexpr int kSharedBytes = kReceivedAt + 8 + 1024;
static_assert(kStreamCtasPerSm * (kSharedBytes + 1024) <= 228 * 1024, "two CTAs per SM");

struct StreamGemmArgs {
  StreamGemmCall call;
  Index chunks;
  Index chunks_per_split;  // the last split may have fewer, or none
};

__global__ void __launch_bounds__(kStreamThreads) stream_gemm_kernel(StreamGemmArgs args) {
#ifdef DELTATRAIN_WGMMA  // sm_90a; prepare_stream_gemm() keeps other devices away
  const StreamGemmCall& a = args.call;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const std::uint32_t raw = tiles::smem_address(smem_raw);
  unsigned char* const smem = smem_raw + ((raw + 1023) / 1024 * 1024 - raw);
  const auto row_tile = [&](int stage) { return RowTile{tiles::smem_address(smem + stage * kStageBytes)}; };
  const auto weight_tile = [&](int stage) {
    return WeightTile{reinterpret_cast<bf16*>(smem + stage * kStageBytes + RowTile::kBytes)};
  };
  const std::uint32_t receive = tiles::smem_address(smem + kReceiveAt), received = tiles::smem_address(smem + kReceivedAt);

  const cg::cluster_group cluster = cg::this_cluster();
  const int splits = static_cast<int>(cluster.num_blocks()), split = static_cast<int>(cluster.block_rank());
  const Index n0 = static_cast<Index>(blockIdx.x / splits) * kStreamFeatures;
  const Index first_chunk = split * args.chunks_per_split;
  const int chunks = static_cast<int>(max(Index{0}, min(args.chunks_per_split, args.chunks - first_chunk)));
  const int warp = threadIdx.x / 32;
  const bf16* const w = static_cast<const bf16*>(a.w);
  const bf16* const x = static_cast<const bf16*>(a.x);
  // Row group j (rows 8 j .. 8 j + 7, those below M) belongs to CTA j % splits, where it is local group j / splits.
  const auto group_rows = [&](int j) { return static_cast<int>(max(Index{0}, min(Index{8}, a.M - 8 * j))); };

  // The mbarrier expects every split's slice of each row group this CTA owns; the relaxed arrive is waited for
  // before the first slice is sent, so that no CTA writes into one that has not set up its mbarrier.
  if (threadIdx.x == 0) {
    int bytes = 0;
    for (int j = split; j < kRowGroups; j += splits) bytes += splits * group_rows(j) * kPartialLd * 4;
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(received) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(received), "r"(bytes) : "memory");
  }
  tiles::cluster_arrive_relaxed();  // no memory ordering: the mbarrier orders what this orders

  // Weight rows past N are zero-filled (cp.async reads nothing for them) from a valid address; so are x's rows
  // past M (load_rows_async).
  const auto load_weight = [&](int stage, Index chunk) {
    const Index k0 = chunk * kStreamChunk;
    const WeightTile tile = weight_tile(stage);
    tiles::for_each_vector<kStreamThreads, WeightTile>(threadIdx.x, [&](int r, int c) {
      const bool valid = n0 + r < a.N;
      tiles::cp_async_16(&tile(r, c), w + (valid ? n0 + r : 0) * a.ldw + k0 + c, valid);
    });
  };
  const auto load_rows = [&](int stage, Index chunk) {
    tiles::load_rows_async<kStreamThreads>(row_tile(stage), x + chunk * kStreamChunk, a.ldx, static_cast<int>(a.M),
                                           threadIdx.x);
  };

  // The first stages' weight before the wait joins the first commit group, which the first chunk waits for: every
  // later chunk's weight is then in its own group or an earlier one.
  if (a.weight_settled)
    for (int s = 0; s < kStreamStages - 1 && s < chunks; ++s) load_weight(s, first_chunk + s);
  start_after_previous_grid();
#pragma unroll
  for (int s = 0; s < kStreamStages - 1; ++s) {
    if (s < chunks) {
      if (!a.weight_settled) load_weight(s, first_chunk + s);
      load_rows(s, first_chunk + s);
    }
    tiles::cp_async_commit();
  }
  float acc[kRowGroups][4] = {};
  for (int i = 0; i < chunks; ++i) {
    tiles::cp_async_wait<kStreamStages - 2>();
    __syncthreads();  // chunk i has landed for every thread, and chunk i - 1's products are done with its stage
    const int ahead = i + kStreamStages - 1;
    if (ahead < chunks) {
      load_weight(ahead % kStreamStages, first_chunk + ahead);
      load_rows(ahead % kStreamStages, first_chunk + ahead);
    }
    tiles::cp_async_commit();
    const int stage = i % kStreamStages;
    std::uint32_t a_fragments[kStreamChunk / 16][4];
#pragma unroll
    for (int k = 0; k < kStreamChunk / 16; ++k)
      tiles::load_a16(a_fragments[k], tiles::plain(weight_tile(stage)), 16 * warp, 16 * k);
    tiles::wgmma_fence();
#pragma unroll
    for (int k = 0; k < kStreamChunk / 16; ++k)
      tiles::wgmma_64x64x16<bf16, false>(acc, a_fragments[k], tiles::k_major(row_tile(stage), 16 * k));
    tiles::wgmma_commit_and_wait();
    tiles::hold(acc);
  }
  tiles::cp_async_wait<0>();
  __syncthreads();  // the pipeline's memory becomes this CTA's outgoing slices [row][kPartialLd]

  // Accumulator (mma "C" layout): lane (g, t) holds features 16 warp + g (+ 8) of rows 8 j + 2 t (+ 1).
  float* slices = reinterpret_cast<float*>(smem);
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < kRowGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      slices[(8 * j + 2 * t + (e & 1)) * kPartialLd + 16 * warp + g + (e >> 1) * 8] = acc[j][e];
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the slices, visible to the bulk copies
  __syncthreads();
  tiles::cluster_wait();
  if (const int j = threadIdx.x; j < kRowGroups && group_rows(j) > 0) {
    const auto owner = static_cast<std::uint32_t>(j % splits);
    const std::uint32_t slot = receive + ((j / splits) * splits + split) * kSliceBytes;
    std::uint32_t to, to_barrier;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(to) : "r"(slot), "r"(owner));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(to_barrier) : "r"(received), "r"(owner));
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     to),
                 "r"(tiles::smem_address(slices + 8 * j * kPartialLd)), "r"(group_rows(j) * kPartialLd * 4),
                 "r"(to_barrier)
                 : "memory");
  }
  asm volatile(
      "{\n.reg .pred done;\nwait_for_slices:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
      "@!done bra wait_for_slices;\n}\n" ::"r"(received)
      : "memory");
  // Once every CTA has received its slices, every CTA's outgoing slices have been read: only then may one exit.
  tiles::cluster_arrive_relaxed();

  // This CTA's row groups, each output the splits' sum in split order; a thread takes 4 features of a row.
  const float* const sums_in = reinterpret_cast<const float*>(smem + kReceiveAt);
  const int r = threadIdx.x / 16, f = threadIdx.x % 16 * 4;
  for (int local = 0; local * splits + split < kRowGroups; ++local) {
    const int group = local * splits + split;
    if (r >= group_rows(group)) break;
    float4 sum{0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < splits; ++s) {
      const float4 v = *reinterpret_cast<const float4*>(&sums_in[((local * splits + s) * 8 + r) * kPartialLd + f]);
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    const float sums[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (n0 + f + e >= a.N) break;
      const Index at = (8 * group + r) * a.ldy + n0 + f + e;
      float out = a.alpha * sums[e];
      if (a.beta != 0.f)
        out += a.beta * (a.y_float ? static_cast<const float*>(a.c)[at] : to_float(static_cast<const bf16*>(a.c)[at]));
      if (a.y_float) static_cast<float*>(a.y)[at] = out;
      else static_cast<bf16*>(a.y)[at] = to_bf16(out);
    }
  }
  tiles::cluster_wait();
#endif
}

}  // namespace

bool prepare_stream_gemm() {
  cudaFuncAttributes attributes{};
  cuda_check(cudaFuncGetAttributes(&attributes, stream_gemm_kernel), "cudaFuncGetAttributes (stream_gemm)");
  if (attributes.binaryVersion != 90) return false;
  cuda_check(cudaFuncSetAttribute(stream_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes),
             "cudaFuncSetAttribute (stream_gemm shared memory)");
  return true;
}

void stream_gemm(const StreamGemmPlan& plan, const StreamGemmCall& call, cudaStream_t stream) {
  StreamGemmArgs args{call, call.K / kStreamChunk, 0};
  args.chunks_per_split = (args.chunks + plan.splits - 1) / plan.splits;
  if (args.call.c == nullptr) args.call.c = call.y;
  cudaLaunchAttribute attributes[2];
  cudaLaunchConfig_t config = dependent_launch_config(
      dim3(static_cast<unsigned>(plan.feature_tiles * plan.splits)), dim3(kStreamThreads), kSharedBytes, stream,
      attributes[0]);
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = static_cast<unsigned>(plan.splits);
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  config.attrs = attributes;
  config.numAttrs = 2;
  cuda_check(cudaLaunchKernelEx(&config, stream_gemm_kernel, args), "stream_gemm launch");
}

}  // namespace deltatrain::model::cuda
