// The inference ops that move rows into and out of cache slots and read the attention cache: copy_rows (bytes of
// any dtype, in the widest accesses the addresses allow) and cached_attention (one CTA per new query row and
// query head, its warps taking the cached keys in turn with an online softmax, merged in warp order so that the
// result does not depend on timing). The same kernel over a packed batch's own keys (row_attention) is the
// batch-invariant model's attention forward: a row's output depends only on its query and its keys, computed
// as decode computes it.
#include "common.cuh"

namespace deltatrain::model::cuda {
namespace {

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
// cached_attention. Lane l of a warp holds the head's elements [c * 256 + 8 l, c * 256 + 8 l + 8) for each of
// Chunks chunks of 256 (q scaled, and its share of the output), so a key or value row is one coalesced access
// per warp and chunk, and a score one warp sum.

// Warps of a CTA (one row and head): each walks every kAttentionWarps-th key, its loads two keys ahead, so a decode
// row's few hundred keys are a short chain per warp (4 warps left each a chain of ~40 dependent steps at 150
// keys: 27 us a layer at batch 64 on the H200).
constexpr int kAttentionWarps = 8;
constexpr int kChunk = 32 * kVector;  // head elements one warp covers in one access

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

template <bool Vectorized, int Chunks>
__global__ void __launch_bounds__(kAttentionWarps * 32) cached_attention_kernel(CachedAttention a) {
  const Index t = blockIdx.x;
  const int h = static_cast<int>(blockIdx.y), D = a.head_dim;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int n = sequence_of(a.seq, t);
  const Index first = a.seq.cu[n], news = a.seq.cu[n + 1] - first;
  // This row's position, the last key it sees, and where its sequence's keys start.
  const Index position = a.slots != nullptr ? a.lengths[n] - news + (t - first) : t - first;
  const Index base = a.slots != nullptr ? static_cast<Index>(a.slots[n]) * a.slot_rows : first;
  const Index kv_column = static_cast<Index>(h / a.group) * D;

  float q[Chunks][kVector];
  load_head<Vectorized>(row_of<const bf16>(a.q, t) + static_cast<Index>(h) * D, D, lane, q);
#pragma unroll
  for (int c = 0; c < Chunks; ++c)
#pragma unroll
    for (int e = 0; e < kVector; ++e) q[c][e] *= a.scale;

  // This warp's keys u = warp, warp + kAttentionWarps, ...: running max, sum of exp(score - max), and
  // sum of exp(score - max) v.
  float max = -INFINITY, sum = 0.f, acc[Chunks][kVector] = {};
#pragma unroll 2
  for (Index u = warp; u <= position; u += kAttentionWarps) {
    float k[Chunks][kVector], v[Chunks][kVector];
    load_head<Vectorized>(row_of<const bf16>(a.k, base + u) + kv_column, D, lane, k);
    load_head<Vectorized>(row_of<const bf16>(a.v, base + u) + kv_column, D, lane, v);
    float score = 0.f;
#pragma unroll
    for (int c = 0; c < Chunks; ++c)
#pragma unroll
      for (int e = 0; e < kVector; ++e) score += q[c][e] * k[c][e];
    score = warp_sum(score);
    // Rescale what came before when the max grows (exp(-inf) = 0 for the first key).
    const float old_weight = score > max ? expf(max - score) : 1.f;
    max = fmaxf(max, score);
    const float p = expf(score - max);
    sum = sum * old_weight + p;
#pragma unroll
    for (int c = 0; c < Chunks; ++c)
#pragma unroll
      for (int e = 0; e < kVector; ++e) acc[c][e] = acc[c][e] * old_weight + p * v[c][e];
  }

  // Merge the warps in warp order. Warp 0 always has key 0, so the overall max is finite; a warp without keys
  // has max -inf and weighs 0.
  __shared__ float maxes[kAttentionWarps], sums[kAttentionWarps];
  __shared__ float accs[kAttentionWarps][kMaxCachedHeadDim];
  if (lane == 0) {
    maxes[warp] = max;
    sums[warp] = sum;
  }
#pragma unroll
  for (int c = 0; c < Chunks; ++c)
#pragma unroll
    for (int e = 0; e < kVector; ++e) {
      const int d = c * kChunk + lane * kVector + e;
      if (d < D) accs[warp][d] = acc[c][e];
    }
  __syncthreads();
  float overall = -INFINITY;
#pragma unroll
  for (int w = 0; w < kAttentionWarps; ++w) overall = fmaxf(overall, maxes[w]);
  float weights[kAttentionWarps], total = 0.f;
#pragma unroll
  for (int w = 0; w < kAttentionWarps; ++w) {
    weights[w] = expf(maxes[w] - overall);
    total += sums[w] * weights[w];
  }
  if (a.lse != nullptr && threadIdx.x == 0) a.lse[h * a.lse_ld + t] = overall + logf(total);
  bf16* out = row_of<bf16>(a.o, t) + static_cast<Index>(h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float value = 0.f;
#pragma unroll
    for (int w = 0; w < kAttentionWarps; ++w) value += accs[w][d] * weights[w];
    out[d] = to_bf16(value / total);
  }
}

template <bool Vectorized>
void launch_cached_attention(const CachedAttention& a, Index rows, int q_heads, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(q_heads));
  if (a.head_dim <= kChunk) {
    cached_attention_kernel<Vectorized, 1><<<grid, kAttentionWarps * 32, 0, stream>>>(a);
  } else {
    static_assert(kMaxCachedHeadDim == 2 * kChunk, "one kernel per number of chunks up to the maximum");
    cached_attention_kernel<Vectorized, 2><<<grid, kAttentionWarps * 32, 0, stream>>>(a);
  }
  check_launch("cached_attention");
}

// 16-byte accesses need every head to start on 16 bytes: whole groups of 8 elements and aligned rows.
void launch_cached_attention(const CachedAttention& a, int q_heads, cudaStream_t stream) {
  if (a.q.rows == 0) return;
  if (a.head_dim % kVector == 0 && vectorizable(a.o) && vectorizable(a.q) && vectorizable(a.k) && vectorizable(a.v)) {
    launch_cached_attention<true>(a, a.q.rows, q_heads, stream);
  } else {
    launch_cached_attention<false>(a, a.q.rows, q_heads, stream);
  }
}

}  // namespace

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
