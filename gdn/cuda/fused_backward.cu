// The backward after the recompute pass in one kernel (bench/NOTES.md, GDN next steps 9 and 11; its math is
// bench/prototypes/fused_backward.py's, checked there in float64 against the recurrence). A CTA per (sequence,
// value head) walks the sequence's chunks in reverse holding dS'^T, the gradient of the state leaving the chunk,
// in float32 registers: warp w owns value rows 16 w .. 16 w + 15 with all K keys, so the dependent chain from
// one chunk to the next is each warpgroup's own wgmma products (its 64 rows; B operands from 128-byte-swizzled
// tiles of K, Q, P and T), with no barrier in it. Where the plan segments the call, a CTA per (sequence, segment,
// value head) walks its segment's chunks from that segment's exact dS' (the backward's segment ends pass and
// segment_starts_kernel compose it), so few sequences still fill the GPU. Per chunk, from Q, K, V, dO, the
// gates, beta, T and P (prepare's), and S, the state entering the chunk, and Delta (the recompute pass's):
//   the chain (wgmma):     KdS^T = dS'^T K^T,  dDelta^T = dO^T P + KdS^T diag(D),  tdd^T = dDelta^T T,
//                          dcorr^T = tdd^T diag(beta),  dS^T = E_n dS'^T + scale dO^T diag(E) Q - dcorr^T diag(E) K
//   beside it, per warp:   corr^T = V^T - (S^T K^T) diag(E), and dbeta's rowsum(corr * tdd) over its rows
//   over V, all warps:     dP = dO Delta^T,  dT = dDelta (diag(beta) corr)^T,  K K^T,
//                          dA = -T^T dT T^T (strictly lower),  M = scale dP * Gamma (lower),
//                          F = dA * beta Gamma,  E_ = dA * K K^T * Gamma (strictly lower)
//                          dQ = scale diag(E) dO S^T + M K
//                          dK = -diag(E) dcorr S^T + diag(D) Delta dS'^T + M^T Q + F K + F^T K
//                          dV = dcorr;  dbeta = rowsum(corr * tdd) + rowsum(E_);  dgamma, reverse-summed into dg
// with E = e^gamma, D = e^(gamma_last - gamma) and E_n the chunk's whole decay. dV, dg, dbeta and dh0 are final
// here. dQ and dK are summed over the GVA group, taken through the L2 norm's backward where there is one and cast
// (InputGrads): here where the group is one value head, or two as a cluster pair that meets through distributed
// shared memory; for larger groups they leave per value head in float32 for input_grad_kernel. No atomics: every
// sum runs in a fixed order.
#include "dispatch.cuh"
#include "launch.h"
#include "sequential.cuh"
#include "wgmma.cuh"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kFusedThreads = 256;  // 2 warpgroups of 64 value rows in the chain; 16 x 32 or 16 x 64 blocks over V
constexpr int kFusedWarps = kFusedThreads / 32;

// The tile with its shared address made opaque at this point of the program, so that the wgmma descriptors formed
// from it are formed here, at their use, and not hoisted out of the chunk loop as loop invariants (about a
// hundred of them, two registers each, which spilled).
template <class TileT>
__device__ __forceinline__ TileT at_use(TileT tile) {
  asm volatile("" : "+r"(tile.base));
  return tile;
}

template <class E>
struct FusedBackwardSmem {
  static constexpr int K = 128, V = 128;  // the kernel's head dims (plan_execution's fused_backward_applies)
  static_assert(V == 16 * kFusedWarps, "each warp owns 16 value rows of the state");
  // Every tile is a wgmma operand, 128-byte swizzled; the mma.sync products and the element-wise code address
  // them too (AddressableSwizzledTile).
  using Rows = AddressableSwizzledTile<E, kChunk, 128>;  // a chunk's rows: k, q, v, dO, Delta; dDelta, dcorr, beta corr
  using State = AddressableSwizzledTile<E, V, K>;         // S^T, dS'^T
  using Square = AddressableSwizzledTile<E, kChunk, kChunk>;  // P, T, M, dT^T, X, F
  static constexpr int k = 0;  // each tile starts 1024-byte aligned
  static constexpr int q = k + Rows::kBytes;
  static constexpr int p_then_x = q + Rows::kBytes;  // X = T^T dT once G is summed
  static constexpr int t = p_then_x + Square::kBytes;
  // Each warp reads only its own columns of V and later writes dcorr to the same columns, so they share a tile.
  static constexpr int v_then_dcorr = t + Square::kBytes;
  static constexpr int d_o = v_then_dcorr + Rows::kBytes;
  static constexpr int delta = d_o + Rows::kBytes;
  static constexpr int ddelta_then_m = delta + Rows::kBytes;         // M once dT is formed
  static constexpr int bcorr_then_dt_f = ddelta_then_m + Rows::kBytes;  // dT^T, then F once X is formed
  // A cluster pair's float32 partial for the partner, in the dead M and F tiles from the chunk's last products to
  // the next chunk's dDelta: tiles the next chunk's copies leave alone, so they need not wait for the partner.
  static constexpr int partner_partial = ddelta_then_m;
  static_assert(2 * Rows::kBytes == kChunk * K * 4, "a 64 x 128 float32 matrix in the two tiles");
  static constexpr int s = bcorr_then_dt_f + Rows::kBytes;
  static constexpr int ds = s + State::kBytes;
  // dV token-major, staged by stmatrix from the chain's registers and written as whole rows with 16-byte stores
  // (element by element, its transposed 2-byte stores waited on memory in the chain).
  static constexpr int dv_stage = ds + State::kBytes;
  static constexpr int gamma = dv_stage + Rows::kBytes;  // hi + lo (chunk.cuh)
  static_assert(gamma % 16 == 0, "for_each_decay reads two columns' gamma as one float4");
  static constexpr int gate_in = gamma + kChunk * 8;  // E
  static constexpr int gate_out = gate_in + kChunk * 4;  // D
  static constexpr int beta = gate_out + kChunk * 4;
  static constexpr int beta_parts = beta + kChunk * 4;              // [warp][64]: rowsum(corr * tdd) per warp
  static constexpr int g_parts = beta_parts + kFusedWarps * kChunk * 4;  // store_row_column_sums of G
  static constexpr int e_parts = g_parts + 6 * kChunk * 4;          // the same of beta E_
  static constexpr int e_sums = e_parts + 6 * kChunk * 4;           // [2 column halves][64]: rowsum(E_)
  static constexpr int q_dots = e_sums + 2 * kChunk * 4;            // rowdot(scale E dO S^T, Q)
  static constexpr int corr_parts = q_dots + 2 * kChunk * 4;        // [warp][64]: rowsum(dcorr * K S) per warp
  static constexpr int delta_parts = corr_parts + kFusedWarps * kChunk * 4;  // [warp][64]: rowsum(Delta * K dS')
  static constexpr int dgamma = delta_parts + kFusedWarps * kChunk * 4;
  static constexpr int norm_dots = dgamma + kChunk * 4;  // [dq, dk][2 column halves][64]: x_hat . dx_hat per row
  static constexpr int scratch = norm_dots + 2 * 2 * kChunk * 4;
  // Dynamic shared memory is not promised 1024-byte alignment: the kernel rounds its start up.
  static constexpr int bytes = scratch + kFusedWarps * 4 + 1024;
  static_assert(bytes <= kSmemLimit);
};

// dq or dk of one q/k head, this warp's 16 x 64 block of the chunk's rows at (m0, n0) summed over the GVA group,
// through the L2 norm's backward dx = rstd (dx_hat - x_hat (x_hat . dx_hat)) where there is one, x_hat being the
// normalised rows the forward's products used (the Q or K tile): the rows' dots over the warp's columns first,
// into dots ([2 column halves][64]) ...
template <class TileT>
__device__ __forceinline__ void store_norm_dots(const Params& p, float (&grad)[1][8][4], TileT normalised,
                                                float* dots, int m0, int n0) {
  if (!p.l2norm) return;
  float sums[2];
  row_dots(grad, normalised, m0, n0, sums);
  store_row_pair(sums, dots, m0, n0 / 2);
}
// ... then, once every warp's are stored, dx, cast and written (rstd: of rows m0 + g and m0 + g + 8).
template <class E, class TileT>
__device__ __forceinline__ void finish_input_grad(const Params& p, float (&grad)[1][8][4], TileT normalised,
                                                  const float* dots, const float (&rstd)[2], E* out,
                                                  std::int64_t stride, int rows, int m0, int n0) {
  if (p.l2norm) {
    for_each_pair_with(grad, plain(normalised), m0, n0, [&](int r, int, float& lo, float& hi, float2 x) {
      const float dot = dots[r] + dots[kChunk + r], scale = r - m0 < 8 ? rstd[0] : rstd[1];
      lo = scale * (lo - x.x * dot);
      hi = scale * (hi - x.y * dot);
    });
  }
  store_pairs(grad, out + m0 * stride + n0, stride, rows - m0);
}

template <class E, InputGrads kInputGrads>
__device__ __forceinline__ void fused_backward(const Params& p) {
#ifdef DELTATRAIN_WGMMA
  using L = FusedBackwardSmem<E>;
  constexpr int K = L::K, V = L::V;
  using Rows = typename L::Rows;
  using Square = typename L::Square;
  using State = typename L::State;
  extern __shared__ __align__(16) char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  char* const smem = smem_raw + ((raw + 1023) / 1024 * 1024 - raw);
  auto rows_tile = [&](int at) { return swizzled_tile<E, kChunk, 128>(smem + at); };
  auto square_tile = [&](int at) { return swizzled_tile<E, kChunk, kChunk>(smem + at); };
  const Rows k_tile = rows_tile(L::k), q_tile = rows_tile(L::q), v_tile = rows_tile(L::v_then_dcorr);
  const Rows dcorr_tile = v_tile, do_tile = rows_tile(L::d_o), delta_tile = rows_tile(L::delta);
  const Rows ddelta_tile = rows_tile(L::ddelta_then_m), bcorr_tile = rows_tile(L::bcorr_then_dt_f);
  const Rows dv_tile = rows_tile(L::dv_stage);
  const Square p_tile = square_tile(L::p_then_x), x_tile = p_tile, t_tile = square_tile(L::t);
  const Square m_tile = square_tile(L::ddelta_then_m), dt_tile = square_tile(L::bcorr_then_dt_f), f_tile = dt_tile;
  const State s_tile = swizzled_tile<E, V, K>(smem + L::s), ds_tile = swizzled_tile<E, V, K>(smem + L::ds);
  float2* gamma = smem_at<float2>(smem, L::gamma);
  float* gate_in = smem_at<float>(smem, L::gate_in);
  float* gate_out = smem_at<float>(smem, L::gate_out);
  float* beta = smem_at<float>(smem, L::beta);
  float* beta_parts = smem_at<float>(smem, L::beta_parts);
  float* g_parts = smem_at<float>(smem, L::g_parts);
  float* e_parts = smem_at<float>(smem, L::e_parts);
  float* e_sums = smem_at<float>(smem, L::e_sums);
  float* q_dots = smem_at<float>(smem, L::q_dots);
  float* corr_parts = smem_at<float>(smem, L::corr_parts);
  float* delta_parts = smem_at<float>(smem, L::delta_parts);
  float* dgamma = smem_at<float>(smem, L::dgamma);
  [[maybe_unused]] float* q_norm_dots = smem_at<float>(smem, L::norm_dots);
  [[maybe_unused]] float* k_norm_dots = q_norm_dots + 2 * kChunk;
  // [8][threads]: a thread's 32 values
  [[maybe_unused]] float4* partner_partial = smem_at<float4>(smem, L::partner_partial);
  constexpr bool kPair = kInputGrads == InputGrads::cluster_pair;
  [[maybe_unused]] const unsigned rank = kPair ? cluster_rank() : 0;
  [[maybe_unused]] const bool sums_keys = rank == 1;  // of a cluster pair

  // Runs are the sequence's segments in the order the reverse walk takes them (run 0 is the last segment).
  const int runs = p.segments, n = blockIdx.x / runs, run = blockIdx.x % runs, hv = blockIdx.y, h = hv / p.group;
  const int tid = threadIdx.x, warp = tid / 32;
  const int vr0 = 16 * warp;  // the warp's value rows of the state (the chain)
  // Blocks of the products over V: 16 x 32 of a 64 x 64 result, 16 x 64 of a 64 x 128 one.
  const int block_m0 = 16 * (warp % 4), block_n0 = 32 * (warp / 4);
  const StateRows at{vr0, 0};  // the warp's rows of dS^T, for dht, the segments' starts and dh0

  const SequenceChunks chunks = SequenceChunks(p, n).segment(runs - 1 - run, runs);
  // A chunk's tiles, in copy groups that each start as soon as the chunk before (in the walk) has done with their
  // tiles, so that the copies run under its last products and sums rather than after them: the square tiles P and T
  // once the inverse's backward has read them, the value-wide V (dcorr), dO and Delta after the last products, the
  // key-wide Q, K and S after the last readers of Q and K (the norm's backward, dq's dots) and S (dQ's and dK's
  // products). The gates, which the per-token sums read to the end, are a group of their own (load_chunk_gates).
  // beta goes with the value tiles, but into a register of warps 2 and 3 (threads 64..127), and reaches its shared
  // vector only at the chunk's end (store_beta): loaded there, behind the key tiles' copies, it came back after them,
  // and the barrier after the per-token sums waited for it (ncu on an H100, bwd 16/32 1x8192 and 2/4 1x32768: 2.3% of
  // the samples on the load, 6-7% at that barrier).
  float next_beta = 0.f;
  auto load_square_tiles = [&](int j) {
    const ChunkInfo chunk = chunks[j];
    load_lower_chunk_tile<kFusedThreads>(p_tile, p.p, p.HV, hv, chunk, tid);
    load_lower_chunk_tile<kFusedThreads>(t_tile, p.t, p.HV, hv, chunk, tid);
    cp_async_commit();
  };
  auto load_value_tiles = [&](int j) {
    const ChunkInfo chunk = chunks[j];
    const int r = tid - kChunk;
    if (r >= 0 && r < kChunk) {
      next_beta = r < chunk.length ? load_gate<E>(p.beta, (chunk.start + r) * p.HV + hv, p.beta_float) : 0.f;
    }
    load_chunk_rows<kFusedThreads>(v_tile, p.v, p.HV, hv, V, 0, chunk, tid);
    load_chunk_rows<kFusedThreads>(do_tile, p.d_o, p.HV, hv, V, 0, chunk, tid);
    load_chunk_rows<kFusedThreads>(delta_tile, p.delta, p.HV, hv, V, 0, chunk, tid);
    cp_async_commit();
  };
  auto load_key_tiles = [&](int j) {
    const ChunkInfo chunk = chunks[j];
    const int c = chunks.first + j;
    load_chunk_rows<kFusedThreads>(q_tile, queries<E>(p), p.H, h, K, 0, chunk, tid);
    load_chunk_rows<kFusedThreads>(k_tile, keys<E>(p), p.H, h, K, 0, chunk, tid);
    const std::int64_t state_row = (static_cast<std::int64_t>(c) * p.HV + hv) * V;
    load_rows_async<kFusedThreads>(s_tile, static_cast<const E*>(p.states) + state_row * K, K, V, tid);
    cp_async_commit();
  };
  auto store_beta = [&] {
    const int r = tid - kChunk;
    if (r >= 0 && r < kChunk) beta[r] = next_beta;
  };
  auto load_chunk_gates = [&](int j) {
    const ChunkInfo chunk = chunks[j];
    load_gamma_async(p, gamma, hv, chunk, tid);
    load_gates_async(p, gate_in, gate_out, hv, chunk, tid);
    cp_async_commit();
  };

  // dS'^T of the run's last chunk: the final state's gradient ([K][V] in memory) for the last segment, else the
  // gradient at the next segment's start that steps 1 and 2 composed ([V][K]).
  float ds[1][K / 8][4];
  if (run == 0) {
    load_state(ds, p.dht, p, n, hv, at);
  } else {
    load_pairs(ds, segment_start_rows<true>(p, n, run, hv) + at.v0 * K, K, 16);
  }

  // The partner's reads of this CTA's partial end on the cluster barrier's second phase: arrived here for the first
  // chunk, waited before the M and F tiles are overwritten, arrived again once the partner's partial is read.
  if constexpr (kPair) cluster_arrive();
  if (chunks.count > 0) {
    load_key_tiles(chunks.count - 1);
    load_square_tiles(chunks.count - 1);
    load_value_tiles(chunks.count - 1);
    load_chunk_gates(chunks.count - 1);
    store_beta();
  }
#pragma unroll 1
  for (int j = chunks.count - 1; j >= 0; --j) {
    // The block offsets made opaque each chunk, so that the addresses derived from them are formed where used
    // instead of hoisted out of the loop into registers, which spilled.
    int m0 = block_m0, n0 = block_n0;
    asm volatile("" : "+r"(m0), "+r"(n0));
    const int n0_keys = 2 * n0;
    const ChunkInfo chunk = chunks[j];
    const std::int64_t t0 = chunk.start;
    const int rows = chunk.length;
    cp_async_wait<0>();
    fence_for_wgmma();  // the copies of K, Q, P and T, which the chain's wgmma read
    __syncthreads();  // the chunk's tiles and vectors

    // ---- the chain, each warpgroup on its 64 value rows by wgmma, and the warp's value rows beside it ----
    float tdd[1][kChunk / 8][4];  // dO^T P, then dDelta^T, then (T^T dDelta)^T, then dcorr^T
    float state_dot = 0.f;
    WarpOperand<E, kChunk> do_operand(nullptr);  // dO^T, the warp's rows
#pragma unroll
    for (int kb = 0; kb < kChunk / 16; ++kb) load_a16(do_operand.frag[kb], transposed(do_tile), vr0, 16 * kb);
    {
      WarpOperand<E, K> ds_operand(nullptr);
      ds_operand.set(ds, 1.f);
      float kds[1][kChunk / 8][4];  // KdS^T
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < K / 16; ++kb) {
        wgmma_64x64x16<E, false>(kds[0], ds_operand.frag[kb], k_major(at_use(k_tile), 16 * kb), kb > 0);
      }
#pragma unroll
      for (int kb = 0; kb < kChunk / 16; ++kb) {
        wgmma_64x64x16<E, true>(tdd[0], do_operand.frag[kb], mn_major(at_use(p_tile), 16 * kb, 0), kb > 0);
      }
      wgmma_commit();
      ds_operand.store(plain(ds_tile), vr0);  // dS' beside the products, for dK
      wgmma_wait();
      hold(kds[0]);
      hold(tdd[0]);
      for_each(tdd, kds, vr0, 0, [&](int, int c, float& x, float& kd) { x += gate_out[c] * kd; });
      for_each_pair_with(kds, transposed(delta_tile), vr0, 0, [](int, int, float& lo, float& hi, float2 delta) {
        lo *= delta.x;  // Delta * K dS', dgamma's D term
        hi *= delta.y;
      });
      store_column_sums(kds, delta_parts + warp * kChunk, 0);
    }
    WarpOperand<E, kChunk> ddelta_operand(nullptr);
    ddelta_operand.set(tdd, 1.f);
    float corr[1][kChunk / 8][4];  // (K S)^T beside the chain: S^T's rows of this warpgroup times K^T
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < kChunk / 16; ++kb) {
      wgmma_64x64x16<E, true>(tdd[0], ddelta_operand.frag[kb], mn_major(at_use(t_tile), 16 * kb, 0), kb > 0);
    }
    wgmma_ss_product<E, false, false, K / 16>(corr[0], [&](int k0) { return k_major(at_use(s_tile), k0, vr0 & ~63); },
                                              [&](int k0) { return k_major(at_use(k_tile), k0); }, false);
    wgmma_commit();
    if constexpr (kPair) cluster_wait();  // the partner has read the last chunk's partial from the tiles dDelta takes
    ddelta_operand.store(transposed(ddelta_tile), vr0);  // dDelta for dT, beside the products
    wgmma_wait();
    hold(tdd[0]);
    hold(corr[0]);
    {  // corr^T: its beta-scaled copy for dT, and dbeta's and dgamma's parts from it and K S
      float dcorr_ks[1][kChunk / 8][4];
      for_each(dcorr_ks, corr, vr0, 0, [](int, int, float& x, float& ks) { x = ks; });
#pragma unroll
      for (int kb = 0; kb < kChunk / 16; ++kb) {  // 16 columns at a time: V's and corr's in flight, not all
        float(&block)[1][2][4] = column_block<2>(corr, 2 * kb);
        float(&tdd_block)[1][2][4] = column_block<2>(tdd, 2 * kb);
        for_each_pair_with(block, transposed(v_tile), vr0, 16 * kb, [&](int, int c, float& lo, float& hi, float2 v) {
          lo = v.x - gate_in[c] * lo;
          hi = v.y - gate_in[c + 1] * hi;
        });
        store_accumulator(block, transposed(bcorr_tile), vr0, 16 * kb,
                          [&](float x, int, int c) { return beta[c] * x; });
        for_each(block, tdd_block, vr0, 16 * kb, [&](int, int c, float& x, float& td) {
          x *= td;        // corr * T^T dDelta, dbeta's
          td *= beta[c];  // dcorr
        });
      }
      store_column_sums(corr, beta_parts + warp * kChunk, 0);
      for_each(dcorr_ks, tdd, vr0, 0, [](int, int, float& x, float& dcorr) { x *= dcorr; });  // dgamma's E term
      store_column_sums(dcorr_ks, corr_parts + warp * kChunk, 0);
    }
    // dS' to E_n dS', and this thread's part of sum(S * dS') on the way (dgamma's at the chunk's last row): from dS'
    // in float32 registers and the warp's rows of S^T, half the instructions of a dot of the two tiles.
    for_each_pair_with(ds, plain(s_tile), vr0, 0, [&](int, int, float& lo, float& hi, float2 s) {
      state_dot += lo * s.x + hi * s.y;
      lo *= gate_in[kChunk - 1];
      hi *= gate_in[kChunk - 1];
    });
    __syncwarp();  // the warp's lanes have read their columns of V, which dcorr now overwrites
    // dV = dcorr, staged from the registers (-E dcorr, dK's A operand, goes to its tile beside the products below).
    store_accumulator(tdd, transposed(dv_tile), vr0, 0);
    do_operand.scale_columns(gate_in, p.scale);
    {
      WarpOperand<E, kChunk> dcorr_operand(nullptr);
      dcorr_operand.set(tdd, -1.f, gate_in);
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < kChunk / 16; ++kb) {
#pragma unroll
        for (int nb = 0; nb < K / 64; ++nb) {
          float(&half)[8][4] = *reinterpret_cast<float(*)[8][4]>(&ds[0][8 * nb]);
          wgmma_64x64x16<E, true>(half, do_operand.frag[kb], mn_major(at_use(q_tile), 16 * kb, 64 * nb));
          wgmma_64x64x16<E, true>(half, dcorr_operand.frag[kb], mn_major(at_use(k_tile), 16 * kb, 64 * nb));
        }
      }
      wgmma_commit();
      dcorr_operand.store(transposed(dcorr_tile), vr0);  // -E dcorr beside the products: dK's A operand
      wgmma_wait();
      hold(ds[0]);
    }
    fence_for_wgmma();
    __syncthreads();  // dDelta, dcorr, beta corr and dS' are in shared memory

    // ---- the products over V ----
    // Each warpgroup forms its 32 columns of the 64 x 64 products and its 64 of the 64 x 128 ones (wgmma, both
    // operands from shared memory), in the layout the mma.sync helpers hold: warp w has the 16 x 32 block at
    // (m0, n0) or the 16 x 64 one at (m0, n0_keys).
    float dp[1][4][4], kk[1][4][4];
    {
      float dt[1][4][4];
      wgmma_fence();
      // Operands of all 64 rows, and of the warpgroup's 32 rows of a K-major B.
      auto rows_a = [](const auto& tile) { return [&](int k0) { return k_major(at_use(tile), k0); }; };
      auto rows_b = [&](const auto& tile) { return [&](int k0) { return k_major(at_use(tile), k0, n0); }; };
      wgmma_ss_product<E, false, false, V / 16>(dp[0], rows_a(do_tile), rows_b(delta_tile), false);
      wgmma_ss_product<E, false, false, V / 16>(dt[0], rows_a(ddelta_tile), rows_b(bcorr_tile), false);
      wgmma_ss_product<E, false, false, K / 16>(kk[0], rows_a(k_tile), rows_b(k_tile), false);
      wgmma_commit_and_wait();
      hold(dp[0]);
      hold(dt[0]);
      hold(kk[0]);
      __syncthreads();  // dDelta and beta corr are read; M and dT^T take their place
      // dT transposed, so that it is X's B operand K-major (its columns are the warpgroup's rows there).
      store_accumulator(dt, transposed(dt_tile), m0, n0);
    }
    // M, and G = dP * P below the diagonal (its diagonal cancels exactly in dgamma, so it is left out rather
    // than added and subtracted: under strong decay that rounding would swamp the true dgamma).
    float decays[1][4][4];  // the blocks' chunk decays, M's and again the inverse's backward's
    {
      float m[1][4][4];
      for_each_decay<1, 4>(gamma, m0, n0, [&](int r, int c, float decay, FragmentIndex at) {
        at(decays) = decay;
        at(m) = r >= c ? at(dp) * p.scale * decay : 0.f;
      });
      store_accumulator(m, plain(m_tile), m0, n0);
    }
    for_each_pair_with(dp, plain(p_tile), m0, n0, [](int r, int c, float& lo, float& hi, float2 pv) {
      lo = r > c ? lo * pv.x : 0.f;
      hi = r > c + 1 ? hi * pv.y : 0.f;
    });
    store_row_column_sums(dp, m0, n0, g_parts);
    fence_for_wgmma();
    __syncthreads();  // dT and M complete, P read
    {
      float x[1][4][4];  // X = T^T dT
      wgmma_fence();
      wgmma_ss_product<E, true, false, kChunk / 16>(x[0], [&](int k0) { return mn_major(at_use(t_tile), k0, 0); },
                                                    [&](int k0) { return k_major(at_use(dt_tile), k0, n0); }, false);
      wgmma_commit_and_wait();
      hold(x[0]);
      store_accumulator(x, plain(x_tile), m0, n0);
    }
    fence_for_wgmma();
    __syncthreads();  // X complete, dT read
    {
      float da[1][4][4];  // -dA = X T^T
      wgmma_fence();
      wgmma_ss_product<E, false, false, kChunk / 16>(da[0], [&](int k0) { return k_major(at_use(x_tile), k0); },
                                                     [&](int k0) { return k_major(at_use(t_tile), k0, n0); }, false);
      wgmma_commit_and_wait();
      hold(da[0]);
      inverse_backward(da, kk, decays, f_tile, beta, m0, n0, e_sums, e_parts);
    }
    fence_for_wgmma();
    __syncthreads();  // F complete; P (X) and T are read
    if (j > 0) load_square_tiles(j - 1);

    // The warpgroup's 64 key columns of an MN-major B.
    auto keys_b = [&](const auto& tile) { return [&](int k0) { return mn_major(at_use(tile), k0, n0_keys); }; };
    // dQ = scale diag(E) dO S^T + M K and dK = diag(D) Delta dS'^T - diag(E) dcorr S^T + M^T Q + F K + F^T K (the
    // dcorr tile holds -E dcorr): the row-scaled products first, both in one group, then the rest in another.
    float dq[1][8][4], dk[1][8][4];
    wgmma_fence();
    wgmma_ss_product<E, false, true, V / 16>(dq[0], [&](int k0) { return k_major(at_use(do_tile), k0); },
                                             keys_b(s_tile), false);
    wgmma_ss_product<E, false, true, V / 16>(dk[0], [&](int k0) { return k_major(at_use(delta_tile), k0); },
                                             keys_b(ds_tile), false);
    wgmma_commit_and_wait();
    hold(dq[0]);
    hold(dk[0]);
    for_each(dq, dk, m0, n0_keys, [&](int r, int, float& q, float& k) {
      q *= p.scale * gate_in[r];
      k *= gate_out[r];
    });
    float sums[2];
    row_dots(dq, q_tile, m0, n0_keys, sums);
    store_row_pair(sums, q_dots, m0, n0);
    wgmma_fence();
    wgmma_ss_product<E, false, true, kChunk / 16>(dq[0], [&](int k0) { return k_major(at_use(m_tile), k0); },
                                                  keys_b(k_tile), true);  // + M K
    wgmma_ss_product<E, false, true, V / 16>(dk[0], [&](int k0) { return k_major(at_use(dcorr_tile), k0); },
                                             keys_b(s_tile), true);
    wgmma_ss_product<E, true, true, kChunk / 16>(dk[0], [&](int k0) { return mn_major(at_use(m_tile), k0, 0); },
                                                 keys_b(q_tile), true);  // + M^T Q
    wgmma_ss_product<E, false, true, kChunk / 16>(dk[0], [&](int k0) { return k_major(at_use(f_tile), k0); },
                                                  keys_b(k_tile), true);  // + F K
    wgmma_ss_product<E, true, true, kChunk / 16>(dk[0], [&](int k0) { return mn_major(at_use(f_tile), k0, 0); },
                                                 keys_b(k_tile), true);  // + F^T K
    wgmma_commit_and_wait();
    hold(dq[0]);
    hold(dk[0]);
    const std::int64_t value_stride = static_cast<std::int64_t>(p.HV) * V;
    auto store_dv = [&] {
      store_rows<kFusedThreads>(dv_tile, static_cast<E*>(p.dv) + (t0 * p.HV + hv) * V, value_stride, rows, tid);
    };
    if constexpr (kInputGrads == InputGrads::per_value_head) {
      store_dv();
      const std::int64_t key_stride = static_cast<std::int64_t>(p.HV) * K;
      const std::int64_t key_origin = ((t0 + m0) * p.HV + hv) * K + n0_keys;
      store_pairs(dq, p.dq_head + key_origin, key_stride, rows - m0);
      store_pairs(dk, p.dk_head + key_origin, key_stride, rows - m0);
      // V, dO and Delta are refilled after the block sum's barriers below.
    } else {
      // dq and dk finished as soon as their products are done, before the per-token sums.
      if constexpr (kPair) {
        __syncthreads();  // every warp's last products are done: M and F (the partner's partial goes there), V, dO, Delta
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // element by element: a select of whole arrays would put them in local memory
          auto partial = [&](int r) { return sums_keys ? dq[0][i][r] : dk[0][i][r]; };
          partner_partial[i * kFusedThreads + tid] = float4{partial(0), partial(1), partial(2), partial(3)};
        }
        // Its release waits for this thread's earlier memory accesses: dV's stores and the rows' rstd loads come after
        // it (before it, they took a tenth of the kernel's samples there).
        cluster_arrive();
        if (j > 0) load_value_tiles(j - 1);  // beside the partner's arrival
      }
      store_dv();
      float q_rstd[2] = {0.f, 0.f}, k_rstd[2] = {0.f, 0.f};
      if (p.l2norm) {
        const int r = m0 + (tid & 31) / 4;
        for (int half = 0; half < 2; ++half) {
          const std::int64_t row = (t0 + r + 8 * half) * p.H + h;
          const bool valid = r + 8 * half < rows;
          q_rstd[half] = valid ? p.q_rstd[row] : 0.f;
          k_rstd[half] = valid ? p.k_rstd[row] : 0.f;
        }
      }
      const std::int64_t key_stride = static_cast<std::int64_t>(p.H) * K;
      E* const dq_rows = static_cast<E*>(p.dq) + t0 * key_stride + h * K;
      E* const dk_rows = static_cast<E*>(p.dk) + t0 * key_stride + h * K;
      if constexpr (kPair) {
        cluster_wait();  // the partner's partial is in its shared memory
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float4 partner = load_from_cluster_rank(&partner_partial[i * kFusedThreads + tid], rank ^ 1);
          // The sum lands in dq on both ranks. Two terms commute exactly: input_grad_kernel's sum, bit for bit.
          auto own = [&](int r) { return sums_keys ? dk[0][i][r] : dq[0][i][r]; };
          dq[0][i][0] = own(0) + partner.x;
          dq[0][i][1] = own(1) + partner.y;
          dq[0][i][2] = own(2) + partner.z;
          dq[0][i][3] = own(3) + partner.w;
        }
        // This CTA has read the partner's partial: its values are in registers, so no release is needed (one would
        // wait for dV's stores).
        cluster_arrive_relaxed();
        const Rows normalised = sums_keys ? k_tile : q_tile;
        store_norm_dots(p, dq, normalised, q_norm_dots, m0, n0_keys);
        __syncthreads();  // the dots
        for (int half = 0; half < 2; ++half) q_rstd[half] = sums_keys ? k_rstd[half] : q_rstd[half];
        finish_input_grad(p, dq, normalised, q_norm_dots, q_rstd, sums_keys ? dk_rows : dq_rows, key_stride, rows,
                          m0, n0_keys);
      } else {
        store_norm_dots(p, dq, q_tile, q_norm_dots, m0, n0_keys);
        store_norm_dots(p, dk, k_tile, k_norm_dots, m0, n0_keys);
        __syncthreads();  // the dots; every warp's last products are done with V, dO and Delta
        if (j > 0) load_value_tiles(j - 1);
        finish_input_grad(p, dq, q_tile, q_norm_dots, q_rstd, dq_rows, key_stride, rows, m0, n0_keys);
        finish_input_grad(p, dk, k_tile, k_norm_dots, k_rstd, dk_rows, key_stride, rows, m0, n0_keys);
      }
    }

    // ---- per token: dgamma and dbeta ----
    auto over_warps = [](const float* parts, int row) {  // in warp order
      float sum = 0.f;
      for (int w = 0; w < kFusedWarps; ++w) sum += parts[w * kChunk + row];
      return sum;
    };
    // The state path's own decay (D = e^(gamma_last - gamma)): each row's D term is formed once, by its thread, and
    // lands on the chunk's last row (less the last row's own, whose D is 1 and cancels exactly) together with
    // E_n sum(S * dS'), in one block sum. One thread walking the rows there left the block waiting at the barrier
    // below for 9% of the kernel's samples.
    const int last_row = rows - 1;
    const float d_term = tid < last_row ? gate_out[tid] * over_warps(delta_parts, tid) : 0.f;
    const float last_row_terms =
        block_sum<kFusedThreads>(d_term + gate_in[kChunk - 1] * state_dot, smem_at<float>(smem, L::scratch));
    // The block sum's barriers come after every warp's dQ/dK wait and the norm's backward, the last readers of Q, K
    // and S, after the inverse's backward, beta's last reader, and after dV's stores, which the next chunk's staging
    // overwrites.
    if (j > 0) {
      if constexpr (kInputGrads == InputGrads::per_value_head) load_value_tiles(j - 1);
      load_key_tiles(j - 1);
      store_beta();
    }
    if (tid < kChunk) {
      const int r = tid;
      float dg = q_dots[r] + q_dots[kChunk + r] - gate_in[r] * over_warps(corr_parts, r) +
                 decay_balance(g_parts, r) + decay_balance(e_parts, r);
      dg += r == last_row ? last_row_terms : -d_term;
      dgamma[r] = r < rows ? dg : 0.f;
      const float db = e_sums[r] + e_sums[kChunk + r] + over_warps(beta_parts, r);
      if (r < rows) store_gate<E>(p.dbeta, (t0 + r) * p.HV + hv, p.beta_float, db);
    }
    __syncthreads();  // every vector of the chunk is read but dgamma
    if (j > 0) load_chunk_gates(j - 1);
    store_chunk_dg<E>(p, dgamma, t0, rows, hv, threadIdx.x);
  }
  if constexpr (kPair) cluster_wait();  // the partner has read the last chunk's partial: this CTA may exit
  if (p.dh0 != nullptr && run == runs - 1) {
    store_state(ds, p.dh0, p, n, hv, at);
  }
#endif
}

template <class E, InputGrads kInputGrads>
__global__ void __launch_bounds__(kFusedThreads, 1) fused_backward_kernel(Params p) {
  fused_backward<E, kInputGrads>(p);
}
// A GVA group's two value heads (grid y 2h and 2h + 1) as one cluster.
template <class E>
__global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(kFusedThreads, 1) fused_backward_pair_kernel(Params p) {
  fused_backward<E, InputGrads::cluster_pair>(p);
}

}  // namespace

void launch_fused_backward(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    if constexpr (sizeof(E) == 2 && K == 128) {  // where plan_execution fuses
      const dim3 grid(p.sequences * p.segments, p.HV), block(kFusedThreads);
      constexpr int smem = FusedBackwardSmem<E>::bytes;
      launch_by_input_grads<fused_backward_kernel<E, InputGrads::per_value_head>,
                            fused_backward_kernel<E, InputGrads::this_cta>, fused_backward_pair_kernel<E>>(
          p, "gdn fused_backward_kernel", "gdn fused_backward_pair_kernel", grid, block, smem, kernels);
    }
  });
}

}  // namespace deltatrain::gdn::cuda
