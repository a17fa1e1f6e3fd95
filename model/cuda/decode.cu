// The inference ops that move rows into and out of cache slots and read the attention cache: copy_rows (bytes of
// any dtype, in the widest accesses the addresses allow) and cached_attention (one CTA per new query row and
// block of query heads sharing a key/value head, its warps taking the cached keys in turn with an online softmax,
// merged in warp order so that the result does not depend on timing). The same kernels over a packed batch's own
// keys (row_attention) are the batch-invariant model's attention forward: a row's output depends only on its query
// and its keys, computed as decode computes it.
#include <string>

#include "attention_plan.h"
#include "common.cuh"
#include "deltatrain/core/error.h"
#include "gdn/cuda/mma.cuh"

namespace deltatrain::model::cuda {
namespace {

namespace tiles = gdn::cuda;  // the GDN kernels' tile primitives: cp.async

// ---------------------------------------------------------------------------------------------------------
// copy_rows: one thread per access unit of a row (16 bytes where rows and addresses allow).

template <class Unit>
__global__ void copy_rows_kernel(Unit* dst, Index dst_ld, const std::int32_t* dst_rows, const Unit* src,
                                 Index src_ld, const std::int32_t* src_rows, Index count, Index units) {
  const Index index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index >= count * units) return;
  const Index i = index / units, u = index % units;
  dst[dst_rows[i] * dst_ld + u] = src[src_rows[i] * src_ld + u];
}

template <class Unit>
void launch_copy_rows(Matrix dst, const std::int32_t* dst_rows, Matrix src, const std::int32_t* src_rows,
                      Index count, std::size_t element_size, cudaStream_t stream) {
  const auto units = [&](Index elements) { return static_cast<Index>(elements * element_size / sizeof(Unit)); };
  const Index per_row = units(dst.cols);
  copy_rows_kernel<Unit><<<grid_for(count * per_row, 256), 256, 0, stream>>>(
      static_cast<Unit*>(dst.data), units(dst.ld), dst_rows, static_cast<const Unit*>(src.data), units(src.ld),
      src_rows, count, per_row);
  check_launch("copy_rows");
}

// ---------------------------------------------------------------------------------------------------------
// attention_inputs_step: one CTA per batch row, one warp per head (the queries', whose warps also move the gates,
// then the keys', whose warps also move the values), lane l holding the head's elements [8 l, 8 l + 8). The norm
// and the rotation are common.cuh's, as rmsnorm_forward's and rope's kernels compute them, and a warp's sum of
// squares is theirs: a 16-lane row's sum (head dims up to 128) is the same with lanes 16-31 adding zeros first. So
// the results are those kernels' bits.
// The row's rotations are computed once, a pair a thread, into shared memory: a lane working out its 8 pairs itself
// (powf, cosf, sinf in a chain) made the kernel 7.2 us for 64 rows on the H200.

constexpr int kMaxRotaryPairs = 128;  // rotary_dim <= head_dim <= 256

__global__ void attention_inputs_step_kernel(AttentionInputsStep p) {
  start_after_previous_grid();
  const Index i = blockIdx.x, t = p.batch_rows[i];
  const int half = p.rotary_dim / 2, shift = half / kVector;  // RoPE's pair (e, e + half) lies `shift` lanes apart
  __shared__ Rotation rotations[kMaxRotaryPairs];
  for (int pair = static_cast<int>(threadIdx.x); pair < half; pair += static_cast<int>(blockDim.x))
    rotations[pair] = rope_rotation(pair, p.rotary_dim, p.theta, p.positions[t], false);
  __syncthreads();
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const bool query = warp < p.q_heads;
  const int h = query ? warp : warp - p.q_heads, D = p.head_dim, c0 = lane * kVector;
  const bool holds = c0 < D;
  const bf16* x = query ? row_of<const bf16>(p.qg, t) + Index{h} * 2 * D : row_of<const bf16>(p.k_raw, t) + Index{h} * D;
  float v[kVector] = {}, gain[kVector] = {};
  if (holds) {
    load8<true>(x, c0, D, v);
    load8<true>(static_cast<const bf16*>(query ? p.q_norm : p.k_norm), c0, D, gain);
  }
  const float s = rms_scale(warp_sum(add_squares(0.f, v)), D, p.eps);
  if (lane == 0) (query ? p.q_rstd : p.k_rstd)[t * (query ? p.q_heads : p.kv_heads) + h] = s;
  float y[kVector];
#pragma unroll
  for (int k = 0; k < kVector; ++k) y[k] = to_float(to_bf16(normed(v[k], s, gain[k], true)));  // as the norm stores it
  float partner[kVector];
#pragma unroll
  for (int k = 0; k < kVector; ++k) partner[k] = __shfl_sync(0xffffffffu, y[k], lane < shift ? lane + shift : lane - shift);
  if (lane < 2 * shift) {
    const bool first = lane < shift;
#pragma unroll
    for (int k = 0; k < kVector; ++k) {
      const Rotation r = rotations[first ? c0 + k : c0 + k - half];
      y[k] = first ? rotate(y[k], partner[k], r).x : rotate(partner[k], y[k], r).y;
    }
  }
  if (!holds) return;
  const Index column = Index{h} * D + c0;
  if (query) {
    store8<true>(row_of<bf16>(p.q, t), column, p.q.cols, y);
    *reinterpret_cast<uint4*>(row_of<bf16>(p.gate, t) + column) = *reinterpret_cast<const uint4*>(x + D + c0);
    return;
  }
  const Index cache_row = p.cache_rows[i];
  store8<true>(row_of<bf16>(p.k, t), column, p.k.cols, y);
  store8<true>(row_of<bf16>(p.k_cache, cache_row), column, p.k_cache.cols, y);
  *reinterpret_cast<uint4*>(row_of<bf16>(p.v_cache, cache_row) + column) =
      *reinterpret_cast<const uint4*>(row_of<const bf16>(p.v, t) + column);
}

// ---------------------------------------------------------------------------------------------------------
// cached_attention. One CTA per query row and block of `Heads` query heads of one GQA group (attention_plan.h's
// plan_cached_attention): the heads of a group share their key/value head, so the CTA reads each cached row once
// for all of them. Its kAttentionWarps warps take the keys in turn (key u to warp u mod kAttentionWarps); each warp
// copies its next kStages keys and values into its own ring in shared memory (cp.async) ahead of their use, so that
// about 128 KB a CTA are in flight and the kernel runs near the cache's bandwidth, where the first form (a warp a
// key, its loads two keys ahead, a CTA per head) waited on one load after another: 51 us a layer at batch 64 and
// 512 positions on the H200, ~0.7 TB/s. Lane l holds the head's elements [c * 256 + 8 l, c * 256 + 8 l + 8) for each
// of Chunks chunks of 256 (q scaled, and its share of the output), so a score is one warp sum. Which keys a warp
// takes and the order of every sum depend only on the row's position: a row's result is the same in any batch.

constexpr int kAttentionWarps = 16;
constexpr int kChunk = 32 * kVector;  // head elements one warp covers in one access
// Keys in flight per warp: 8 KB of keys and values at head dims up to 256, at most 16 KB at 512.
template <int Chunks>
constexpr int kAttentionStages = Chunks == 1 ? 8 : 4;

struct CachedAttention {
  Matrix o, q, k, v;  // k and v: the caches' S * slot_rows rows, or (slots null) the packed rows of q's sequences
  Index slot_rows;
  int group, head_dim;
  float scale;
  Sequences seq;
  const std::int32_t* slots;    // null: sequence n's keys are rows [cu[n], cu[n + 1]) of k and v, row t sees up to t
  const std::int32_t* lengths;
  float* lse;  // null, or [Hq, R] with row stride lse_ld: each row's log-sum-exp of its scaled scores
  Index lse_ld;
};

// A cached row's stride in shared memory: whole 16-byte vectors (zeros past head_dim).
__host__ __device__ constexpr int padded_head_dim(int head_dim) { return (head_dim + kVector - 1) / kVector * kVector; }

// The shared memory of a CTA: the warps' rings of (key, value) rows, which the warps' partial outputs
// [warp][head][padded_head_dim] in float reuse once the keys are done.
template <int Chunks, int Heads>
constexpr std::size_t cached_attention_shared_bytes(int head_dim) {
  const std::size_t rows = padded_head_dim(head_dim);
  return std::max(kAttentionWarps * kAttentionStages<Chunks> * 2 * rows * sizeof(bf16),
                  kAttentionWarps * Heads * rows * sizeof(float));
}

// Where query row t's keys are: its position (the last key it sees), the row of its sequence's first key in k and
// v, and the column of the key/value head serving query heads from h0. Both kernels take the keys from here.
struct RowKeys {
  Index position, base, kv_column;
};
__device__ __forceinline__ RowKeys row_keys(const CachedAttention& a, Index t, int h0) {
  const int n = sequence_of(a.seq, t);
  const Index first = a.seq.cu[n], news = a.seq.cu[n + 1] - first;
  return {a.slots != nullptr ? a.lengths[n] - news + (t - first) : t - first,
          a.slots != nullptr ? static_cast<Index>(a.slots[n]) * a.slot_rows : first,
          static_cast<Index>(h0 / a.group) * a.head_dim};
}

// The elements of one head row this lane holds (zeros past head_dim).
template <bool Vectorized, int Chunks>
__device__ __forceinline__ void load_head(const bf16* row, int head_dim, int lane, float (&v)[Chunks][kVector]) {
#pragma unroll
  for (int c = 0; c < Chunks; ++c) {
    const int d0 = c * kChunk + lane * kVector;
    if (d0 < head_dim) {
      load8<Vectorized>(row, d0, head_dim, v[c]);
    } else {
#pragma unroll
      for (int e = 0; e < kVector; ++e) v[c][e] = 0.f;
    }
  }
}

// One key's row and value's row (head_dim elements at k_row and v_row) into a ring slot [2][padded_head_dim] by
// the warp's lanes: 16-byte asynchronous copies where rows allow, else element by element (zeros in the padding).
template <bool Vectorized>
__device__ __forceinline__ void copy_key_value(bf16* slot, const bf16* k_row, const bf16* v_row, int head_dim,
                                               int lane) {
  const int rows = padded_head_dim(head_dim);
  if constexpr (Vectorized) {
    const int vectors = rows / kVector;
    for (int i = lane; i < 2 * vectors; i += 32) {
      const bool value = i >= vectors;
      const int d = (value ? i - vectors : i) * kVector;
      tiles::cp_async_16(slot + (value ? rows : 0) + d, (value ? v_row : k_row) + d, true);
    }
  } else {
    for (int i = lane; i < 2 * rows; i += 32) {
      const bool value = i >= rows;
      const int d = value ? i - rows : i;
      slot[i] = d < head_dim ? (value ? v_row : k_row)[d] : to_bf16(0.f);
    }
  }
  tiles::cp_async_commit();  // an empty group on the element path: the waits count the same either way
}

// The CTA's outputs (and lse) for its heads h < heads: each warp's partial softmax (its max and sum per head, in
// base 2 or e as the kernel computed them, and its unnormalised output partial[(warp * kMaxHeads + h) * ld + d])
// merged in warp order, so that the result does not depend on timing. Warp 0 always has key 0, so each head's
// overall max is finite; a warp without keys has max -inf and weighs 0.
template <bool Base2, int kWarps, int kMaxHeads>
__device__ void write_merged(const CachedAttention& a, Index t, int h0, int heads,
                             const float (&maxes)[kWarps][kMaxHeads], const float (&sums)[kWarps][kMaxHeads],
                             const float* partial, int ld) {
  const int D = a.head_dim;
  for (int i = threadIdx.x; i < heads * D; i += blockDim.x) {
    const int h = i / D, d = i % D;
    float overall = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) overall = fmaxf(overall, maxes[w][h]);
    float value = 0.f, total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = Base2 ? exp2f(maxes[w][h] - overall) : expf(maxes[w][h] - overall);
      total += sums[w][h] * weight;
      value += partial[(w * kMaxHeads + h) * ld + d] * weight;
    }
    row_of<bf16>(a.o, t)[static_cast<Index>(h0 + h) * D + d] = to_bf16(value / total);
    if (a.lse != nullptr && d == 0) {
      a.lse[(h0 + h) * a.lse_ld + t] = Base2 ? (overall + log2f(total)) / kLog2e : overall + logf(total);
    }
  }
}

template <bool Vectorized, int Chunks, int Heads>
__global__ void __launch_bounds__(kAttentionWarps * 32, 1) cached_attention_kernel(CachedAttention a) {
  start_after_previous_grid();
  constexpr int kStages = kAttentionStages<Chunks>;
  extern __shared__ __align__(16) unsigned char attention_smem[];
  const Index t = blockIdx.x;
  const int h0 = static_cast<int>(blockIdx.y) * Heads, D = a.head_dim, rows = padded_head_dim(D);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const RowKeys row = row_keys(a, t, h0);
  const Index position = row.position, base = row.base, kv_column = row.kv_column;

  // This warp's keys are u = warp + j kAttentionWarps for j < mine; key j waits in slot j mod kStages.
  bf16* const ring = reinterpret_cast<bf16*>(attention_smem) + warp * kStages * 2 * rows;
  const Index mine = warp <= position ? (position - warp) / kAttentionWarps + 1 : 0;
  const auto fetch = [&](Index j) {
    if (j < mine) {
      const Index u = base + warp + j * kAttentionWarps;
      copy_key_value<Vectorized>(ring + (j % kStages) * 2 * rows, row_of<const bf16>(a.k, u) + kv_column,
                                 row_of<const bf16>(a.v, u) + kv_column, D, lane);
    } else {
      tiles::cp_async_commit();  // one group per key index, so that a wait counts keys
    }
  };
#pragma unroll
  for (int j = 0; j < kStages; ++j) fetch(j);

  float q[Heads][Chunks][kVector];
#pragma unroll
  for (int h = 0; h < Heads; ++h) {
    load_head<Vectorized>(row_of<const bf16>(a.q, t) + static_cast<Index>(h0 + h) * D, D, lane, q[h]);
#pragma unroll
    for (int c = 0; c < Chunks; ++c)
#pragma unroll
      for (int e = 0; e < kVector; ++e) q[h][c][e] *= a.scale;
  }

  // Per head: running max, sum of exp(score - max), and sum of exp(score - max) v.
  float max[Heads], sum[Heads], acc[Heads][Chunks][kVector] = {};
#pragma unroll
  for (int h = 0; h < Heads; ++h) {
    max[h] = -INFINITY;
    sum[h] = 0.f;
  }
  for (Index j = 0; j < mine; ++j) {
    tiles::cp_async_wait<kStages - 1>();  // this lane's copies of key j are done
    __syncwarp();                          // and so are the other lanes'
    const bf16* slot = ring + (j % kStages) * 2 * rows;
    float k[Chunks][kVector], v[Chunks][kVector];
    load_head<true>(slot, rows, lane, k);
    load_head<true>(slot + rows, rows, lane, v);
    __syncwarp();  // every lane has read the slot before it is refilled
    fetch(j + kStages);
    float score[Heads];
#pragma unroll
    for (int h = 0; h < Heads; ++h) {
      score[h] = 0.f;
#pragma unroll
      for (int c = 0; c < Chunks; ++c)
#pragma unroll
        for (int e = 0; e < kVector; ++e) score[h] += q[h][c][e] * k[c][e];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
#pragma unroll
      for (int h = 0; h < Heads; ++h) score[h] += __shfl_xor_sync(0xffffffffu, score[h], offset);
#pragma unroll
    for (int h = 0; h < Heads; ++h) {
      // Rescale what came before only when the max grows (the score is the same in every lane, so the branch is
      // uniform; past the first keys it is rarely taken, and the common step is one exponential and one FMA an
      // element). exp(-inf) = 0 for the first key.
      if (score[h] > max[h]) {
        const float old_weight = expf(max[h] - score[h]);
        max[h] = score[h];
        sum[h] *= old_weight;
#pragma unroll
        for (int c = 0; c < Chunks; ++c)
#pragma unroll
          for (int e = 0; e < kVector; ++e) acc[h][c][e] *= old_weight;
      }
      const float p = expf(score[h] - max[h]);
      sum[h] += p;
#pragma unroll
      for (int c = 0; c < Chunks; ++c)
#pragma unroll
        for (int e = 0; e < kVector; ++e) acc[h][c][e] = fmaf(p, v[c][e], acc[h][c][e]);
    }
  }
  tiles::cp_async_wait<0>();
  __syncthreads();  // the rings become the partial outputs

  // The warps' partial softmaxes, for write_merged.
  __shared__ float maxes[kAttentionWarps][Heads], sums[kAttentionWarps][Heads];
  float* const partial = reinterpret_cast<float*>(attention_smem);  // [warp][head][rows]
#pragma unroll
  for (int h = 0; h < Heads; ++h) {
    if (lane == 0) {
      maxes[warp][h] = max[h];
      sums[warp][h] = sum[h];
    }
#pragma unroll
    for (int c = 0; c < Chunks; ++c)
#pragma unroll
      for (int e = 0; e < kVector; ++e) {
        const int d = c * kChunk + lane * kVector + e;
        if (d < D) partial[(warp * Heads + h) * rows + d] = acc[h][c][e];
      }
  }
  __syncthreads();
  write_merged<false>(a, t, h0, Heads, maxes, sums, partial, rows);
}

// The shared memory a launch at head_dim needs, or Unavailable naming the kernel.
void require_attention_shared_memory(std::size_t bytes, int head_dim) {
  if (bytes > 48 * 1024) {
    require_shared_memory("cached_attention", bytes, "keys and values at head dim " + std::to_string(head_dim));
  }
}

template <bool Vectorized, int Chunks, int Heads>
void launch_cached_attention(const CachedAttention& a, int q_heads, cudaStream_t stream) {
  const std::size_t shared = cached_attention_shared_bytes<Chunks, Heads>(a.head_dim);
  require_attention_shared_memory(shared, a.head_dim);
  const dim3 grid(static_cast<unsigned>(a.q.rows), static_cast<unsigned>(q_heads / Heads));
  launch_after_previous("cached_attention", cached_attention_kernel<Vectorized, Chunks, Heads>, grid,
                        kAttentionWarps * 32, shared, stream, a);
}

// Calls f.template operator()<Vectorized, Chunks, Heads>() for every kernel instance: the one a call takes, or all
// of them (to prepare their shared-memory limits).
template <class F>
void for_each_cached_attention_kernel(F&& f) {
  const auto chunks = [&]<bool Vectorized>() {
    f.template operator()<Vectorized, 1, 1>();
    f.template operator()<Vectorized, 1, 2>();
    f.template operator()<Vectorized, 1, 4>();
    f.template operator()<Vectorized, 2, 1>();
    f.template operator()<Vectorized, 2, 2>();
  };
  chunks.template operator()<true>();
  chunks.template operator()<false>();
}

// ---------------------------------------------------------------------------------------------------------
// cached_attention on tensor cores (attention_plan.h: head dims 64, 128, 256 with 16-byte aligned rows). One CTA
// per query row and block of up to 8 query heads of one GQA group; warp w takes the blocks of kMmaKeys keys w,
// w + kMmaWarps, ... through its own two-stage cp.async ring of the block's key and value rows. Per block it forms
// S^T = K Q^T with mma m16n8k16 (the 16 keys as M, the heads as N, the head dim as K), updates each head's online
// softmax in base 2, and adds V^T P^T into O^T (the head dim as M). With the keys as M no operand needs a transpose
// through shared memory: Q^T's fragments stay in registers, V^T's come from ldmatrix.trans, and P^T's are gathered
// from S^T's accumulators by eight shuffles. A key then costs about a tenth of the warp kernel's ~230 instructions
// (four dot products, twenty shuffles and the value row's FMAs on CUDA cores), which bound that kernel at ~1.5
// instructions a cycle (bench/NOTES.md, Rollout). As there, the blocks a warp takes and every sum's order depend
// only on the row's position.

constexpr int kMmaWarps = 4;
constexpr int kMmaKeys = 16;  // keys a warp takes at a time: M of the products
constexpr int kMmaHeads = 8;  // N of the products
constexpr int kMmaStages = 2;

template <int D>
using KeyTile = tiles::Tile<bf16, kMmaKeys, D>;
template <int D>
constexpr int kMmaStageBytes = 2 * KeyTile<D>::kBytes;  // the block's keys, then its values
template <int D>
constexpr int kMmaSharedBytes = std::max(kMmaWarps * kMmaStages * kMmaStageBytes<D>,
                                         kMmaWarps * kMmaHeads * D * static_cast<int>(sizeof(float)));

template <int D>
__global__ void __launch_bounds__(kMmaWarps * 32, 1) cached_attention_mma_kernel(CachedAttention a, int heads) {
  start_after_previous_grid();
  constexpr int kSteps = D / 16;       // 16-wide steps of the head dim: K of S^T's product, M tiles of O^T's
  constexpr int kVectors = D / kVector;  // 16-byte vectors a row
  extern __shared__ __align__(16) unsigned char attention_smem[];
  const Index t = blockIdx.x;
  const int h0 = static_cast<int>(blockIdx.y) * heads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, quad = lane % 4;
  const RowKeys row = row_keys(a, t, h0);
  const Index position = row.position, base = row.base, kv_column = row.kv_column;

  // This warp's key blocks b = warp + j kMmaWarps (keys 16 b ..) for j < mine; block j waits in stage j mod kMmaStages.
  unsigned char* const ring = attention_smem + warp * kMmaStages * kMmaStageBytes<D>;
  const auto key_tile = [&](Index j) {
    return KeyTile<D>{reinterpret_cast<bf16*>(ring + (j % kMmaStages) * kMmaStageBytes<D>)};
  };
  const auto value_tile = [&](Index j) {
    return KeyTile<D>{reinterpret_cast<bf16*>(ring + (j % kMmaStages) * kMmaStageBytes<D> + KeyTile<D>::kBytes)};
  };
  const Index blocks = position / kMmaKeys + 1;
  const Index mine = warp < blocks ? (blocks - 1 - warp) / kMmaWarps + 1 : 0;
  const auto fetch = [&](Index j) {
    if (j < mine) {
      const Index key0 = (warp + j * kMmaWarps) * kMmaKeys;
      const KeyTile<D> keys = key_tile(j), values = value_tile(j);
      for (int i = lane; i < 2 * kMmaKeys * kVectors; i += 32) {
        const bool value = i >= kMmaKeys * kVectors;
        const int r = i % (kMmaKeys * kVectors) / kVectors, c = i % kVectors * kVector;
        const bool valid = key0 + r <= position;  // keys past the row's are zero-filled, and masked below
        const Index row = base + (valid ? key0 + r : 0);
        const bf16* src = row_of<const bf16>(value ? a.v : a.k, row) + kv_column + c;
        tiles::cp_async_16(&(value ? values : keys)(r, c), src, valid);
      }
    }
    tiles::cp_async_commit();  // one group per block index, so that a wait counts blocks
  };
#pragma unroll
  for (int j = 0; j < kMmaStages; ++j) fetch(j);

  // Q^T's B fragments: head g's elements 16 s + 2 quad (+1) and + 8 (+9) of every step; zeros past the heads.
  std::uint32_t q[kSteps][2];
  const bf16* q_row = row_of<const bf16>(a.q, t) + static_cast<Index>(h0 + g) * D;
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      q[s][half] = g < heads ? *reinterpret_cast<const std::uint32_t*>(q_row + 16 * s + 2 * quad + 8 * half) : 0u;

  // O^T's accumulators (dims 16 s + g (+8), heads 2 quad (+1)); per head this lane holds: the running max of the
  // scores in base 2, and its keys' share of the sum of 2^(score - max).
  float o[kSteps][4] = {}, running[2] = {-INFINITY, -INFINITY}, sum[2] = {0.f, 0.f};
  const float scale = a.scale * kLog2e;
  for (Index j = 0; j < mine; ++j) {
    tiles::cp_async_wait<kMmaStages - 1>();
    __syncwarp();
    const KeyTile<D> keys = key_tile(j), values = value_tile(j);
    float s[4] = {};  // S^T: keys g (s[0], s[1]) and g + 8 (s[2], s[3]), heads 2 quad and 2 quad + 1
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      std::uint32_t k_fragment[4];
      tiles::load_a16(k_fragment, tiles::plain(keys), 0, 16 * step);
      tiles::mma_16816<bf16>(s, k_fragment, q[step][0], q[step][1]);
    }
    const Index key0 = (warp + j * kMmaWarps) * kMmaKeys;
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] = key0 + g + (e / 2) * 8 <= position ? s[e] * scale : -INFINITY;
    float block_max[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        block_max[c] = fmaxf(block_max[c], __shfl_xor_sync(0xffffffffu, block_max[c], offset));
      }
    float p[4], old_weight[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float updated = fmaxf(running[c], block_max[c]);  // finite: the block holds one of the row's keys
      old_weight[c] = exp2f(running[c] - updated);
      running[c] = updated;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) p[e] = exp2f(s[e] - running[e % 2]);
#pragma unroll
    for (int c = 0; c < 2; ++c) sum[c] = sum[c] * old_weight[c] + p[c] + p[c + 2];
#pragma unroll
    for (int step = 0; step < kSteps; ++step)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[step][e] *= old_weight[e % 2];

    // P^T's B fragment: this lane needs P[key 2 quad (+1)][head g] and P[key 2 quad + 8 (+9)][head g], which lanes
    // 8 quad + g / 2 and 8 quad + 4 + g / 2 hold (for head g's parity: p[0] / p[1], keys + 8: p[2] / p[3]).
    float low[4], high[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      low[e] = __shfl_sync(0xffffffffu, p[e], 8 * quad + g / 2);
      high[e] = __shfl_sync(0xffffffffu, p[e], 8 * quad + 4 + g / 2);
    }
    const bool odd = g % 2 != 0;  // (selects, not indexing by it: that would put the arrays in local memory)
    const std::uint32_t p0 = tiles::pack2<bf16>(odd ? low[1] : low[0], odd ? high[1] : high[0]);
    const std::uint32_t p1 = tiles::pack2<bf16>(odd ? low[3] : low[2], odd ? high[3] : high[2]);
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      std::uint32_t v_fragment[4];
      tiles::load_a16(v_fragment, tiles::transposed(values), 16 * step, 0);
      tiles::mma_16816<bf16>(o[step], v_fragment, p0, p1);
    }
    __syncwarp();  // every lane is done with the stage before it is refilled
    fetch(j + kMmaStages);
  }
  tiles::cp_async_wait<0>();
#pragma unroll
  for (int offset = 4; offset < 32; offset *= 2)
#pragma unroll
    for (int c = 0; c < 2; ++c) sum[c] += __shfl_xor_sync(0xffffffffu, sum[c], offset);
  __syncthreads();  // the rings become the partial outputs

  // The warps' partial softmaxes, for write_merged.
  __shared__ float maxes[kMmaWarps][kMmaHeads], sums[kMmaWarps][kMmaHeads];
  float* const partial = reinterpret_cast<float*>(attention_smem);  // [warp][head][D]
  if (g == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      maxes[warp][2 * quad + c] = running[c];
      sums[warp][2 * quad + c] = sum[c];
    }
  }
#pragma unroll
  for (int step = 0; step < kSteps; ++step)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      partial[(warp * kMmaHeads + 2 * quad + e % 2) * D + 16 * step + g + (e / 2) * 8] = o[step][e];
  __syncthreads();
  write_merged<true>(a, t, h0, heads, maxes, sums, partial, D);
}

template <int D>
void launch_cached_attention_mma(const CachedAttention& a, int q_heads, int heads, cudaStream_t stream) {
  require_attention_shared_memory(kMmaSharedBytes<D>, D);
  const dim3 grid(static_cast<unsigned>(a.q.rows), static_cast<unsigned>(q_heads / heads));
  launch_after_previous("cached_attention", cached_attention_mma_kernel<D>, grid, kMmaWarps * 32, kMmaSharedBytes<D>,
                        stream, a, heads);
}

// Calls f.template operator()<D>() for every head dim the tensor-core kernel is built for.
template <class F>
void for_each_mma_head_dim(F&& f) {
  f.template operator()<64>();
  f.template operator()<128>();
  f.template operator()<256>();
}

// 16-byte accesses need every head to start on 16 bytes: whole groups of 8 elements and aligned rows.
void launch_cached_attention(const CachedAttention& a, int q_heads, cudaStream_t stream) {
  if (a.q.rows == 0) return;
  const bool vectorized =
      a.head_dim % kVector == 0 && vectorizable(a.o) && vectorizable(a.q) && vectorizable(a.k) && vectorizable(a.v);
  const CachedAttentionPlan plan = plan_cached_attention(a.group, a.head_dim, vectorized);
  bool launched = false;
  if (plan.tensor_cores) {
    for_each_mma_head_dim([&]<int D>() {
      if (D == a.head_dim) {
        launch_cached_attention_mma<D>(a, q_heads, plan.heads, stream);
        launched = true;
      }
    });
  } else {
    const int chunks = a.head_dim <= kChunk ? 1 : 2;
    static_assert(kMaxCachedHeadDim == 2 * kChunk, "one kernel per number of chunks up to the maximum");
    for_each_cached_attention_kernel([&]<bool Vectorized, int Chunks, int Heads>() {
      if (Vectorized == vectorized && Chunks == chunks && Heads == plan.heads) {
        launch_cached_attention<Vectorized, Chunks, Heads>(a, q_heads, stream);
        launched = true;
      }
    });
  }
  if (!launched) throw Failure("cached_attention: no kernel for the plan of head dim " + std::to_string(a.head_dim));
}

}  // namespace

void prepare_cached_attention() {
  const int most = shared_memory_per_block();
  for_each_mma_head_dim([&]<int D>() {
    cuda_check(cudaFuncSetAttribute(cached_attention_mma_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    std::min(kMmaSharedBytes<D>, most)),
               "cudaFuncSetAttribute (cached_attention shared memory)");
  });
  for_each_cached_attention_kernel([&]<bool Vectorized, int Chunks, int Heads>() {
    // The most the instance takes (at its widest head dim), or what the device allows (launches that need more
    // are refused by name).
    const std::size_t bytes = cached_attention_shared_bytes<Chunks, Heads>(Chunks * kChunk);
    cuda_check(cudaFuncSetAttribute(cached_attention_kernel<Vectorized, Chunks, Heads>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(std::min<std::size_t>(bytes, most))),
               "cudaFuncSetAttribute (cached_attention shared memory)");
  });
}

void copy_rows(Matrix dst, const std::int32_t* dst_rows, Matrix src, const std::int32_t* src_rows, Index count,
               std::size_t element_size, cudaStream_t stream) {
  if (count == 0 || dst.cols == 0) return;
  // The widest unit that divides every row's start and length on both sides.
  std::size_t alignment = 16;
  for (const std::size_t quantity :
       {reinterpret_cast<std::uintptr_t>(dst.data), reinterpret_cast<std::uintptr_t>(src.data),
        static_cast<std::uintptr_t>(dst.cols * element_size), static_cast<std::uintptr_t>(dst.ld * element_size),
        static_cast<std::uintptr_t>(src.ld * element_size)})
    while (quantity % alignment != 0) alignment /= 2;
  switch (alignment) {
    case 16: return launch_copy_rows<uint4>(dst, dst_rows, src, src_rows, count, element_size, stream);
    case 8: return launch_copy_rows<uint2>(dst, dst_rows, src, src_rows, count, element_size, stream);
    case 4: return launch_copy_rows<std::uint32_t>(dst, dst_rows, src, src_rows, count, element_size, stream);
    case 2: return launch_copy_rows<std::uint16_t>(dst, dst_rows, src, src_rows, count, element_size, stream);
    default: return launch_copy_rows<std::uint8_t>(dst, dst_rows, src, src_rows, count, element_size, stream);
  }
}

void attention_inputs_step(const AttentionInputsStep& p, Index rows, cudaStream_t stream) {
  if (rows == 0) return;
  launch_after_previous("attention_inputs_step", attention_inputs_step_kernel, static_cast<unsigned>(rows),
                        (p.q_heads + p.kv_heads) * 32, 0, stream, p);
}

void cached_attention(Matrix o, Matrix q, Matrix k_cache, Matrix v_cache, Index slot_rows, int q_heads, int kv_heads,
                      int head_dim, float scale, Sequences sequences, const std::int32_t* slots,
                      const std::int32_t* lengths, cudaStream_t stream) {
  launch_cached_attention({o, q, k_cache, v_cache, slot_rows, q_heads / kv_heads, head_dim, scale, sequences, slots,
                           lengths, nullptr, 0},
                          q_heads, stream);
}

void row_attention(Matrix o, Matrix lse, Matrix q, Matrix k, Matrix v, int q_heads, int kv_heads, int head_dim,
                   float scale, Sequences sequences, cudaStream_t stream) {
  launch_cached_attention({o, q, k, v, 0, q_heads / kv_heads, head_dim, scale, sequences, nullptr, nullptr,
                           static_cast<float*>(lse.data), lse.ld},
                          q_heads, stream);
}

}  // namespace deltatrain::model::cuda
