// The forward state pass on Hopper (sm_90a), used on sm_90 devices for 16-bit inputs with K <= 128: one
// warpgroup per 64 columns of V of a (sequence, value head) holds S^T (64 x K) in float32 registers, warp w
// rows 16w..16w+15 with all K keys, so no partial sums are exchanged (state.cu splits keys between the
// warps of a pair). Every product is a wgmma with A in registers (the state, or Delta^T, rounded to 16
// bits in the A layout) and B read by the tensor cores from 128-byte-swizzled chunk tiles. Per chunk:
//   Delta^T = U^T - S^T W^T
//   O^T     = scale e^gamma (S^T Q^T) + Delta^T P^T
//   S^T     = e^gamma_last S^T + (Delta^T diag(e^(gamma_last - gamma))) K
// kRecompute (for the backward) stores S^T entering each chunk and Delta instead of O.
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>

#include "deltatrain/core/cuda_check.h"
#include "dispatch.cuh"
#include "launch.h"
#include "sequential.cuh"
#include "wgmma.cuh"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kWarpgroup = 128;
constexpr int kColumns = 64;  // of V per CTA: the wgmma row count

__host__ __device__ constexpr int round_up(int x, int to) { return (x + to - 1) / to * to; }

template <class E, int K, bool kRecompute>
struct HopperForwardSmem {
  using KeyTile = SwizzledTile<E, kChunk, K>;          // W, K (, Q): [token][key]
  using ChunkTile = SwizzledTile<E, kChunk, kChunk>;   // P: [token][token]
  using ColumnTile = Tile<E, kChunk, kColumns>;        // U: [token][column of V], read into accumulators
  using TokenTile = Tile<E, kChunk, 16>;               // a warp's staging for token-major stores
  static constexpr int kKeyTiles = kRecompute ? 2 : 3;
  static constexpr int p_at = kKeyTiles * KeyTile::kBytes;
  static constexpr int u_at = p_at + (kRecompute ? 0 : ChunkTile::kBytes);
  static constexpr int gates_at = u_at + ColumnTile::kBytes;
  static constexpr int stage_bytes = round_up(gates_at + 2 * kChunk * 4, 1024);
  static constexpr int stages = 2;
  static constexpr int staging_at = stages * stage_bytes;
  // The swizzled blocks need 1024-byte alignment, which dynamic shared memory does not promise.
  static constexpr int bytes = staging_at + 4 * TokenTile::kBytes + 1024;
  static_assert(bytes <= kSmemLimit);
};

// Where a warp's rows of S^T sit: columns of V from v0, keys from k0 (all of them).
struct StateRows {
  int v0, k0;
};

template <class E, int K, bool kRecompute>
__global__ void __launch_bounds__(kWarpgroup, 1) state_forward_hopper_kernel(Params p) {
#ifdef DELTATRAIN_WGMMA
  using L = HopperForwardSmem<E, K, kRecompute>;
  extern __shared__ __align__(16) char smem_raw[];
  const int raw = static_cast<int>(smem_address(smem_raw));
  char* const smem = smem_raw + (round_up(raw, 1024) - raw);
  const std::uint32_t smem_base = round_up(raw, 1024);
  const int n = blockIdx.x, hv = blockIdx.y, h = hv / p.group, v_block = blockIdx.z * kColumns;
  const int tid = threadIdx.x, m0 = 16 * (tid / 32);
  const StateRows at{v_block + m0, 0};
  const SequenceChunks chunks(p, n);

  auto key_tile = [&](int stage, int i) {
    return typename L::KeyTile{smem_base + stage * L::stage_bytes + i * L::KeyTile::kBytes};
  };
  auto p_tile = [&](int stage) { return typename L::ChunkTile{smem_base + stage * L::stage_bytes + L::p_at}; };
  auto u_tile = [&](int stage) { return typename L::ColumnTile{smem_at<E>(smem, stage * L::stage_bytes + L::u_at)}; };
  auto gate_in = [&](int stage) { return smem_at<float>(smem, stage * L::stage_bytes + L::gates_at); };
  const typename L::TokenTile staging{smem_at<E>(smem, L::staging_at + (tid / 32) * L::TokenTile::kBytes)};

  auto issue = [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    load_chunk_rows<kWarpgroup>(key_tile(stage, 0), static_cast<const E*>(p.w), p.HV, hv, K, 0, info, tid);
    load_chunk_rows<kWarpgroup>(key_tile(stage, 1), keys<E>(p), p.H, h, K, 0, info, tid);
    if constexpr (!kRecompute) {
      load_chunk_rows<kWarpgroup>(key_tile(stage, 2), queries<E>(p), p.H, h, K, 0, info, tid);
      load_chunk_rows<kWarpgroup>(p_tile(stage), static_cast<const E*>(p.p), p.HV, hv, kChunk, 0, info, tid);
    }
    load_chunk_rows<kWarpgroup>(u_tile(stage), p.u, p.HV, hv, p.V, v_block, info, tid);
    load_gates_async(p, gate_in(stage), gate_in(stage) + kChunk, hv, info, tid);
  };

  const std::int64_t token_stride = static_cast<std::int64_t>(p.HV) * p.V;
  float state[1][K / 8][4];
  load_state(state, p.h0, p, n, hv, at);

  sequential_pass<L::stages, false, true>(chunks.count, issue, [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    const float *gates_in = gate_in(stage), *gates_out = gates_in + kChunk;
    E* const token_rows = static_cast<E*>(kRecompute ? p.delta : p.o) +
                          (static_cast<std::int64_t>(info.start) * p.HV + hv) * p.V + at.v0;
    if constexpr (kRecompute) store_pairs(state, chunk_state_block<E>(p.states, p, chunks.first + j, hv, at), K);

    WarpOperand<E, K> neg_state(nullptr);  // -S^T, so that the W product lands on U^T
    neg_state.set(state, -1.f);
    float delta[1][kChunk / 8][4], out[1][kChunk / 8][4];
    load_accumulator(delta, transposed(u_tile(stage)), m0);
    zero(out);
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < K / 16; ++kb) {
      wgmma_64x64x16<E, false>(delta[0], neg_state.frag[kb], k_major(key_tile(stage, 0), 16 * kb));
    }
    if constexpr (!kRecompute) {
#pragma unroll
      for (int kb = 0; kb < K / 16; ++kb) {
        wgmma_64x64x16<E, false>(out[0], neg_state.frag[kb], k_major(key_tile(stage, 2), 16 * kb));
      }
    }
    wgmma_commit_and_wait<0>();
    hold(delta[0]);
    hold(out[0]);

    // The P product and the state update both need only Delta: one group, one wait.
    const float decay = gates_in[kChunk - 1];
    for_each(state, 0, 0, [&](int, int, float& x) { x *= decay; });
    WarpOperand<E, kChunk> update(nullptr), delta_operand(nullptr);
    update.set(delta, 1.f, gates_out);
    if constexpr (kRecompute) {
      store_token_rows(delta, staging, token_rows, token_stride, info.length);
    } else {
      scale_columns(out, gates_in, -p.scale);
      delta_operand.set(delta, 1.f);
    }
    wgmma_fence();
    if constexpr (!kRecompute) {
#pragma unroll
      for (int kb = 0; kb < kChunk / 16; ++kb) {
        wgmma_64x64x16<E, false>(out[0], delta_operand.frag[kb], k_major(p_tile(stage), 16 * kb));
      }
    }
#pragma unroll
    for (int kb = 0; kb < kChunk / 16; ++kb) {
#pragma unroll
      for (int nb = 0; nb < K / 64; ++nb) {
        wgmma_64x64x16<E, true>(*reinterpret_cast<float(*)[8][4]>(&state[0][8 * nb]), update.frag[kb],
                                mn_major(key_tile(stage, 1), 16 * kb, 64 * nb));
      }
    }
    wgmma_commit_and_wait<0>();
    hold(out[0]);
    hold(state[0]);
    if constexpr (!kRecompute) store_token_rows(out, staging, token_rows, token_stride, info.length);
  });
  if constexpr (!kRecompute) {
    if (p.ht != nullptr) store_state(state, p.ht, p, n, hv, at);
  }
#endif
}

// Whether this device runs the wgmma kernels: an sm_90 device and a binary built for sm_90a (another
// build would fall back to its sm_80 image, whose body of these kernels is empty).
bool wgmma_ready() {
  static std::array<std::atomic<int>, 64> known{};  // per device: 0 unknown, 1 yes, 2 no
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  const bool tracked = device < static_cast<int>(known.size());
  if (tracked && known[device].load(std::memory_order_acquire) != 0) return known[device].load() == 1;
  cudaFuncAttributes attributes{};
  cuda_check(cudaFuncGetAttributes(&attributes, state_forward_hopper_kernel<__nv_bfloat16, 128, false>),
             "cudaFuncGetAttributes (Hopper state pass)");
  const bool ready = attributes.binaryVersion == 90;
  if (tracked) known[device].store(ready ? 1 : 2, std::memory_order_release);
  return ready;
}

}  // namespace

bool launch_state_forward_hopper(const Params& p, DType io, bool recompute, KernelSequence& kernels) {
  if (io == DType::f32 || p.K > 128 || p.V % kColumns != 0 || !wgmma_ready()) return false;
  dispatch(io, p.K, [&]<class E, int K>() {
    if constexpr (sizeof(E) == 2 && K <= 128) {
      const dim3 grid(p.sequences, p.HV, p.V / kColumns);
      if (recompute) {
        launch<state_forward_hopper_kernel<E, K, true>>("gdn state_forward_hopper_kernel (recompute)", grid,
                                                         dim3(kWarpgroup), HopperForwardSmem<E, K, true>::bytes, kernels);
      } else {
        launch<state_forward_hopper_kernel<E, K, false>>("gdn state_forward_hopper_kernel", grid, dim3(kWarpgroup),
                                                          HopperForwardSmem<E, K, false>::bytes, kernels);
      }
    }
  });
  return true;
}

}  // namespace deltatrain::gdn::cuda
