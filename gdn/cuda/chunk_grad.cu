// Per (chunk, value head, key slice): the gradients that need the states (gdn-kernels.md section 3, step 4)
// and the V side of the WY backward, accumulated over 64-wide blocks of V:
//   dQ  = scale e^gamma (dO S^T) + M K                 M  = (dO Delta^T) * scale Gamma, lower incl.
//   dK  = e^(gamma_last - gamma) (Delta dS'^T) + M^T Q
//   dW  = -D S^T                                        D = dDelta (from the reverse pass)
//   dV  = diag(beta) T^T D,  dbeta += rowsum((T^T D) * V),  dT_U = D (diag(beta) V)^T
//   dgamma: rowdot(dQ_state, Q) - rowdot(dK_state, K) + rowsum(G) - colsum(G), G = (dO Delta^T) * P,
//           and at the chunk's last row sum(dK_state * K) + e^gamma_last sum(S * dS').
// S = state entering the chunk, dS' = gradient of the state after it. K is split in slices of
// key_slice_width columns (grid z); the V-side terms are computed by slice 0.
#include "chunk.cuh"
#include "dispatch.cuh"
#include "launch.h"

namespace deltatrain::gdn::cuda {

int key_slice_width(DType io, int K) {
  int width = 0;
  dispatch(io, K, [&]<class E, int kK>() { width = key_slice<E, kK>(); });
  return width;
}

namespace {

constexpr int kGradThreads = 256;  // 8 warps: 4 row blocks of 16 x 2 column halves

template <class E, int K>
struct ChunkGradSmem {
  static constexpr int kSlice = key_slice<E, K>();
  using SliceTile = Tile<E, kChunk, kSlice>;  // rows: tokens (q, k) or V columns (S, dS')
  using ChunkTile = Tile<E, kChunk, kChunk>;
  using FloatTile = Tile<float, kChunk, kChunk>;
  static constexpr int q = 0;
  static constexpr int k = q + SliceTile::kBytes;
  static constexpr int s = k + SliceTile::kBytes;
  static constexpr int ds = s + SliceTile::kBytes;
  static constexpr int t = ds + SliceTile::kBytes;
  static constexpr int p = t + ChunkTile::kBytes;
  static constexpr int m = p + ChunkTile::kBytes;
  static constexpr int d_o = m + ChunkTile::kBytes;
  static constexpr int delta = d_o + ChunkTile::kBytes;
  static constexpr int ddelta = delta + ChunkTile::kBytes;
  static constexpr int v = ddelta + ChunkTile::kBytes;
  static constexpr int g = v + ChunkTile::kBytes;
  static constexpr int gamma = g + FloatTile::kBytes;
  static constexpr int beta = gamma + kChunk * 4;
  static constexpr int q_dots = beta + kChunk * 4;  // [2 column halves][64 rows]
  static constexpr int k_dots = q_dots + 2 * kChunk * 4;
  static constexpr int beta_dots = k_dots + 2 * kChunk * 4;
  static constexpr int scratch = beta_dots + 2 * kChunk * 4;
  static constexpr int bytes = scratch + 8 * 4;
};

template <class E, int K>
__global__ void __launch_bounds__(kGradThreads) chunk_grad_kernel(Params p) {
  using L = ChunkGradSmem<E, K>;
  constexpr int kSlice = L::kSlice, kHalf = kSlice / 2;
  extern __shared__ __align__(16) char smem[];
  const typename L::SliceTile q_tile{smem_at<E>(smem, L::q)}, k_tile{smem_at<E>(smem, L::k)};
  const typename L::SliceTile s_tile{smem_at<E>(smem, L::s)}, ds_tile{smem_at<E>(smem, L::ds)};
  const typename L::ChunkTile t_tile{smem_at<E>(smem, L::t)}, p_tile{smem_at<E>(smem, L::p)};
  const typename L::ChunkTile m_tile{smem_at<E>(smem, L::m)}, do_tile{smem_at<E>(smem, L::d_o)};
  const typename L::ChunkTile delta_tile{smem_at<E>(smem, L::delta)}, ddelta_tile{smem_at<E>(smem, L::ddelta)};
  const typename L::ChunkTile v_tile{smem_at<E>(smem, L::v)};
  const typename L::FloatTile g_tile{smem_at<float>(smem, L::g)};
  float* gamma = smem_at<float>(smem, L::gamma);
  float* beta = smem_at<float>(smem, L::beta);
  float* q_dots = smem_at<float>(smem, L::q_dots);
  float* k_dots = smem_at<float>(smem, L::k_dots);
  float* beta_dots = smem_at<float>(smem, L::beta_dots);

  const int chunk_index = blockIdx.x, hv = blockIdx.y, slice = blockIdx.z, h = hv / p.group;
  const bool first_slice = slice == 0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31;
  const int m0 = 16 * (warp % 4), half = warp / 4, g = lane >> 2;
  const ChunkInfo chunk = p.chunk_table[chunk_index];
  const std::int64_t t0 = chunk.start;
  const int rows = chunk.length, key0 = slice * kSlice;

  load_chunk_rows<kGradThreads>(q_tile, queries<E>(p), p.H, h, K, key0, chunk, tid);
  load_chunk_rows<kGradThreads>(k_tile, keys<E>(p), p.H, h, K, key0, chunk, tid);
  const std::int64_t c_row = (t0 * p.HV + hv) * kChunk, c_stride = static_cast<std::int64_t>(p.HV) * kChunk;
  load_chunk_rows<kGradThreads>(p_tile, p.p, p.HV, hv, kChunk, 0, chunk, tid);
  if (first_slice) load_chunk_rows<kGradThreads>(t_tile, p.t, p.HV, hv, kChunk, 0, chunk, tid);
  load_gamma_async(p, gamma, hv, chunk, tid);
  if (tid < kChunk) beta[tid] = tid < rows ? load_gate<E>(p.beta, (t0 + tid) * p.HV + hv, p.beta_float) : 0.f;

  float dq[1][kHalf / 8][4], dk[1][kHalf / 8][4], dw[1][kHalf / 8][4], dp[1][4][4], dt_u[1][4][4];
  zero(dq);
  zero(dk);
  zero(dw);
  zero(dp);
  zero(dt_u);
  float beta_dot[2] = {0.f, 0.f};
  float state_dot = 0.f;

  const std::int64_t v_row = (t0 * p.HV + hv) * p.V, v_stride = static_cast<std::int64_t>(p.HV) * p.V;
  const std::int64_t state_row = static_cast<std::int64_t>(chunk_index * p.HV + hv) * p.V;
#pragma unroll 1
  for (int vb = 0; vb < p.V; vb += 64) {
    load_chunk_rows<kGradThreads>(do_tile, p.d_o, p.HV, hv, p.V, vb, chunk, tid);
    load_chunk_rows<kGradThreads>(delta_tile, p.delta, p.HV, hv, p.V, vb, chunk, tid);
    load_chunk_rows<kGradThreads>(ddelta_tile, p.ddelta, p.HV, hv, p.V, vb, chunk, tid);
    if (first_slice) load_chunk_rows<kGradThreads>(v_tile, p.v, p.HV, hv, p.V, vb, chunk, tid);
    load_rows_async<kGradThreads>(s_tile, static_cast<const E*>(p.states) + (state_row + vb) * K + key0, K, 64, tid);
    load_rows_async<kGradThreads>(ds_tile, static_cast<const E*>(p.dstates) + (state_row + vb) * K + key0, K, 64, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    warp_mma(dq, plain(do_tile), m0, plain(s_tile), half * kHalf, 0, 64);
    warp_mma(dk, plain(delta_tile), m0, plain(ds_tile), half * kHalf, 0, 64);
    warp_mma(dw, plain(ddelta_tile), m0, plain(s_tile), half * kHalf, 0, 64);
    warp_mma(dp, plain(do_tile), m0, transposed(delta_tile), 32 * half, 0, 64);
    if (first_slice) {
      warp_mma(dt_u, plain(ddelta_tile), m0, transposed(v_tile), 32 * half, 0, 64);
      float tdd[1][4][4];  // (T^T D) for this block of V
      zero(tdd);
      warp_mma(tdd, transposed(t_tile), m0, plain(ddelta_tile), 32 * half, m0, 64);
      E* dv = static_cast<E*>(p.dv) + v_row + vb;
      for_each(tdd, m0, 32 * half, [&](int r, int c, float& x) {
        beta_dot[(r - m0) / 8] += x * to_float(v_tile(r, c));
        if (r < rows) dv[r * v_stride + c] = from_float<E>(beta[r] * x);
      });
    }
    for (int i = tid; i < 64 * kSlice; i += kGradThreads) {
      state_dot += to_float(s_tile(i / kSlice, i % kSlice)) * to_float(ds_tile(i / kSlice, i % kSlice));
    }
    __syncthreads();  // the tiles are free for the next block
  }

  // M and G from dP = dO Delta^T.
  for_each(dp, m0, 32 * half, [&](int r, int c, float& x) {
    const bool lower = r >= c;
    const float decay = lower ? __expf(gamma[r] - gamma[c]) : 0.f;
    m_tile(r, c) = from_float<E>(x * p.scale * decay);
    g_tile(r, c) = lower ? x * to_float(p_tile(r, c)) : 0.f;
  });

  // dQ (state part), its dgamma term, then + M K.
  for_each(dq, m0, half * kHalf, [&](int r, int, float& x) { x *= p.scale * __expf(gamma[r]); });
  float sums[2];
  row_dots(dq, q_tile, m0, half * kHalf, sums);
  if ((lane & 3) == 0) {
    q_dots[half * kChunk + m0 + g] = sums[0];
    q_dots[half * kChunk + m0 + g + 8] = sums[1];
  }
  const float gamma_last = gamma[kChunk - 1];
  for_each(dk, m0, half * kHalf, [&](int r, int, float& x) { x *= __expf(gamma_last - gamma[r]); });
  row_dots(dk, k_tile, m0, half * kHalf, sums);
  if ((lane & 3) == 0) {
    k_dots[half * kChunk + m0 + g] = sums[0];
    k_dots[half * kChunk + m0 + g + 8] = sums[1];
  }
  if (first_slice) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      beta_dot[i] += __shfl_xor_sync(0xffffffffu, beta_dot[i], 1);
      beta_dot[i] += __shfl_xor_sync(0xffffffffu, beta_dot[i], 2);
    }
    if ((lane & 3) == 0) {
      beta_dots[half * kChunk + m0 + g] = beta_dot[0];
      beta_dots[half * kChunk + m0 + g + 8] = beta_dot[1];
    }
  }
  __syncthreads();  // M, G and the row dots are complete

  warp_mma(dq, plain(m_tile), m0, plain(k_tile), half * kHalf, 0, 64);
  warp_mma(dk, transposed(m_tile), m0, plain(q_tile), half * kHalf, 0, 64);
  const std::int64_t key_row = (t0 * p.HV + hv) * K + key0, key_stride = static_cast<std::int64_t>(p.HV) * K;
  for_each(dq, m0, half * kHalf, [&](int r, int c, float& x) {
    if (r < rows) p.dq_head[key_row + r * key_stride + c] = x;
  });
  for_each(dk, m0, half * kHalf, [&](int r, int c, float& x) {
    if (r < rows) p.dk_head[key_row + r * key_stride + c] = x;
  });
  for_each(dw, m0, half * kHalf, [&](int r, int c, float& x) {
    if (r < rows) static_cast<E*>(p.dw)[key_row + r * key_stride + c] = from_float<E>(-x);
  });
  if (first_slice) {
    for_each(dt_u, m0, 32 * half, [&](int r, int c, float& x) {
      if (r < rows) p.dt_from_v[c_row + r * c_stride + c] = x * beta[c];
    });
  }

  const float total_state_dot = block_sum<kGradThreads>(state_dot, smem_at<float>(smem, L::scratch));
  // A factor exp(gamma_i - gamma_j) gives +x to dgamma_i and -x to dgamma_j; for i == j the factor is 1
  // and the two cancel exactly, so the diagonal is left out rather than summed and subtracted (under
  // strong decay the true dgamma is tiny and such rounding would swamp it).
  if (tid < rows) {
    const int r = tid, last = rows - 1;
    float dgamma = q_dots[r] + q_dots[kChunk + r];
    if (first_slice) {
      for (int c = 0; c < kChunk; ++c) dgamma += c == r ? 0.f : g_tile(r, c) - g_tile(c, r);
      p.dbeta_part[(t0 + r) * p.HV + hv] = beta_dots[r] + beta_dots[kChunk + r];
    }
    if (r == last) {
      for (int c = 0; c < last; ++c) dgamma += k_dots[c] + k_dots[kChunk + c];
      dgamma += __expf(gamma_last) * total_state_dot;
    } else {
      dgamma -= k_dots[r] + k_dots[kChunk + r];
    }
    p.dgamma_part[(static_cast<std::int64_t>(slice) * p.tokens + t0 + r) * p.HV + hv] = dgamma;
  }
}

}  // namespace

void launch_chunk_grad(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    using L = ChunkGradSmem<E, K>;
    launch<chunk_grad_kernel<E, K>>("gdn chunk_grad_kernel", dim3(p.chunks, p.HV, K / L::kSlice), dim3(kGradThreads),
           L::bytes, kernels);
  });
}

}  // namespace deltatrain::gdn::cuda
