// Products with few rows: y [M, N] = x [M, K] w^T for w [N, K] (a linear layer's forward) with M at most
// kSkinnyRows, decode's products (M = the batch). cuBLASLt reaches 0.5-1.9 TB/s of the weights there (one small
// tile grid per product, split-K reductions on top; bench/NOTES.md, Rollout); these stream each weight once
// through tensor cores with every CTA busy: a CTA computes 32 output features for all M rows, its four warps
// taking interleaved 32-wide K chunks; when the feature tiles alone would leave multiprocessors idle, the K range
// is split across CTAs too and a second kernel adds the splits' float32 partial sums in order (deterministic).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "kernels.h"

namespace deltatrain::model::cuda {

constexpr Index kSkinnyRows = 64;         // four m16 tiles
constexpr Index kSkinnyTileColumns = 32;  // output features per CTA
constexpr Index kSkinnySplitAlign = 128;  // a split's K extent: a multiple of the CTA's four warps' 32-wide chunks

// How a product runs: through skinny_gemm (use) with `splits` K ranges of k_per_split each, or through cuBLASLt.
struct SkinnyGemmPlan {
  bool use = false;
  Index tiles = 0;        // ceil(N / kSkinnyTileColumns)
  Index splits = 1;       // K ranges, each its own CTAs; > 1 needs splits * M * N floats of workspace
  Index k_per_split = 0;  // a multiple of kSkinnySplitAlign
};

// The facts the choice depends on. aligned16: x, w and y start on 16 bytes, and K, ldx, ldw are multiples of 8
// (each lane loads 8 consecutive k of a row). The kernel takes alpha 1, beta 0, bfloat16 y, and is not used for
// row-invariant products (whose sums must not depend on M: cuBLASLt's fixed algorithm serves those).
struct SkinnyGemmProblem {
  Index M = 0, N = 0, K = 0;
  bool aligned16 = false, plain = false;  // plain: y = x w^T exactly (alpha 1, beta 0, bf16 y, not row-invariant)
  int multiprocessors = 0;
  std::size_t workspace_bytes = 0;  // for the splits' partial sums
};
SkinnyGemmPlan plan_skinny_gemm(const SkinnyGemmProblem& problem);

// Runs a plan: partials holds plan.splits * M * N floats when plan.splits > 1 (else unused).
void skinny_gemm(const SkinnyGemmPlan& plan, Index M, Index N, Index K, const void* x, Index ldx, const void* w,
                 Index ldw, void* y, Index ldy, float* partials, cudaStream_t stream);

}  // namespace deltatrain::model::cuda
