// The token-by-token recurrence (the rollout step): per (sequence, value head, 32 columns of V) one CTA of
// eight warps; warp w holds rows [w K/8, (w+1) K/8) of the float32 state for its lane's column, and the
// sums over K (h^T k and h^T q) are combined across warps in a fixed order. With state_indices the sequence's state
// is read from and written back to its row of the pools h0 and ht, which may be one tensor (in place).
#include "chunk.cuh"
#include "dispatch.cuh"
#include "launch.h"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kRecurrentThreads = 256;
constexpr int kRecurrentWarps = kRecurrentThreads / 32;
// CTAs an SM must hold at once, which caps the registers: a decode step's kernel is bound by the states' bytes in
// flight, and at K = 128 the compiler's own choice (74 registers, 3 CTAs, 48 KB of state loads per SM) left the
// bandwidth short (bench/NOTES.md, Rollout). 6 fit in 40 registers without spilling; K = 256's 32 state rows a
// thread do not, and keep the compiler's choice.
template <int K>
constexpr int kRecurrentMinCtas = K <= 128 ? 6 : 1;

template <class E, int K>
__global__ void __launch_bounds__(kRecurrentThreads, kRecurrentMinCtas<K>) recurrent_kernel(Params p) {
  constexpr int kRows = K / kRecurrentWarps;
  __shared__ float q_row[K], k_row[K];
  __shared__ float partial[2][kRecurrentWarps][32];
  __shared__ float norms[2][kRecurrentWarps];
  const int n = blockIdx.x, hv = blockIdx.y, h = hv / p.group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31;
  const int v = blockIdx.z * 32 + lane, key0 = warp * kRows;
  const std::int64_t state_row = p.state_indices != nullptr ? p.state_indices[n] : n;
  const std::int64_t state_base = (state_row * p.HV + hv) * K * p.V;

  float state[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) state[i] = p.h0 != nullptr ? p.h0[state_base + (key0 + i) * p.V + v] : 0.f;

  const std::int64_t begin = sequence_start(p, n), end = sequence_start(p, n + 1);
  for (std::int64_t token = begin; token < end; ++token) {
    const std::int64_t qk_row = (token * p.H + h) * K;
    for (int i = tid; i < K; i += kRecurrentThreads) {
      q_row[i] = to_float(static_cast<const E*>(p.q)[qk_row + i]);
      k_row[i] = to_float(static_cast<const E*>(p.k)[qk_row + i]);
    }
    __syncthreads();
    float q_scale = p.scale, k_scale = 1.f;
    if (p.l2norm) {
      float qq = 0.f, kk = 0.f;
      for (int i = lane; i < kRows; i += 32) {
        qq += q_row[key0 + i] * q_row[key0 + i];
        kk += k_row[key0 + i] * k_row[key0 + i];
      }
      qq = warp_sum(qq);
      kk = warp_sum(kk);
      if (lane == 0) {
        norms[0][warp] = qq;
        norms[1][warp] = kk;
      }
      __syncthreads();
      qq = 0.f;
      kk = 0.f;
#pragma unroll
      for (int w = 0; w < kRecurrentWarps; ++w) {
        qq += norms[0][w];
        kk += norms[1][w];
      }
      q_scale *= 1.f / sqrtf(qq + 1e-6f);
      k_scale = 1.f / sqrtf(kk + 1e-6f);
    }
    const std::int64_t gate_index = token * p.HV + hv;
    const float decay = __expf(load_gate<E>(p.g, gate_index, p.g_float));
    const float beta = load_gate<E>(p.beta, gate_index, p.beta_float);

    float kh = 0.f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      state[i] *= decay;
      kh += state[i] * k_row[key0 + i];
    }
    partial[0][warp][lane] = kh * k_scale;
    __syncthreads();
    kh = 0.f;
#pragma unroll
    for (int w = 0; w < kRecurrentWarps; ++w) kh += partial[0][w][lane];
    const std::int64_t v_index = (token * p.HV + hv) * p.V + v;
    const float correction = beta * (to_float(static_cast<const E*>(p.v)[v_index]) - kh);
    float qh = 0.f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      state[i] += k_row[key0 + i] * k_scale * correction;
      qh += state[i] * q_row[key0 + i];
    }
    partial[1][warp][lane] = qh * q_scale;
    __syncthreads();
    if (warp == 0) {
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < kRecurrentWarps; ++w) o += partial[1][w][lane];
      static_cast<E*>(p.o)[v_index] = from_float<E>(o);
    }
    __syncthreads();  // the rows and partial sums are free for the next token
  }
  if (p.ht != nullptr) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) p.ht[state_base + (key0 + i) * p.V + v] = state[i];
  }
}

}  // namespace

void launch_recurrent(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    launch<recurrent_kernel<E, K>>("gdn recurrent_kernel", dim3(p.sequences, p.HV, p.V / 32), dim3(kRecurrentThreads), 0,
           kernels);
  });
}

}  // namespace deltatrain::gdn::cuda
