// Per (chunk, q/k head), the value heads of its GVA group in turn (in head order, each adding its part to
// the group's dK): the backward of the WY/UT transform (docs/gdn-algorithm.md section 4) and the final
// per-token gradients of g and beta, and dk (through the L2 norm where there is one); and input_grad_kernel,
// per (token, q/k head): dq through the L2 norm where there is one, and dq and dk after the fused backward
// (fused_backward.cu), which leaves them per value head.
// With D = dDelta, the gradient of U = T diag(beta) V:
//   dV  = diag(beta) T^T D,  dbeta += rowsum((T^T D) * V)
//   dT  = (dW K^T diag(e^gamma) + D V^T) diag(beta)    dKb = T^T dW
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
  using Square = Tile<E, kChunk, kChunk>;
  static constexpr int k = 0;
  static constexpr int dw = k + KeyTile::kBytes;
  static constexpr int t = dw + KeyTile::kBytes;
  static constexpr int dt = t + Square::kBytes;
  // The 64-column blocks of D and V alternate between two buffers, so that the next block's copies run
  // while the current one is used; the first buffer then holds X and F.
  static constexpr int x = dt + Square::kBytes;
  static constexpr int f = x + Square::kBytes;
  static constexpr int d_next = f + Square::kBytes;
  static constexpr int v_next = d_next + Square::kBytes;
  static constexpr int gamma = v_next + Square::kBytes;
  static constexpr int beta = gamma + kChunk * 8;  // gamma is hi + lo (chunk.cuh)
  static_assert(gamma % 16 == 0, "for_each_decay reads two columns' gamma as one float4");
  static constexpr int beta_decay = beta + kChunk * 4;  // beta e^gamma
  static constexpr int dgamma = beta_decay + kChunk * 4;
  static constexpr int k_dots = dgamma + kChunk * 4;  // [2 column halves][64 rows]
  static constexpr int e_sums = k_dots + 2 * kChunk * 4;
  static constexpr int beta_dots = e_sums + 2 * kChunk * 4;
  static constexpr int e_parts = beta_dots + 2 * kChunk * 4;  // store_row_column_sums of beta E
  static constexpr int bytes = e_parts + 6 * kChunk * 4;
};

// Two CTAs per SM where the registers allow it: at K = 256 dK and dKb alone are 128 floats per thread.
template <class E, int K>
__global__ void __launch_bounds__(kWyThreads, K <= 128 ? 2 : 1) wy_grad_kernel(Params p) {
  using L = WyGradSmem<E, K>;
  constexpr int kHalf = K / 2;
  extern __shared__ __align__(16) char smem[];
  const typename L::KeyTile k_tile{smem_at<E>(smem, L::k)}, dw_tile{smem_at<E>(smem, L::dw)};
  const typename L::Square t_tile{smem_at<E>(smem, L::t)}, dt_tile{smem_at<E>(smem, L::dt)};
  const typename L::Square x_tile{smem_at<E>(smem, L::x)}, f_tile{smem_at<E>(smem, L::f)};
  // The buffers of the block of D and V that starts at column vb.
  auto d_block = [&](int vb) { return typename L::Square{smem_at<E>(smem, vb / 64 % 2 == 0 ? L::x : L::d_next)}; };
  auto v_block = [&](int vb) { return typename L::Square{smem_at<E>(smem, vb / 64 % 2 == 0 ? L::f : L::v_next)}; };
  float2* gamma = smem_at<float2>(smem, L::gamma);
  float* beta = smem_at<float>(smem, L::beta);
  float* beta_decay = smem_at<float>(smem, L::beta_decay);
  float* dgamma = smem_at<float>(smem, L::dgamma);
  float* k_dots = smem_at<float>(smem, L::k_dots);
  float* e_sums = smem_at<float>(smem, L::e_sums);
  float* beta_dots = smem_at<float>(smem, L::beta_dots);
  float* e_parts = smem_at<float>(smem, L::e_parts);

  const int h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32;
  const int m0 = 16 * (warp % 4), n0 = 32 * (warp / 4), k0 = (warp / 4) * kHalf;
  const ChunkInfo chunk = p.chunk_table[blockIdx.x];
  const std::int64_t t0 = chunk.start;
  const int rows = chunk.length;

  load_chunk_rows<kWyThreads>(k_tile, keys<E>(p), p.H, h, K, 0, chunk, tid);
  // dK so far (chunk_grad's part, summed over the group), read first so that its latency hides behind the
  // V side; each value head of the group then adds its own part.
  const std::int64_t key_stride = static_cast<std::int64_t>(p.H) * K;
  float* const dk_head = p.dk_head + ((t0 + m0) * p.H + h) * K + k0;
  float dk[1][kHalf / 8][4];
  load_pairs(dk, dk_head, key_stride, rows - m0);
  float keys_gram[1][4][4];  // K K^T: the same for every value head of the group, formed with the first
  zero(keys_gram);
#pragma unroll 1
  for (int hv = h * p.group; hv < (h + 1) * p.group; ++hv) {
    load_chunk_rows<kWyThreads>(dw_tile, p.dw, p.HV, hv, K, 0, chunk, tid);
    load_lower_chunk_tile<kWyThreads>(t_tile, p.t, p.HV, hv, chunk, tid);
    load_gamma_async(p, gamma, hv, chunk, tid);
    auto load_v_block = [&](int vb) {
      load_chunk_rows<kWyThreads>(d_block(vb), p.ddelta, p.HV, hv, p.V, vb, chunk, tid);
      load_chunk_rows<kWyThreads>(v_block(vb), p.v, p.HV, hv, p.V, vb, chunk, tid);
      cp_async_commit();
    };
    load_v_block(0);
    if (tid < kChunk) {  // e^gamma as prepare left it, so that no product's loop takes an exponential
      const bool valid = tid < rows;
      beta[tid] = valid ? load_gate<E>(p.beta, (t0 + tid) * p.HV + hv, p.beta_float) : 0.f;
      beta_decay[tid] = valid ? beta[tid] * p.gate_in[static_cast<std::int64_t>(hv) * p.tokens + t0 + tid] : 0.f;
    }

    // The V side, 64 columns of V at a time: dV, its dbeta term, and D V^T for dT.
    float dt_from_v[1][4][4], beta_dot[2] = {0.f, 0.f};
    zero(dt_from_v);
    const std::int64_t v_stride = static_cast<std::int64_t>(p.HV) * p.V;
    E* const dv = static_cast<E*>(p.dv) + ((t0 + m0) * p.HV + hv) * p.V + n0;
#pragma unroll 1
    for (int vb = 0; vb < p.V; vb += 64) {
      if (vb + 64 < p.V) {
        load_v_block(vb + 64);  // into the buffer the previous block has left
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const typename L::Square d_tile = d_block(vb), v_tile = v_block(vb);
      warp_mma(dt_from_v, plain(d_tile), m0, transposed(v_tile), n0, 0, 64);
      float tdd[1][4][4];  // T^T D; T^T is upper triangular, so rows m0.. need k >= m0
      zero(tdd);
      warp_mma(tdd, transposed(t_tile), m0, plain(d_tile), n0, m0, kChunk);
      float sums[2];
      row_dots(tdd, v_tile, m0, n0, sums);
      beta_dot[0] += sums[0];
      beta_dot[1] += sums[1];
      for_each(tdd, m0, n0, [&](int r, int, float& x) { x *= beta[r]; });
      store_pairs(tdd, dv + vb, v_stride, rows - m0);
      __syncthreads();  // the D and V blocks are free
    }
    store_row_pair(beta_dot, beta_dots, m0, n0);

    {  // dT
      float dt[1][4][4];
      zero(dt);
      warp_mma(dt, plain(dw_tile), m0, transposed(k_tile), n0, 0, K);
      for_each(dt, dt_from_v, m0, n0, [&](int r, int c, float& x, float& from_v) {
        dt_tile(r, c) = from_float<E>(beta_decay[c] * x + beta[c] * from_v);
      });
    }
    {  // dKb = T^T dW (rows m0.. again need k >= m0)
      float dkb[1][kHalf / 8][4];
      zero(dkb);
      warp_mma(dkb, transposed(t_tile), m0, plain(dw_tile), k0, m0, kChunk);
      float sums[2];
      row_dots(dkb, k_tile, m0, k0, sums);
      store_row_pair(sums, k_dots, m0, n0);
      for_each(dk, dkb, m0, k0, [&](int r, int, float& x, float& b) { x += beta_decay[r] * b; });
    }
    __syncthreads();  // dT complete

    {  // X = T^T dT
      float x[1][4][4];
      zero(x);
      warp_mma(x, transposed(t_tile), m0, plain(dt_tile), n0, m0, kChunk);
      store_accumulator(x, plain(x_tile), m0, n0);
    }
    __syncthreads();

    {  // dA = -X T^T (strictly lower), with K K^T: F, E and beta E's sums
      float da[1][4][4], kk[1][4][4];
      zero(da);
      warp_mma(da, plain(x_tile), m0, transposed(t_tile), n0, 0, kChunk);
      if (hv == h * p.group) warp_mma(keys_gram, plain(k_tile), m0, transposed(k_tile), n0, 0, K);
      for_each(kk, keys_gram, m0, n0, [](int, int, float& x, float& gram) { x = gram; });
      inverse_backward(da, kk, f_tile, gamma, beta, m0, n0, e_sums, e_parts);
    }
    __syncthreads();

    warp_mma(dk, plain(f_tile), m0, plain(k_tile), k0, 0, kChunk);
    warp_mma(dk, transposed(f_tile), m0, plain(k_tile), k0, 0, kChunk);

    if (tid < kChunk) {
      const int r = tid;
      float dg = 0.f, db = 0.f;
      if (r < rows) {
        for (int s = 0; s < K / kKeySlice; ++s) {
          dg += p.dgamma_part[(static_cast<std::int64_t>(s) * p.tokens + t0 + r) * p.HV + hv];
        }
        const float x = k_dots[r] + k_dots[kChunk + r];
        dg += decay_balance(e_parts, r) + beta_decay[r] * x;
        db = beta_dots[r] + beta_dots[kChunk + r] + __expf(gamma[r].x + gamma[r].y) * x + e_sums[r] +
             e_sums[kChunk + r];
      }
      dgamma[r] = dg;
      if (r < rows) store_gate<E>(p.dbeta, (t0 + r) * p.HV + hv, p.beta_float, db);
    }
    __syncthreads();
    store_chunk_dg<E>(p, dgamma, t0, rows, hv, threadIdx.x);
    __syncthreads();  // this head's tiles and sums are read; the next head's may overwrite them
  }
  // dK is complete here. With the L2 norm it goes through its backward, dk = rstd (dk_hat - k_hat (k_hat .
  // dk_hat)) with k_hat = k rstd: the raw keys in the dead dW tile, their rstd in the dead dgamma vector.
  if (p.l2norm) {
    load_chunk_rows<kWyThreads>(dw_tile, p.k, p.H, h, K, 0, chunk, tid);
    cp_async_commit();
    float* const rstd = dgamma;
    if (tid < kChunk) rstd[tid] = tid < rows ? p.k_rstd[(t0 + tid) * p.H + h] : 0.f;
    cp_async_wait<0>();
    __syncthreads();
    float sums[2];
    row_dots(dk, dw_tile, m0, k0, sums);  // raw k . dk_hat over the warp's half of the keys
    store_row_pair(sums, k_dots, m0, n0);
    __syncthreads();
    for_each(dk, m0, k0, [&](int r, int c, float& x) {
      const float k_hat_dot = rstd[r] * (k_dots[r] + k_dots[kChunk + r]);
      x = rstd[r] * (x - to_float(dw_tile(r, c)) * rstd[r] * k_hat_dot);
    });
  }
  store_pairs(dk, static_cast<E*>(p.dk) + ((t0 + m0) * p.H + h) * K + k0, key_stride, rows - m0);
}

constexpr int kInputGradThreads = 256;
constexpr int kRowsPerBlock = kInputGradThreads / 32;  // a warp a row

// One warp per (token, q/k head): dq or dk (kKeys) from its rows in dq_head or dk_head, the GVA group's value
// heads summed in head order where the fused backward left one row each, through the L2 norm's backward
// dx = rstd (dx_hat - x_hat (x_hat . dx_hat)) where there is one, cast to the inputs' dtype. (chunk_grad's key
// slices each hold part of a row, so the row's dot is taken here.)
template <class E, int K, bool kKeys>
__global__ void __launch_bounds__(kInputGradThreads) input_grad_kernel(Params p) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= static_cast<std::int64_t>(p.tokens) * p.H) return;
  constexpr int kPerLane = K / 32;
  const int parts = p.fused_backward ? p.group : 1;
  const float* grad_hat = (kKeys ? p.dk_head : p.dq_head) + row * parts * K;
  float grad[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    grad[i] = grad_hat[lane + 32 * i];
    for (int part = 1; part < parts; ++part) grad[i] += grad_hat[part * K + lane + 32 * i];
  }
  E* out = static_cast<E*>(kKeys ? p.dk : p.dq) + row * K;
  if (!p.l2norm) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) out[lane + 32 * i] = from_float<E>(grad[i]);
    return;
  }
  const E* raw = static_cast<const E*>(kKeys ? p.k : p.q) + row * K;
  const float rstd = (kKeys ? p.k_rstd : p.q_rstd)[row];
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) dot += to_float(raw[lane + 32 * i]) * rstd * grad[i];
  dot = warp_sum(dot);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    out[lane + 32 * i] = from_float<E>(rstd * (grad[i] - to_float(raw[lane + 32 * i]) * rstd * dot));
  }
}

template <bool kKeys>
void launch_input_grad(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    const std::int64_t rows = static_cast<std::int64_t>(p.tokens) * p.H;
    launch<input_grad_kernel<E, K, kKeys>>(kKeys ? "gdn input_grad_kernel (dk)" : "gdn input_grad_kernel (dq)",
                                           dim3(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock)),
                                           dim3(kInputGradThreads), 0, kernels);
  });
}

}  // namespace

void launch_wy_grad(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    launch<wy_grad_kernel<E, K>>("gdn wy_grad_kernel", dim3(p.chunks, p.H), dim3(kWyThreads), WyGradSmem<E, K>::bytes,
           kernels);
  });
}

void launch_input_grads(const Params& p, DType io, KernelSequence& kernels) {
  if (p.fused_input_grads) return;  // the fused backward wrote both
  if (p.fused_backward || p.l2norm) launch_input_grad<false>(p, io, kernels);  // else chunk_grad wrote dq
  if (p.fused_backward) launch_input_grad<true>(p, io, kernels);              // else wy_grad wrote dk
}

}  // namespace deltatrain::gdn::cuda
