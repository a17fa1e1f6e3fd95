// The steps the Hopper state passes (state_hopper.cu) are built from, beyond the wgmma primitives: the state's update,
// Delta's first group and W from T.
#pragma once

#include "sequential.cuh"
#include "wgmma.cuh"

namespace deltatrain::gdn::cuda {

inline constexpr int kWarpgroup = 128;  // threads

__host__ __device__ constexpr int round_up(int x, int to) { return (x + to - 1) / to * to; }

// state (64 x K) += a (64 x 64 tokens, the warpgroup's operand) * tile (64 tokens x K, MN-major).
template <class E, int K, class KeyTile>
__device__ __forceinline__ void update_state(float (&state)[1][K / 8][4], const WarpOperand<E, kChunk>& a,
                                             KeyTile tile) {
#pragma unroll
  for (int kb = 0; kb < kChunk / 16; ++kb) {
#pragma unroll
    for (int nb = 0; nb < K / 64; ++nb) {
      wgmma_64x64x16<E, true>(*reinterpret_cast<float(*)[8][4]>(&state[0][8 * nb]), a.frag[kb],
                              mn_major(tile, 16 * kb, 64 * nb));
    }
  }
}

// Delta^T = (V^T diag(beta)) T^T - S^T W^T, the forward step's first group (issued, not committed): U^T's products from
// V^T diag(beta)'s fragments (where the rows have values: not rows of M, which start from zero) and the state's,
// -S^T's fragments against the W tile.
template <class E, int K, class ChunkTileT, class KeyTileT>
__device__ __forceinline__ void issue_delta(float (&delta)[8][4], const WarpOperand<E, kChunk>& values, bool with_values,
                                            const WarpOperand<E, K>& neg_state, ChunkTileT t, KeyTileT w) {
  if (with_values) {
#pragma unroll
    for (int kb = 0; kb < kChunk / 16; ++kb) {
      wgmma_64x64x16<E, false>(delta, values.frag[kb], k_major(t, 16 * kb), kb > 0);
    }
  }
#pragma unroll
  for (int kb = 0; kb < K / 16; ++kb) wgmma_64x64x16<E, false>(delta, neg_state.frag[kb], k_major(w, 16 * kb));
}

// W = T diag(beta e^gamma) K of a chunk, the warpgroup's 64 key columns from key0, formed from T (its rows by ldmatrix,
// scaled by beta e^gamma in registers: a second rounding, W's error +0.06% on the grid) and the chunk's key tile;
// issued, not committed. m0: the warp's 16 rows of the warpgroup's 64.
template <class E, class KeyTile>
__device__ __forceinline__ void issue_w_from_t(float (&w)[8][4], AddressableSwizzledTile<E, kChunk, kChunk> t,
                                               const float* gate_in, const float* beta, KeyTile keys, int key0,
                                               int m0) {
  WarpOperand<E, kChunk> a(nullptr);
#pragma unroll
  for (int kb = 0; kb < kChunk / 16; ++kb) load_a16(a.frag[kb], plain(t), m0, 16 * kb);
  a.scale_columns(gate_in, 1.f, beta);
  wgmma_fence();
#pragma unroll
  for (int kb = 0; kb < kChunk / 16; ++kb) wgmma_64x64x16<E, true>(w, a.frag[kb], mn_major(keys, 16 * kb, key0), kb > 0);
}

}  // namespace deltatrain::gdn::cuda
