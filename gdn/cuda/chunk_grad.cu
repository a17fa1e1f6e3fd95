// Per (chunk, q/k head, slice of kKeySlice key columns), the value heads of its GVA group in turn: the
// gradients that need the states (docs/gdn-algorithm.md section 4), accumulated over 64-wide blocks of V:
//   dQ  = scale e^gamma (dO S^T) + M K                 M  = (dO Delta^T) * scale Gamma, lower incl.
//   dK  = e^(gamma_last - gamma) (Delta dS'^T) + M^T Q
//   dW  = -D S^T                                        D = dDelta (from the reverse pass)
//   dgamma: rowdot(dQ_state, Q) - rowdot(dK_state, K) + rowsum(G) - colsum(G), G = (dO Delta^T) * P,
//           and at the chunk's last row sum(dK_state * K) + e^gamma_last sum(S * dS').
// S = state entering the chunk, dS' = gradient of the state after it. Every slice forms dO Delta^T (its M
// is needed against the slice's keys); slice 0 adds the G terms. dQ and dK leave summed over the group (in
// head order), so they are written once per q/k head, not once per value head; dQ as the final gradient
// where there is no L2 norm to take it through. The V side of the WY backward is in wy_grad.cu, so that the
// accumulators here fit two CTAs per SM.
#include "chunk.cuh"
#include "dispatch.cuh"
#include "launch.h"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kGradThreads = 256;  // 8 warps: two sides (dQ and dP, dK and dW) x four 32 x 32 quadrants

template <class E>
struct ChunkGradSmem {
  // Every tile is 64 x 64: tokens or V columns by keys of the slice, V columns or tokens.
  static_assert(kKeySlice == kChunk);
  using Square = Tile<E, kChunk, kChunk>;
  static constexpr int q = 0;
  static constexpr int k = q + Square::kBytes;
  static constexpr int p = k + Square::kBytes;
  static constexpr int s = p + Square::kBytes;  // then M, once the V loop is done
  static constexpr int ds = s + Square::kBytes;
  static constexpr int d_o = ds + Square::kBytes;
  static constexpr int delta = d_o + Square::kBytes;
  static constexpr int ddelta = delta + Square::kBytes;
  static constexpr int gamma = ddelta + Square::kBytes;
  static constexpr int gate_in = gamma + kChunk * 8;  // e^gamma, then e^(gamma_last - gamma); gamma is hi + lo
  static_assert(gamma % 16 == 0, "for_each_decay reads two columns' gamma as one float4");
  static constexpr int q_dots = gate_in + 2 * kChunk * 4;  // [2 column halves][64 rows]
  static constexpr int k_dots = q_dots + 2 * kChunk * 4;
  static constexpr int g_parts = k_dots + 2 * kChunk * 4;  // store_row_column_sums of G
  static constexpr int scratch = g_parts + 6 * kChunk * 4;
  // Per thread, its 32 values of dQ or dK summed over the group, lane-minor (kept out of the registers,
  // which two CTAs per SM leave no room for).
  static constexpr int group_sums = scratch + 8 * 4;
  static constexpr int bytes = group_sums + kGradThreads * 32 * 4;  // 32: a warp's 32 x 32 quadrant per lane
};

// The row sums of a warp's 32 x 32 accumulator into a [2 column halves][64 rows] table (store_row_pair).
__device__ __forceinline__ void store_row_sums(const float (&sums)[4], float* table, int m0, int n0) {
  store_row_pair({sums[0], sums[1]}, table, m0, n0);
  store_row_pair({sums[2], sums[3]}, table, m0 + 16, n0);
}

template <class E, int K>
__global__ void __launch_bounds__(kGradThreads, 2) chunk_grad_kernel(Params p) {
  using L = ChunkGradSmem<E>;
  using Square = typename L::Square;
  extern __shared__ __align__(16) char smem[];
  const Square q_tile{smem_at<E>(smem, L::q)}, k_tile{smem_at<E>(smem, L::k)}, p_tile{smem_at<E>(smem, L::p)};
  const Square s_tile{smem_at<E>(smem, L::s)}, ds_tile{smem_at<E>(smem, L::ds)};
  const Square do_tile{smem_at<E>(smem, L::d_o)}, delta_tile{smem_at<E>(smem, L::delta)};
  const Square ddelta_tile{smem_at<E>(smem, L::ddelta)};
  const Square m_tile = s_tile;
  float2* gamma = smem_at<float2>(smem, L::gamma);
  float* gate_in = smem_at<float>(smem, L::gate_in);
  float* gate_out = gate_in + kChunk;
  float* q_dots = smem_at<float>(smem, L::q_dots);
  float* k_dots = smem_at<float>(smem, L::k_dots);
  float* g_parts = smem_at<float>(smem, L::g_parts);

  // The slices of a chunk are neighbours in the grid, so the second one finds dO, Delta, dDelta and gamma in L2.
  constexpr int kSlices = K / kKeySlice;
  const int chunk_index = blockIdx.x / kSlices, slice = blockIdx.x % kSlices, h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32;
  // Warps 0-3 hold dQ and dP (dO is the A of both), warps 4-7 dK and dW, each a 32 x 32 quadrant: twice the
  // products per fragment that 16 x 32 blocks of all four gave, so a third fewer shared-memory loads.
  const bool queries_side = warp < 4;
  const int m0 = 32 * (warp % 4 / 2), n0 = 32 * (warp % 2);
  const ChunkInfo chunk = p.chunk_table[chunk_index];
  const std::int64_t t0 = chunk.start;
  const int rows = chunk.length, key0 = slice * kKeySlice;

  load_chunk_rows<kGradThreads>(q_tile, queries<E>(p), p.H, h, K, key0, chunk, tid);
  load_chunk_rows<kGradThreads>(k_tile, keys<E>(p), p.H, h, K, key0, chunk, tid);
  // first: dQ (queries side) or dK of the current value head; second: dP or dW. Their sum over the group, in
  // head order, goes to this thread's column of group_sums (value e of `first` at row e of the column).
  float first[2][4][4], second[2][4][4];
  constexpr int kValues = sizeof(first) / sizeof(float);
  float* const values = &first[0][0][0];
  float* const group_sum = smem_at<float>(smem, L::group_sums) + warp * kValues * 32 + tid % 32;
#pragma unroll 1
  for (int hv = h * p.group; hv < (h + 1) * p.group; ++hv) {
    if (slice == 0) load_lower_chunk_tile<kGradThreads>(p_tile, p.p, p.HV, hv, chunk, tid);  // for G alone
    load_gamma_async(p, gamma, hv, chunk, tid);
    load_gates_async(p, gate_in, gate_out, hv, chunk, tid);

    zero(first);
    zero(second);
    float state_dot = 0.f;
    const std::int64_t state_row = static_cast<std::int64_t>(chunk_index * p.HV + hv) * p.V;
#pragma unroll 1
    for (int vb = 0; vb < p.V; vb += 64) {
      load_chunk_rows<kGradThreads>(do_tile, p.d_o, p.HV, hv, p.V, vb, chunk, tid);
      load_chunk_rows<kGradThreads>(delta_tile, p.delta, p.HV, hv, p.V, vb, chunk, tid);
      load_chunk_rows<kGradThreads>(ddelta_tile, p.ddelta, p.HV, hv, p.V, vb, chunk, tid);
      load_rows_async<kGradThreads>(s_tile, static_cast<const E*>(p.states) + (state_row + vb) * K + key0, K, 64, tid);
      load_rows_async<kGradThreads>(ds_tile, static_cast<const E*>(p.dstates) + (state_row + vb) * K + key0, K, 64,
                                    tid);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();

      if (queries_side) {
        warp_mma(first, plain(do_tile), m0, plain(s_tile), n0, 0, 64);
        warp_mma(second, plain(do_tile), m0, transposed(delta_tile), n0, 0, 64);
      } else {
        warp_mma(first, plain(delta_tile), m0, plain(ds_tile), n0, 0, 64);
        warp_mma(second, plain(ddelta_tile), m0, plain(s_tile), n0, 0, 64);
      }
      state_dot += partial_tile_dot<kGradThreads>(s_tile, ds_tile, tid);
      __syncthreads();  // the tiles are free for the next block
    }

    float row_dot_sums[4];
    if (queries_side) {
      // M (into the dead S tile) and G from dP = dO Delta^T. A factor exp(gamma_i - gamma_j) gives +x to
      // dgamma_i and -x to dgamma_j; for i == j the factor is 1 and the two cancel exactly, so G's diagonal
      // is left out rather than summed and subtracted (under strong decay the true dgamma is tiny and such
      // rounding would swamp it).
      if (n0 > m0) {  // the warp's quadrant lies above the diagonal, where M is zero
        for_each(second, m0, n0, [&](int r, int c, float&) { m_tile(r, c) = from_float<E>(0.f); });
      } else {
        for_each_decay<2, 4>(gamma, m0, n0, [&](int r, int c, float decay, FragmentIndex at) {
          const float m = at(second) * p.scale * decay;
          m_tile(r, c) = from_float<E>(r >= c ? m : 0.f);
        });
      }
      if (slice == 0) {
        for_each(second, m0, n0, [&](int r, int c, float& x) { x = r > c ? x * to_float(p_tile(r, c)) : 0.f; });
        store_row_column_sums(row_block(second, 0), m0, n0, g_parts);
        store_row_column_sums(row_block(second, 1), m0 + 16, n0, g_parts);
      }
      // dQ (state part) and its dgamma term.
      for_each(first, m0, n0, [&](int r, int, float& x) { x *= p.scale * gate_in[r]; });
      row_dots(first, q_tile, m0, n0, row_dot_sums);
      store_row_sums(row_dot_sums, q_dots, m0, n0);
    } else {
      // dW; dK (state part) and its dgamma term.
      for_each(second, m0, n0, [&](int, int, float& x) { x = -x; });
      store_pairs(second, static_cast<E*>(p.dw) + ((t0 + m0) * p.HV + hv) * K + key0 + n0,
                  static_cast<std::int64_t>(p.HV) * K, rows - m0);
      for_each(first, m0, n0, [&](int r, int, float& x) { x *= gate_out[r]; });
      row_dots(first, k_tile, m0, n0, row_dot_sums);
      store_row_sums(row_dot_sums, k_dots, m0, n0);
    }
    __syncthreads();  // M, the G sums and the row dots are complete

    // dQ += M K and dK += M^T Q; M is lower triangular, so rows m0.. of M need columns below m0 + 32 and
    // rows m0.. of M^T columns from m0.
    if (queries_side) {
      warp_mma(first, plain(m_tile), m0, plain(k_tile), n0, 0, m0 + 32);
    } else {
      warp_mma(first, transposed(m_tile), m0, plain(q_tile), n0, m0, 64);
    }
#pragma unroll
    for (int e = 0; e < kValues; ++e) group_sum[32 * e] = hv == h * p.group ? values[e] : group_sum[32 * e] + values[e];

    const float total_state_dot = block_sum<kGradThreads>(state_dot, smem_at<float>(smem, L::scratch));
    if (tid < rows) {
      const int r = tid, last = rows - 1;
      float dgamma = q_dots[r] + q_dots[kChunk + r];
      if (slice == 0) dgamma += decay_balance(g_parts, r);
      if (r == last) {
        for (int c = 0; c < last; ++c) dgamma += k_dots[c] + k_dots[kChunk + c];
        dgamma += gate_in[kChunk - 1] * total_state_dot;  // e^gamma_last
      } else {
        dgamma -= k_dots[r] + k_dots[kChunk + r];
      }
      p.dgamma_part[(static_cast<std::int64_t>(slice) * p.tokens + t0 + r) * p.HV + hv] = dgamma;
    }
    __syncthreads();  // this head's P, gamma, M and sums are read; the next head's may overwrite them
  }
#pragma unroll
  for (int e = 0; e < kValues; ++e) values[e] = group_sum[32 * e];
  const std::int64_t key_stride = static_cast<std::int64_t>(p.H) * K;
  const std::int64_t tile_origin = ((t0 + m0) * p.H + h) * K + key0 + n0;
  if (!queries_side) {
    store_pairs(first, p.dk_head + tile_origin, key_stride, rows - m0);
  } else if (p.l2norm) {
    store_pairs(first, p.dq_head + tile_origin, key_stride, rows - m0);
  } else {  // dQ is complete here: without the L2 norm it is the gradient itself, in the inputs' dtype
    store_pairs(first, static_cast<E*>(p.dq) + tile_origin, key_stride, rows - m0);
  }
}

}  // namespace

void launch_chunk_grad(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    launch<chunk_grad_kernel<E, K>>("gdn chunk_grad_kernel", dim3(p.chunks * (K / kKeySlice), p.H), dim3(kGradThreads),
                                    ChunkGradSmem<E>::bytes, kernels);
  });
}

}  // namespace deltatrain::gdn::cuda
