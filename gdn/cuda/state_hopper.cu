// The forward state pass on Hopper (sm_90a), used on sm_90 devices for 16-bit inputs with K <= 128: one
// warpgroup per 64 columns of V of a (sequence, value head) holds S^T (64 x K) in float32 registers, warp w
// rows 16w..16w+15 with all K keys, so no partial sums are exchanged (state.cu splits keys between the
// warps of a pair). Every product is a wgmma with A in registers (the state, or Delta^T, rounded to 16
// bits in the A layout) and B read by the tensor cores from 128-byte-swizzled chunk tiles. Per chunk:
//   Delta^T = U^T - S^T W^T
//   O^T     = scale e^gamma (S^T Q^T) + Delta^T P^T
//   S^T     = e^gamma_last S^T + (Delta^T diag(e^(gamma_last - gamma))) K
// Pass::recompute (for the backward) stores S^T entering each chunk and Delta instead of O.
//
// Few long sequences over few heads leave most SMs idle while the chain of chunks is long, so such calls
// split each sequence into p.segments runs of chunks (gdn-kernels.md: the chunk map is affine,
// S^T' = S^T A + B with A = e^gamma_last I - W^T diag(e^(gamma_last - gamma)) K, B = U^T diag(..) K):
//   1. Pass::segment_ends, every segment but the last in parallel: its end state from a zero start (segment
//      0 from h0), R_s, and the product M_s of its chunks' A, computed as K more state rows that start at
//      the identity with U = 0 (the same step: Delta^T = -X W^T, X' = e^gamma_last X + Delta^T diag(..) K);
//   2. segment_starts_kernel, per (sequence, head): start_1 = R_0, start_(s+1) = start_s M_s + R_s, in
//      float32 (3xTF32);
//   3. the forward (or recompute) pass of every segment in parallel from its true start.
// bench/prototypes/segmented_state.py checks this algebra in float64 against the token recurrence.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/system.h"
#include "dispatch.cuh"
#include "launch.h"
#include "sequential.cuh"
#include "wgmma.cuh"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kWarpgroup = 128;
constexpr int kColumns = 64;  // of V per CTA: the wgmma row count

__host__ __device__ constexpr int round_up(int x, int to) { return (x + to - 1) / to * to; }

enum class Pass { forward, recompute, segment_ends };

template <class E, int K, Pass kPass>
struct HopperForwardSmem {
  static constexpr bool kQueries = kPass == Pass::forward;
  using KeyTile = SwizzledTile<E, kChunk, K>;          // W, K (, Q): [token][key]
  using ChunkTile = SwizzledTile<E, kChunk, kChunk>;   // P: [token][token]
  using ColumnTile = Tile<E, kChunk, kColumns>;        // U: [token][column of V], read into accumulators
  using TokenTile = Tile<E, kChunk, 16>;               // a warp's staging for token-major stores
  static constexpr int kKeyTiles = kQueries ? 3 : 2;
  static constexpr int p_at = kKeyTiles * KeyTile::kBytes;
  static constexpr int u_at = p_at + (kQueries ? ChunkTile::kBytes : 0);
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

// A segment's float32 row blocks in the workspace: [sequence, segment, HV, rows, K] with `rows` rows.
__device__ __forceinline__ float* segment_rows(float* base, const Params& p, int n, int s, int segments, int hv,
                                               int rows) {
  return base + ((static_cast<std::int64_t>(n) * segments + s) * p.HV + hv) * rows * p.K;
}

// grid: forward and recompute (sequences x segments, HV, V / 64); segment_ends (sequences x (segments - 1),
// HV, (V + K) / 64), the row blocks past V being those of M.
template <class E, int K, Pass kPass>
__global__ void __launch_bounds__(kWarpgroup, 1) state_forward_hopper_kernel(Params p) {
#ifdef DELTATRAIN_WGMMA
  using L = HopperForwardSmem<E, K, kPass>;
  extern __shared__ __align__(16) char smem_raw[];
  const int raw = static_cast<int>(smem_address(smem_raw));
  char* const smem = smem_raw + (round_up(raw, 1024) - raw);
  const std::uint32_t smem_base = round_up(raw, 1024);
  const int segments = kPass == Pass::segment_ends ? p.segments - 1 : p.segments;
  const int n = blockIdx.x / segments, segment = blockIdx.x % segments;
  const int hv = blockIdx.y, h = hv / p.group, row_block = blockIdx.z * kColumns;
  const int tid = threadIdx.x, m0 = 16 * (tid / 32);
  // Rows of M (segment_ends only) carry no U: their Delta starts at zero.
  const bool transition_rows = row_block >= p.V;
  const StateRows at{row_block + m0, 0};
  const SequenceChunks chunks = SequenceChunks(p, n).segment(segment, p.segments);

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
    if constexpr (L::kQueries) {
      load_chunk_rows<kWarpgroup>(key_tile(stage, 2), queries<E>(p), p.H, h, K, 0, info, tid);
      load_chunk_rows<kWarpgroup>(p_tile(stage), static_cast<const E*>(p.p), p.HV, hv, kChunk, 0, info, tid);
    }
    if (!transition_rows) load_chunk_rows<kWarpgroup>(u_tile(stage), p.u, p.HV, hv, p.V, row_block, info, tid);
    load_gates_async(p, gate_in(stage), gate_in(stage) + kChunk, hv, info, tid);
  };

  const std::int64_t token_stride = static_cast<std::int64_t>(p.HV) * p.V;
  float state[1][K / 8][4];
  if (kPass == Pass::segment_ends && transition_rows) {
    const int first_row = at.v0 - p.V;
    for_each(state, 0, 0, [&](int r, int c, float& x) { x = first_row + r == c ? 1.f : 0.f; });
  } else if (segment == 0) {
    load_state(state, p.h0, p, n, hv, at);
  } else if constexpr (kPass == Pass::segment_ends) {
    zero(state);
  } else {
    load_pairs(state, segment_rows(p.segment_starts, p, n, segment, p.segments, hv, p.V) + at.v0 * K, K, 16);
  }

  sequential_pass<L::stages, false, true>(chunks.count, issue, [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    const float *gates_in = gate_in(stage), *gates_out = gates_in + kChunk;
    E* const token_rows = static_cast<E*>(kPass == Pass::recompute ? p.delta : p.o) +
                          (static_cast<std::int64_t>(info.start) * p.HV + hv) * p.V + at.v0;
    if constexpr (kPass == Pass::recompute) {
      store_pairs(state, chunk_state_block<E>(p.states, p, chunks.first + j, hv, at), K);
    }

    WarpOperand<E, K> neg_state(nullptr);  // -S^T, so that the W product lands on U^T
    neg_state.set(state, -1.f);
    float delta[1][kChunk / 8][4], out[1][kChunk / 8][4];
    if (transition_rows) {
      zero(delta);
    } else {
      load_accumulator(delta, transposed(u_tile(stage)), m0);
    }
    zero(out);
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < K / 16; ++kb) {
      wgmma_64x64x16<E, false>(delta[0], neg_state.frag[kb], k_major(key_tile(stage, 0), 16 * kb));
    }
    if constexpr (L::kQueries) {
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
    if constexpr (kPass == Pass::recompute) store_token_rows(delta, staging, token_rows, token_stride, info.length);
    if constexpr (L::kQueries) {
      scale_columns(out, gates_in, -p.scale);
      delta_operand.set(delta, 1.f);
    }
    wgmma_fence();
    if constexpr (L::kQueries) {
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
    if constexpr (L::kQueries) store_token_rows(out, staging, token_rows, token_stride, info.length);
  });
  if constexpr (kPass == Pass::segment_ends) {
    store_pairs(state, segment_rows(p.segment_ends, p, n, segment, p.segments - 1, hv, p.V + K) + at.v0 * K, K);
  } else if constexpr (kPass == Pass::forward) {
    if (p.ht != nullptr && segment == p.segments - 1) store_state(state, p.ht, p, n, hv, at);
  }
#endif
}

// Step 2 of the segmented pass, per (sequence, value head, 64 columns of V): the true state entering every
// segment, start_(s+1) = start_s M_s + R_s with start_1 = R_0 (segment 0 started from h0), in float32.
template <int K>
struct SegmentStartsSmem {
  using StartTile = Tile<float, kColumns, K>;
  using MapTile = Tile<float, K, K>;
  static constexpr int map_at = StartTile::kBytes;
  static constexpr int bytes = map_at + MapTile::kBytes;
};

template <int K>
__global__ void __launch_bounds__(kWarpgroup) segment_starts_kernel(Params p) {
  using L = SegmentStartsSmem<K>;
  extern __shared__ __align__(16) char smem[];
  const typename L::StartTile start_tile{smem_at<float>(smem, 0)};
  const typename L::MapTile map_tile{smem_at<float>(smem, L::map_at)};
  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * kColumns;
  const int tid = threadIdx.x, m0 = 16 * (tid / 32);
  const int ends = p.segments - 1, rows = p.V + K;
  auto end_rows = [&](int s) { return segment_rows(p.segment_ends, p, n, s, ends, hv, rows); };
  auto start_rows = [&](int s) { return segment_rows(p.segment_starts, p, n, s, p.segments, hv, p.V); };

  float start[1][K / 8][4];
  load_pairs(start, end_rows(0) + (v0 + m0) * K, K, 16);
  store_pairs(start, start_rows(1) + (v0 + m0) * K, K);
#pragma unroll 1
  for (int s = 1; s < ends; ++s) {
    load_rows_async<kWarpgroup>(map_tile, end_rows(s) + p.V * K, K, K, tid);
    cp_async_commit();
    store(start, start_tile, m0, 0);
    float next[1][K / 8][4];
    load_pairs(next, end_rows(s) + (v0 + m0) * K, K, 16);
    cp_async_wait<0>();
    __syncthreads();
    warp_mma(next, plain(start_tile), m0, plain(map_tile), 0, 0, K);
    store_pairs(next, start_rows(s + 1) + (v0 + m0) * K, K);
    for_each(start, next, 0, 0, [](int, int, float& to, float& from) { to = from; });
    __syncthreads();  // the tiles are free for the next segment
  }
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
  cuda_check(cudaFuncGetAttributes(&attributes, state_forward_hopper_kernel<__nv_bfloat16, 128, Pass::forward>),
             "cudaFuncGetAttributes (Hopper state pass)");
  const bool ready = attributes.binaryVersion == 90;
  if (tracked) known[device].store(ready ? 1 : 2, std::memory_order_release);
  return ready;
}

bool hopper_applies(DType io, std::int64_t K, std::int64_t V) {
  return io != DType::f32 && K <= 128 && V % kColumns == 0 && wgmma_ready();
}

template <class E, int K, Pass kPass>
void launch_pass(const Params& p, const char* name, int segments, int row_blocks, KernelSequence& kernels) {
  launch<state_forward_hopper_kernel<E, K, kPass>>(name, dim3(p.sequences * segments, p.HV, row_blocks),
                                                  dim3(kWarpgroup), HopperForwardSmem<E, K, kPass>::bytes, kernels);
}

}  // namespace

int state_segments(const Problem& problem, std::int64_t chunks) {
  if (!hopper_applies(problem.io_dtype, problem.K, problem.V)) return 1;
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  int multiprocessors = 0;
  for (const GpuInfo& gpu : cuda_info().gpus) {
    if (gpu.index == device) multiprocessors = gpu.multiprocessors;
  }
  // Each segment costs its chain of chunks twice (ends, then the pass proper, the first with K more rows),
  // so fewer than four segments gain nothing; a segment of a handful of chunks is mostly pipeline fill.
  const std::int64_t units = problem.N * problem.HV * (problem.V / kColumns);
  const std::int64_t segments = std::min<std::int64_t>({16, multiprocessors / units, chunks / problem.N / 4});
  return segments >= 4 ? static_cast<int>(segments) : 1;
}

bool launch_state_forward_hopper(const Params& p, DType io, bool recompute, KernelSequence& kernels) {
  if (!hopper_applies(io, p.K, p.V)) return false;
  dispatch(io, p.K, [&]<class E, int K>() {
    if constexpr (sizeof(E) == 2 && K <= 128) {
      if (p.segments > 1) {
        launch_pass<E, K, Pass::segment_ends>(p, "gdn state_forward_hopper_kernel (segment ends)", p.segments - 1,
                                              (p.V + K) / kColumns, kernels);
        launch<segment_starts_kernel<K>>("gdn segment_starts_kernel", dim3(p.sequences, p.HV, p.V / kColumns),
                                         dim3(kWarpgroup), SegmentStartsSmem<K>::bytes, kernels);
      }
      if (recompute) {
        launch_pass<E, K, Pass::recompute>(p, "gdn state_forward_hopper_kernel (recompute)", p.segments,
                                           p.V / kColumns, kernels);
      } else {
        launch_pass<E, K, Pass::forward>(p, "gdn state_forward_hopper_kernel", p.segments, p.V / kColumns, kernels);
      }
    }
  });
  return true;
}

}  // namespace deltatrain::gdn::cuda
