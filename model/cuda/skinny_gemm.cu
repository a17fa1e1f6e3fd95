// Products with few rows (skinny_gemm.h): mma.sync m16n8k16 straight from global memory, no shared-memory
// staging. Each lane loads 16 bytes (8 consecutive k) of a row per 32-wide chunk for both operands; since a product
// sums over k in any order, the lane's 8 values become its k positions of two m16n8k16 steps (2t, 2t + 1, 2t + 8,
// 2t + 9 of each, in the fragment layout), the same permutation for x and w, so the 16-byte words feed the
// fragments as loaded.
#include <algorithm>

#include "common.cuh"
#include "gdn/cuda/mma.cuh"
#include "skinny_gemm.h"

namespace deltatrain::model::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 32;  // k a warp covers per step: 4 lanes of a row x 8
constexpr int kFeatureTiles = kSkinnyTileColumns / 8;  // n8 tiles per CTA

struct SkinnyParams {
  const bf16* x;
  const bf16* w;
  bf16* y;
  float* partials;
  Index ldx, ldw, ldy, M, N, K, k_per_split;
};

__device__ __forceinline__ uint4 load16(const bf16* p, bool inside) {
  return inside ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
}

template <int MTiles>
__global__ void __launch_bounds__(kThreads) skinny_gemm_kernel(SkinnyParams p) {
  constexpr int kRows = MTiles * 16;
  __shared__ float sums[kWarps][kRows][kSkinnyTileColumns + 1];  // +1: lanes of rows g, g + 1 in other banks
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const Index n0 = blockIdx.x * kSkinnyTileColumns;
  const Index k_begin = blockIdx.y * p.k_per_split, k_end = min(p.K, k_begin + p.k_per_split);

  // This lane's rows: features n0 + 8j + g of w, rows 16i + g and 16i + g + 8 of x (null past the last).
  const bf16* w_rows[kFeatureTiles];
#pragma unroll
  for (int j = 0; j < kFeatureTiles; ++j) {
    const Index n = n0 + 8 * j + g;
    w_rows[j] = n < p.N ? p.w + n * p.ldw : nullptr;
  }
  const bf16* x_rows[MTiles][2];
#pragma unroll
  for (int i = 0; i < MTiles; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const Index m = 16 * i + 8 * h + g;
      x_rows[i][h] = m < p.M ? p.x + m * p.ldx : nullptr;
    }

  float acc[MTiles][kFeatureTiles][4] = {};
#pragma unroll 2
  for (Index k0 = k_begin + warp * kChunk; k0 < k_end; k0 += kWarps * kChunk) {
    const Index k = k0 + 8 * t;
    const bool k_inside = k < k_end;  // K and the splits' bounds are multiples of 8
    uint4 wv[kFeatureTiles], xv[MTiles][2];
#pragma unroll
    for (int j = 0; j < kFeatureTiles; ++j) wv[j] = load16(w_rows[j] + k, k_inside && w_rows[j] != nullptr);
#pragma unroll
    for (int i = 0; i < MTiles; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) xv[i][h] = load16(x_rows[i][h] + k, k_inside && x_rows[i][h] != nullptr);
#pragma unroll
    for (int i = 0; i < MTiles; ++i) {
      // Step 0 takes the lane's k 0..3 (words x, y), step 1 its k 4..7 (words z, w).
      const std::uint32_t a0[4] = {xv[i][0].x, xv[i][1].x, xv[i][0].y, xv[i][1].y};
      const std::uint32_t a1[4] = {xv[i][0].z, xv[i][1].z, xv[i][0].w, xv[i][1].w};
#pragma unroll
      for (int j = 0; j < kFeatureTiles; ++j) {
        gdn::cuda::mma_16816<bf16>(acc[i][j], a0, wv[j].x, wv[j].y);
        gdn::cuda::mma_16816<bf16>(acc[i][j], a1, wv[j].z, wv[j].w);
      }
    }
  }

  // The four warps' sums added in warp order, then the CTA's [rows, 32] tile written out.
#pragma unroll
  for (int i = 0; i < MTiles; ++i)
#pragma unroll
    for (int j = 0; j < kFeatureTiles; ++j) {
      sums[warp][16 * i + g][8 * j + 2 * t] = acc[i][j][0];
      sums[warp][16 * i + g][8 * j + 2 * t + 1] = acc[i][j][1];
      sums[warp][16 * i + g + 8][8 * j + 2 * t] = acc[i][j][2];
      sums[warp][16 * i + g + 8][8 * j + 2 * t + 1] = acc[i][j][3];
    }
  __syncthreads();
  for (int e = threadIdx.x; e < kRows * kSkinnyTileColumns; e += kThreads) {
    const int m = e / kSkinnyTileColumns, n = e % kSkinnyTileColumns;
    if (m >= p.M || n0 + n >= p.N) continue;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) sum += sums[v][m][n];
    if (gridDim.y == 1) {
      p.y[m * p.ldy + n0 + n] = to_bf16(sum);
    } else {
      p.partials[(blockIdx.y * p.M + m) * p.N + n0 + n] = sum;
    }
  }
}

// y = the splits' partial sums added in split order.
__global__ void skinny_gemm_finish_kernel(SkinnyParams p, Index splits) {
  const Index e = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (e >= p.M * p.N) return;
  const Index m = e / p.N, n = e % p.N;
  float sum = 0.f;
  for (Index s = 0; s < splits; ++s) sum += p.partials[s * p.M * p.N + e];
  p.y[m * p.ldy + n] = to_bf16(sum);
}

Index ceil_div(Index a, Index b) { return (a + b - 1) / b; }

}  // namespace

SkinnyGemmPlan plan_skinny_gemm(const SkinnyGemmProblem& p) {
  SkinnyGemmPlan plan;
  if (!p.plain || !p.aligned16 || p.M < 1 || p.M > kSkinnyRows || p.N < 1 || p.K < 1 || p.multiprocessors < 1)
    return plan;
  plan.use = true;
  plan.tiles = ceil_div(p.N, kSkinnyTileColumns);
  // Two CTAs a multiprocessor (their loads in flight cover the memory latency): K is split only while the
  // feature tiles alone leave multiprocessors without a CTA, and only as far as the workspace holds the partials.
  Index splits = 1;
  if (plan.tiles < p.multiprocessors) {
    splits = std::min(ceil_div(p.K, kSkinnySplitAlign), ceil_div(2 * Index{p.multiprocessors}, plan.tiles));
    const Index bytes_per_split = p.M * p.N * static_cast<Index>(sizeof(float));
    splits = std::max<Index>(1, std::min(splits, static_cast<Index>(p.workspace_bytes) / bytes_per_split));
  }
  plan.k_per_split = ceil_div(ceil_div(p.K, splits), kSkinnySplitAlign) * kSkinnySplitAlign;
  plan.splits = ceil_div(p.K, plan.k_per_split);  // rounding up the extent may leave fewer
  return plan;
}

void skinny_gemm(const SkinnyGemmPlan& plan, Index M, Index N, Index K, const void* x, Index ldx, const void* w,
                 Index ldw, void* y, Index ldy, float* partials, cudaStream_t stream) {
  const SkinnyParams p{static_cast<const bf16*>(x), static_cast<const bf16*>(w), static_cast<bf16*>(y), partials,
                       ldx, ldw, ldy, M, N, K, plan.k_per_split};
  const dim3 grid(static_cast<unsigned>(plan.tiles), static_cast<unsigned>(plan.splits));
  switch (ceil_div(M, 16)) {
    case 1: skinny_gemm_kernel<1><<<grid, kThreads, 0, stream>>>(p); break;
    case 2: skinny_gemm_kernel<2><<<grid, kThreads, 0, stream>>>(p); break;
    case 3: skinny_gemm_kernel<3><<<grid, kThreads, 0, stream>>>(p); break;
    default: skinny_gemm_kernel<4><<<grid, kThreads, 0, stream>>>(p); break;
  }
  check_launch("skinny_gemm");
  if (plan.splits > 1) {
    skinny_gemm_finish_kernel<<<grid_for(M * N, 256), 256, 0, stream>>>(p, plan.splits);
    check_launch("skinny_gemm (splits)");
  }
}

}  // namespace deltatrain::model::cuda
