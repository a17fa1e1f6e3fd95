// The row kernels of the unfused attention (attention.cpp runs them between cuBLASLt products): the causal
// softmax over a block of score rows and its backward, and the moves of a GQA group's head columns to and
// from contiguous blocks; and the small kernels around cuDNN's fused attention (cudnn_attention.cpp): its
// ragged offsets and sequence lengths from cu_seqlens, its statistics to and from lse [Hq, T].
#include "common.cuh"

namespace deltatrain::model::cuda {
namespace {

constexpr int kThreads = 256;

// Row r of the score block: its query index i (keys 0..i are visible) and its lse.
struct ScoreRow {
  Index i;
  float* lse;
  __device__ ScoreRow(const ScoreRows& rows, Index r)
      : i(r % rows.length), lse(rows.lse + (r / rows.length) * rows.lse_ld + r % rows.length) {}
};

__global__ void causal_softmax_kernel(bf16* p, const float* s, ScoreRows rows) {
  const Index r = blockIdx.x, L = rows.length;
  const ScoreRow row(rows, r);
  const float* sr = s + r * L;
  MaxSum partial;
  for (Index u = threadIdx.x; u <= row.i; u += blockDim.x) partial.add(sr[u]);
  const MaxSum total = block_max_sum(partial);
  const float lse = total.max + logf(total.sum);
  if (threadIdx.x == 0) *row.lse = lse;
  bf16* pr = p + r * L;
  for (Index u = threadIdx.x; u < L; u += blockDim.x) pr[u] = to_bf16(u <= row.i ? expf(sr[u] - lse) : 0.f);
}

__global__ void causal_probabilities_kernel(bf16* p, const float* s, ScoreRows rows) {
  const Index r = blockIdx.x, L = rows.length;
  const ScoreRow row(rows, r);
  const float lse = *row.lse;
  const float* sr = s + r * L;
  bf16* pr = p + r * L;
  for (Index u = threadIdx.x; u < L; u += blockDim.x) pr[u] = to_bf16(u <= row.i ? expf(sr[u] - lse) : 0.f);
}

__global__ void softmax_backward_kernel(bf16* p_to_ds, const float* dp, const float* delta, ScoreRows rows) {
  const Index r = blockIdx.x, L = rows.length;
  const float d = delta[r];
  bf16* pr = p_to_ds + r * L;
  const float* dpr = dp + r * L;
  for (Index u = threadIdx.x; u < L; u += blockDim.x) pr[u] = to_bf16(to_float(pr[u]) * (dpr[u] - d));
}

// Element (j, i, d8) of a [groups, length, head_dim] block <-> row i, columns j * head_dim + d8 of `m`.
template <bool V, bool Gather>
__global__ void move_heads_kernel(bf16* block, Matrix m, int groups, int head_dim) {
  const Index chunks = (head_dim + kVector - 1) / kVector;
  const Index index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index >= groups * m.rows * chunks) return;
  const Index d0 = index % chunks * kVector, ji = index / chunks, j = ji / m.rows, i = ji % m.rows;
  bf16* packed = block + ji * head_dim;
  bf16* strided = row_of<bf16>(m, i) + j * head_dim;
  float v[kVector];
  if constexpr (Gather) {
    load8<V>(strided, d0, head_dim, v);
    store8<V>(packed, d0, head_dim, v);
  } else {
    load8<V>(packed, d0, head_dim, v);
    store8<V>(strided, d0, head_dim, v);
  }
}

template <bool Gather>
void move_heads(const char* name, bf16* block, Matrix m, int groups, int head_dim, cudaStream_t stream) {
  const Index n = groups * m.rows * ((head_dim + kVector - 1) / kVector);
  if (n == 0) return;
  const bool v = head_dim % kVector == 0 && vectorizable(Matrix{m.data, m.rows, head_dim, m.ld}) &&
                 reinterpret_cast<std::uintptr_t>(block) % 16 == 0;
  if (v) {
    move_heads_kernel<true, Gather><<<grid_for(n, kThreads), kThreads, 0, stream>>>(block, m, groups, head_dim);
  } else {
    move_heads_kernel<false, Gather><<<grid_for(n, kThreads), kThreads, 0, stream>>>(block, m, groups, head_dim);
  }
  check_launch(name);
}

// One warp per (head j, row i): delta = dout . o over the head's columns.
__global__ void attention_delta_kernel(float* delta, Matrix dout, Matrix o, int groups, int head_dim) {
  const Index w = blockIdx.x * static_cast<Index>(blockDim.x / 32) + threadIdx.x / 32;
  if (w >= groups * o.rows) return;
  const Index j = w / o.rows, i = w % o.rows;
  const bf16* a = row_of<const bf16>(dout, i) + j * head_dim;
  const bf16* b = row_of<const bf16>(o, i) + j * head_dim;
  float sum = 0.f;
  for (int d = threadIdx.x % 32; d < head_dim; d += 32) sum += to_float(a[d]) * to_float(b[d]);
  sum = warp_sum(sum);
  if (threadIdx.x % 32 == 0) delta[w] = sum;
}

unsigned score_blocks(const ScoreRows& rows) { return static_cast<unsigned>(rows.groups * rows.length); }

__global__ void ragged_offsets_kernel(std::int32_t* offsets, std::int32_t* lengths, RaggedStrides strides,
                                      Sequences seq, int batch) {
  for (int i = threadIdx.x; i < strides.tensors * (batch + 1); i += blockDim.x) {
    const int tensor = i / (batch + 1), n = i % (batch + 1);
    offsets[i] = static_cast<std::int32_t>(seq.cu[min(n, seq.count)] * strides.ld[tensor]);
  }
  for (int n = threadIdx.x; n < batch; n += blockDim.x)
    lengths[n] = n < seq.count ? seq.cu[n + 1] - seq.cu[n] : 0;
}

// Thread (s, sequence n, head h): stats[(n * heads + h) * length + s] <-> lse[h, cu[n] + s], for s below n's length.
template <bool ToLse>
__global__ void move_stats_kernel(float* stats, Matrix lse, Sequences seq, Index length) {
  const Index s = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  const int n = blockIdx.y, h = blockIdx.z;
  const std::int32_t start = seq.cu[n];
  if (s >= seq.cu[n + 1] - start) return;
  float* packed = row_of<float>(lse, h) + start + s;
  float* padded = stats + (static_cast<Index>(n) * lse.rows + h) * length + s;
  if constexpr (ToLse) {
    *packed = *padded;
  } else {
    *padded = *packed;
  }
}

template <bool ToLse>
void move_stats(const char* name, float* stats, Matrix lse, Sequences seq, Index length, cudaStream_t stream) {
  if (seq.count == 0 || lse.rows == 0 || length == 0) return;
  const dim3 grid(grid_for(length, kThreads), static_cast<unsigned>(seq.count), static_cast<unsigned>(lse.rows));
  move_stats_kernel<ToLse><<<grid, kThreads, 0, stream>>>(stats, lse, seq, length);
  check_launch(name);
}

}  // namespace

void causal_softmax(void* p, const float* s, ScoreRows rows, cudaStream_t stream) {
  causal_softmax_kernel<<<score_blocks(rows), kThreads, 0, stream>>>(static_cast<bf16*>(p), s, rows);
  check_launch("attention (causal softmax)");
}

void causal_probabilities(void* p, const float* s, ScoreRows rows, cudaStream_t stream) {
  causal_probabilities_kernel<<<score_blocks(rows), kThreads, 0, stream>>>(static_cast<bf16*>(p), s, rows);
  check_launch("attention (probabilities)");
}

void softmax_backward(void* p_to_ds, const float* dp, const float* delta, ScoreRows rows, cudaStream_t stream) {
  softmax_backward_kernel<<<score_blocks(rows), kThreads, 0, stream>>>(static_cast<bf16*>(p_to_ds), dp, delta, rows);
  check_launch("attention (softmax backward)");
}

void gather_heads(void* dst, Matrix src, int groups, int head_dim, cudaStream_t stream) {
  move_heads<true>("attention (gather heads)", static_cast<bf16*>(dst), src, groups, head_dim, stream);
}

void scatter_heads(Matrix dst, const void* src, int groups, int head_dim, cudaStream_t stream) {
  move_heads<false>("attention (scatter heads)", static_cast<bf16*>(const_cast<void*>(src)), dst, groups, head_dim,
                    stream);
}

void attention_delta(float* delta, Matrix dout, Matrix o, int groups, int head_dim, cudaStream_t stream) {
  const Index warps = groups * o.rows;
  if (warps == 0) return;
  attention_delta_kernel<<<grid_for(warps, kThreads / 32), kThreads, 0, stream>>>(delta, dout, o, groups, head_dim);
  check_launch("attention (delta)");
}

void ragged_offsets(std::int32_t* offsets, std::int32_t* lengths, RaggedStrides strides, Sequences sequences, int batch,
                    cudaStream_t stream) {
  ragged_offsets_kernel<<<1, kThreads, 0, stream>>>(offsets, lengths, strides, sequences, batch);
  check_launch("attention (ragged offsets)");
}

void lse_from_stats(Matrix lse, const float* stats, Sequences sequences, Index length, cudaStream_t stream) {
  move_stats<true>("attention (lse from statistics)", const_cast<float*>(stats), lse, sequences, length, stream);
}

void stats_from_lse(float* stats, Matrix lse, Sequences sequences, Index length, cudaStream_t stream) {
  move_stats<false>("attention (statistics from lse)", stats, lse, sequences, length, stream);
}

}  // namespace deltatrain::model::cuda
