// Per (chunk, value head): the backward of the WY/UT transform (gdn-kernels.md section 3, step 5) and the
// final per-token gradients of g and beta; then, per (token, q/k head), dq and dk summed over the GVA group
// in a fixed order and taken through the L2 norm.
//   dT  = dW (diag(beta e^gamma) K)^T + dT_U          dKb = T^T dW
//   dK += diag(beta e^gamma) dKb,  dbeta += e^gamma rowdot(dKb, K),  dgamma += beta e^gamma rowdot(dKb, K)
//   dA  = -(T^T dT T^T), strictly lower;  E = dA * (K K^T) * Gamma,  F = dA * diag(beta) Gamma
//   dbeta += rowsum(E),  dK += F K + F^T K,  dgamma += rowsum(beta E) - colsum(beta E)
//   dg = reverse cumsum of dgamma within the chunk.
#include "chunk.cuh"
#include "dispatch.cuh"
#include "launch.h"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kWyThreads = 256;  // 8 warps: 4 row blocks of 16 x 2 column halves

template <class E, int K>
struct WyGradSmem {
  using KeyTile = Tile<E, kChunk, K>;
  using ChunkTile = Tile<E, kChunk, kChunk>;
  using FloatTile = Tile<float, kChunk, kChunk>;
  static constexpr int k = 0;
  static constexpr int dw = k + KeyTile::kBytes;
  static constexpr int t = dw + KeyTile::kBytes;
  static constexpr int dt = t + ChunkTile::kBytes;
  static constexpr int x = dt + ChunkTile::kBytes;
  static constexpr int f = x + ChunkTile::kBytes;
  static constexpr int e = f + ChunkTile::kBytes;  // beta E, for its row and column sums
  static constexpr int gamma = e + FloatTile::kBytes;
  static constexpr int beta = gamma + kChunk * 4;
  static constexpr int dgamma = beta + kChunk * 4;
  static constexpr int k_dots = dgamma + kChunk * 4;  // [2 column halves][64 rows]
  static constexpr int e_sums = k_dots + 2 * kChunk * 4;
  static constexpr int bytes = e_sums + 2 * kChunk * 4;
};

template <class E, int K>
__global__ void __launch_bounds__(kWyThreads) wy_grad_kernel(Params p) {
  using L = WyGradSmem<E, K>;
  constexpr int kHalf = K / 2;
  extern __shared__ __align__(16) char smem[];
  const typename L::KeyTile k_tile{smem_at<E>(smem, L::k)}, dw_tile{smem_at<E>(smem, L::dw)};
  const typename L::ChunkTile t_tile{smem_at<E>(smem, L::t)}, dt_tile{smem_at<E>(smem, L::dt)};
  const typename L::ChunkTile x_tile{smem_at<E>(smem, L::x)}, f_tile{smem_at<E>(smem, L::f)};
  const typename L::FloatTile e_tile{smem_at<float>(smem, L::e)};
  float* gamma = smem_at<float>(smem, L::gamma);
  float* beta = smem_at<float>(smem, L::beta);
  float* dgamma = smem_at<float>(smem, L::dgamma);
  float* k_dots = smem_at<float>(smem, L::k_dots);
  float* e_sums = smem_at<float>(smem, L::e_sums);

  const int hv = blockIdx.y, h = hv / p.group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31;
  const int m0 = 16 * (warp % 4), half = warp / 4, g = lane >> 2;
  const ChunkInfo chunk = p.chunk_table[blockIdx.x];
  const std::int64_t t0 = chunk.start;
  const int rows = chunk.length;

  const std::int64_t key_row = (t0 * p.HV + hv) * K, key_stride = static_cast<std::int64_t>(p.HV) * K;
  const std::int64_t c_row = (t0 * p.HV + hv) * kChunk, c_stride = static_cast<std::int64_t>(p.HV) * kChunk;
  load_chunk_rows<kWyThreads>(k_tile, keys<E>(p), p.H, h, K, 0, chunk, tid);
  load_chunk_rows<kWyThreads>(dw_tile, p.dw, p.HV, hv, K, 0, chunk, tid);
  load_chunk_rows<kWyThreads>(t_tile, p.t, p.HV, hv, kChunk, 0, chunk, tid);
  load_gamma_async(p, gamma, hv, chunk, tid);
  cp_async_commit();
  if (tid < kChunk) beta[tid] = tid < rows ? load_gate<E>(p.beta, (t0 + tid) * p.HV + hv, p.beta_float) : 0.f;
  cp_async_wait<0>();
  __syncthreads();

  {  // dT
    float dt[1][4][4];
    zero(dt);
    warp_mma(dt, plain(dw_tile), m0, transposed(k_tile), 32 * half, 0, K);
    for_each(dt, m0, 32 * half, [&](int r, int c, float& x) {
      const float from_u = r < rows ? p.dt_from_v[c_row + r * c_stride + c] : 0.f;
      dt_tile(r, c) = from_float<E>(x * beta[c] * __expf(gamma[c]) + from_u);
    });
  }
  // dKb = T^T dW (T^T is upper triangular: rows m0.. need k >= m0).
  float dk[1][kHalf / 8][4];
  zero(dk);
  warp_mma(dk, transposed(t_tile), m0, plain(dw_tile), half * kHalf, m0, kChunk);
  float sums[2];
  row_dots(dk, k_tile, m0, half * kHalf, sums);
  if ((lane & 3) == 0) {
    k_dots[half * kChunk + m0 + g] = sums[0];
    k_dots[half * kChunk + m0 + g + 8] = sums[1];
  }
  for_each(dk, m0, half * kHalf, [&](int r, int, float& x) { x *= beta[r] * __expf(gamma[r]); });
  __syncthreads();  // dT complete

  {  // X = T^T dT
    float x[1][4][4];
    zero(x);
    warp_mma(x, transposed(t_tile), m0, plain(dt_tile), 32 * half, m0, kChunk);
    store(x, x_tile, m0, 32 * half);
  }
  __syncthreads();

  {  // dA = -X T^T (strictly lower), with K K^T: E, F and the beta E sums
    float da[1][4][4], kk[1][4][4];
    zero(da);
    zero(kk);
    warp_mma(da, plain(x_tile), m0, transposed(t_tile), 32 * half, 0, kChunk);
    warp_mma(kk, plain(k_tile), m0, transposed(k_tile), 32 * half, 0, K);
    float e_row[2] = {0.f, 0.f};
    for_each(da, kk, m0, 32 * half, [&](int r, int c, float& x, float& kdot) {
      if (r > c) {
        const float decay = __expf(gamma[r] - gamma[c]);
        const float e = -x * kdot * decay;
        e_row[(r - m0) / 8] += e;
        e_tile(r, c) = beta[r] * e;
        f_tile(r, c) = from_float<E>(-x * beta[r] * decay);
      } else {
        e_tile(r, c) = 0.f;
        f_tile(r, c) = from_float<E>(0.f);
      }
    });
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      e_row[i] += __shfl_xor_sync(0xffffffffu, e_row[i], 1);
      e_row[i] += __shfl_xor_sync(0xffffffffu, e_row[i], 2);
    }
    if ((lane & 3) == 0) {
      e_sums[half * kChunk + m0 + g] = e_row[0];
      e_sums[half * kChunk + m0 + g + 8] = e_row[1];
    }
  }
  __syncthreads();

  warp_mma(dk, plain(f_tile), m0, plain(k_tile), half * kHalf, 0, kChunk);
  warp_mma(dk, transposed(f_tile), m0, plain(k_tile), half * kHalf, 0, kChunk);
  for_each(dk, m0, half * kHalf, [&](int r, int c, float& x) {
    if (r < rows) p.dk_head[key_row + r * key_stride + c] += x;
  });

  constexpr int slices = K / key_slice<E, K>();
  if (tid < kChunk) {
    const int r = tid;
    float dg = 0.f, db = 0.f;
    if (r < rows) {
      for (int s = 0; s < slices; ++s) dg += p.dgamma_part[(static_cast<std::int64_t>(s) * p.tokens + t0 + r) * p.HV + hv];
      const float x = k_dots[r] + k_dots[kChunk + r], decay = __expf(gamma[r]);
      for (int c = 0; c < kChunk; ++c) dg += e_tile(r, c) - e_tile(c, r);
      dg += beta[r] * decay * x;
      db = p.dbeta_part[(t0 + r) * p.HV + hv] + decay * x + e_sums[r] + e_sums[kChunk + r];
    }
    dgamma[r] = dg;
    if (r < rows) store_gate<E>(p.dbeta, (t0 + r) * p.HV + hv, p.beta_float, db);
  }
  __syncthreads();
  if (tid < rows) {
    float dg = 0.f;
    for (int c = rows - 1; c >= tid; --c) dg += dgamma[c];
    store_gate<E>(p.dg, (t0 + tid) * p.HV + hv, p.g_float, dg);
  }
}

constexpr int kQkThreads = 256;

// One warp per (token, q/k head): sum the group's per-value-head gradients in head order, then the
// L2-norm backward dx = rstd (dx_hat - x_hat (x_hat . dx_hat)).
template <class E, int K>
__global__ void __launch_bounds__(kQkThreads) qk_grad_kernel(Params p) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (kQkThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= static_cast<std::int64_t>(p.tokens) * p.H) return;
  const std::int64_t token = row / p.H;
  const int h = static_cast<int>(row % p.H);
  constexpr int kPerLane = K / 32;
  for (int which = 0; which < 2; ++which) {
    const float* per_head = which == 0 ? p.dq_head : p.dk_head;
    float grad[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) grad[i] = 0.f;
    for (int j = 0; j < p.group; ++j) {
      const float* src = per_head + (token * p.HV + h * p.group + j) * K;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) grad[i] += src[lane + 32 * i];
    }
    if (p.l2norm) {
      const E* x = static_cast<const E*>(which == 0 ? p.q : p.k) + row * K;
      const float rstd = (which == 0 ? p.q_rstd : p.k_rstd)[row];
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) dot += to_float(x[lane + 32 * i]) * rstd * grad[i];
      dot = warp_sum(dot);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) grad[i] = rstd * (grad[i] - to_float(x[lane + 32 * i]) * rstd * dot);
    }
    E* dst = static_cast<E*>(which == 0 ? p.dq : p.dk) + row * K;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) dst[lane + 32 * i] = from_float<E>(grad[i]);
  }
}

}  // namespace

void launch_wy_grad(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    launch<wy_grad_kernel<E, K>>("gdn wy_grad_kernel", dim3(p.chunks, p.HV), dim3(kWyThreads), WyGradSmem<E, K>::bytes,
           kernels);
  });
}

void launch_qk_grad(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    const std::int64_t rows = static_cast<std::int64_t>(p.tokens) * p.H;
    launch<qk_grad_kernel<E, K>>("gdn qk_grad_kernel", dim3(static_cast<unsigned>((rows + 7) / 8)), dim3(kQkThreads),
           0, kernels);
  });
}

}  // namespace deltatrain::gdn::cuda
