// The two sequential passes over the chunks of each (sequence, value head): the state recurrence forward
// (docs/gdn-algorithm.md section 3) and the state gradient backward (section 4, the reverse pass), walking
// the chunks in order while the next chunk's tiles arrive by cp.async into the other stage.
//
// Work split. A CTA owns 16 x kGroups columns of V. Each group of 16 columns is held by a pair of warps,
// one per half of the key dimension: the warp keeps its 16 x K/2 block of the state, transposed (S^T), in
// float32 registers. Per chunk a pair sums its two partial products over keys through shared memory (the
// two warps' fragments have equal layouts, so the exchange is lane-to-same-lane) and splits the chunk's
// tokens for the outputs. A step thus has half the tensor-core work of one warp holding all keys, and two
// warps per scheduler hide each other's latencies. Every A operand is the warp's own rows (S^T, Delta^T,
// dS^T, D^T) and passes from accumulator to product in registers (WarpOperand); only the chunk tiles (B
// operands) are shared.
#include <cuda_runtime_api.h>

#include <type_traits>

#include "chunk.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "sequential.cuh"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kHalfChunk = kChunk / 2;  // tokens of a chunk each warp of a pair writes out

// Shared memory of a sequential pass of kGroups warp pairs: per stage `kKeyTiles` chunk tiles 64 x K,
// `kChunkTiles` 64 x 64 (P), one 64 x 16 kGroups tile of the CTA's columns of V (U or dO) and the chunk's
// two gate vectors; per warp its partial sums for the partner
// (kExchange accumulator tiles 16 x 8), the staging tile of its token-major stores and the shared backing
// of its two operands (float32 only). Two stages when they fit.
template <class E, int K, int kGroups, int kKeyTiles, int kChunkTiles, int kExchange>
struct SequentialSmem {
  using KeyTile = Tile<E, kChunk, K>;
  using ChunkTile = Tile<E, kChunk, kChunk>;
  using ColumnTile = Tile<E, kChunk, 16 * kGroups>;
  using TokenTile = Tile<E, kHalfChunk, 16>;
  static constexpr int kWarps = 2 * kGroups;
  static constexpr int gates_bytes = 2 * kChunk * 4;
  static constexpr int column_tile_at = kKeyTiles * KeyTile::kBytes + kChunkTiles * ChunkTile::kBytes;
  static constexpr int stage_bytes = column_tile_at + ColumnTile::kBytes + gates_bytes;
  static constexpr int exchange_bytes = kExchange * 32 * 16;
  static constexpr int key_operand_bytes = WarpOperand<E, K / 2>::kSmemBytes;
  static constexpr int warp_bytes =
      exchange_bytes + TokenTile::kBytes + key_operand_bytes + WarpOperand<E, kChunk>::kSmemBytes;
  static constexpr int stages = 2 * stage_bytes + kWarps * warp_bytes <= kSmemLimit ? 2 : 1;
  static constexpr int bytes = stages * stage_bytes + kWarps * warp_bytes;
  static_assert(bytes <= kSmemLimit, "a sequential pass needs more shared memory than an SM has");

  __device__ static KeyTile key_tile(char* smem, int stage, int i) {
    return {smem_at<E>(smem, stage * stage_bytes + i * KeyTile::kBytes)};
  }
  __device__ static ChunkTile chunk_tile(char* smem, int stage, int i) {
    return {smem_at<E>(smem, stage * stage_bytes + kKeyTiles * KeyTile::kBytes + i * ChunkTile::kBytes)};
  }
  __device__ static ColumnTile column_tile(char* smem, int stage) {
    return {smem_at<E>(smem, stage * stage_bytes + column_tile_at)};
  }
  __device__ static float* gate_in(char* smem, int stage) {
    return smem_at<float>(smem, stage * stage_bytes + column_tile_at + ColumnTile::kBytes);
  }
  __device__ static float* gate_out(char* smem, int stage) { return gate_in(smem, stage) + kChunk; }
  __device__ static char* warp_area(char* smem, int warp) { return smem + stages * stage_bytes + warp * warp_bytes; }
  __device__ static float4* exchange(char* smem, int warp) { return reinterpret_cast<float4*>(warp_area(smem, warp)); }
  __device__ static TokenTile token_tile(char* smem, int warp) {
    return {reinterpret_cast<E*>(warp_area(smem, warp) + exchange_bytes)};
  }
  __device__ static char* key_operand(char* smem, int warp) {
    return warp_area(smem, warp) + exchange_bytes + TokenTile::kBytes;
  }
  __device__ static char* chunk_operand(char* smem, int warp) { return key_operand(smem, warp) + key_operand_bytes; }
};

// Where a warp sits: its pair (16 columns of V from v0) and its half of the keys (from k0).
struct WarpPlace {
  int warp, lane, pair, half, v0, k0;
  __device__ WarpPlace(int columns_per_cta, int K)
      : warp(threadIdx.x / 32), lane(threadIdx.x & 31), pair(warp / 2), half(warp & 1),
        v0(blockIdx.z * columns_per_cta + 16 * pair), k0(half * K / 2) {}

  // Waits until both warps of the pair arrive (named barrier 1 + pair; 0 is __syncthreads).
  __device__ void pair_sync() const { named_barrier_sync(pair + 1, 64); }
  __device__ int partner() const { return warp ^ 1; }
};

// f(first tile of the token half `half`) with the tile index a compile-time constant in each branch, so
// that the register arrays it indexes stay in registers.
template <class F>
__device__ __forceinline__ void with_token_half(int half, F&& f) {
  if (half == 0) {
    f(std::integral_constant<int, 0>{});
  } else {
    f(std::integral_constant<int, kHalfChunk / 8>{});
  }
}

// Accumulator tiles [n_begin, n_begin + N) to and from a pair's exchange buffer, one float4 per lane and
// tile, at the same place for both warps.
template <int N, int NT>
__device__ __forceinline__ void put_partial(float4* buffer, const float (&acc)[1][NT][4], int n_begin, int lane) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float* x = acc[0][n_begin + i];
    buffer[i * 32 + lane] = float4{x[0], x[1], x[2], x[3]};
  }
}
// acc[i] = mine[n_begin + i] + the partner's tile i, for i < N: the pair's sum over both key halves (both
// warps get the same bits, addition being commutative).
template <int N, int NA, int NT>
__device__ __forceinline__ void sum_partials(float (&acc)[1][NA][4], const float (&mine)[1][NT][4], int n_begin,
                                             const float4* partner, int lane) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float4 other = partner[i * 32 + lane];
    acc[0][i][0] = mine[0][n_begin + i][0] + other.x;
    acc[0][i][1] = mine[0][n_begin + i][1] + other.y;
    acc[0][i][2] = mine[0][n_begin + i][2] + other.z;
    acc[0][i][3] = mine[0][n_begin + i][3] + other.w;
  }
}

// The warp's half of the chunk's tokens in a token-major [tokens, HV, V] tensor, and how many are real.
template <class E>
__device__ __forceinline__ E* token_half(void* base, const Params& p, const ChunkInfo& info, int hv,
                                         const WarpPlace& at) {
  return static_cast<E*>(base) + ((static_cast<std::int64_t>(info.start) + kHalfChunk * at.half) * p.HV + hv) * p.V +
         at.v0;
}
__device__ __forceinline__ int tokens_in_half(const ChunkInfo& info, const WarpPlace& at) {
  return max(0, min(kHalfChunk, info.length - kHalfChunk * at.half));
}

// The accumulator tiles [n_begin, n_begin + N) of acc as their own accumulator.
template <int N, int NT>
__device__ __forceinline__ void take_tiles(float (&part)[1][N][4], const float (&acc)[1][NT][4], int n_begin) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) part[0][i][r] = acc[0][n_begin + i][r];
}

// Starts copying chunk `info`'s tiles into a stage: W and K, with Q and P when kQueries, the CTA's
// columns of `columns` (U or dO), and the gate vectors.
template <class L, int kThreads, bool kQueries, class E>
__device__ __forceinline__ void issue_chunk(char* smem, int stage, const Params& p, const ChunkInfo& info, int hv,
                                            int v_block, const void* columns) {
  const int h = hv / p.group, tid = threadIdx.x;
  load_chunk_rows<kThreads>(L::key_tile(smem, stage, 0), p.w, p.HV, hv, L::KeyTile::kCols, 0, info, tid);
  load_chunk_rows<kThreads>(L::key_tile(smem, stage, 1), keys<E>(p), p.H, h, L::KeyTile::kCols, 0, info, tid);
  if constexpr (kQueries) {
    load_chunk_rows<kThreads>(L::key_tile(smem, stage, 2), queries<E>(p), p.H, h, L::KeyTile::kCols, 0, info, tid);
    load_lower_chunk_tile<kThreads>(L::chunk_tile(smem, stage, 0), p.p, p.HV, hv, info, tid);
  }
  load_chunk_rows<kThreads>(L::column_tile(smem, stage), columns, p.HV, hv, p.V, v_block, info, tid);
  load_gates_async(p, L::gate_in(smem, stage), L::gate_out(smem, stage), hv, info, tid);
}

// A warp's private shared memory in a pass: its token-major staging tile, its exchange buffer and its
// partner's, and its two operands (key-wide and chunk-wide).
template <class L, class E, int K>
struct WarpScratch {
  typename L::TokenTile token_tile;
  float4* mine;
  const float4* theirs;
  WarpOperand<E, K / 2> key_operand;
  WarpOperand<E, kChunk> chunk_operand;
  __device__ WarpScratch(char* smem, const WarpPlace& at)
      : token_tile(L::token_tile(smem, at.warp)), mine(L::exchange(smem, at.warp)),
        theirs(L::exchange(smem, at.partner())), key_operand(L::key_operand(smem, at.warp)),
        chunk_operand(L::chunk_operand(smem, at.warp)) {}
};

// Forward: per chunk, with S^T the pair's state block entering it (each warp holding its key half),
//   Delta^T = U^T - S^T W^T                                              (key halves summed by the pair)
//   O^T     = scale e^gamma (S^T Q^T) + Delta^T P^T                      (each warp: its half of the tokens)
//   S^T     = e^gamma_last S^T + (Delta^T diag(e^(gamma_last - gamma))) K  (each warp: its key half)
// kRecompute (for the backward) stores S^T entering each chunk and Delta instead of O.
template <class E, int K, int kGroups, bool kRecompute>
struct ForwardPass {
  // stage tiles: W, K (, Q), (P,) U; exchanged: the W product, and the Q product's other token half
  using L = SequentialSmem<E, K, kGroups, kRecompute ? 2 : 3, kRecompute ? 0 : 1, kRecompute ? 8 : 12>;
};

template <class E, int K, int kGroups, bool kRecompute>
__global__ void __launch_bounds__(64 * kGroups) state_forward_kernel(Params p) {
  using L = typename ForwardPass<E, K, kGroups, kRecompute>::L;
  constexpr int kThreads = 64 * kGroups, kColumns = 16 * kGroups;
  extern __shared__ __align__(16) char smem[];
  const int n = blockIdx.x, hv = blockIdx.y, v_block = blockIdx.z * kColumns;
  const WarpPlace at(kColumns, K);
  const SequenceChunks chunks(p, n);

  auto issue = [&](int j, int stage) {
    issue_chunk<L, kThreads, !kRecompute, E>(smem, stage, p, chunks[j], hv, v_block, p.u);
  };
  WarpScratch<L, E, K> scratch(smem, at);
  const std::int64_t token_stride = static_cast<std::int64_t>(p.HV) * p.V;
  float state[1][K / 16][4];
  load_state(state, p.h0, p, n, hv, at);

  sequential_pass<L::stages, false>(chunks.count, issue, [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    const auto w_tile = L::key_tile(smem, stage, 0), k_tile = L::key_tile(smem, stage, 1);
    const auto u_tile = L::column_tile(smem, stage);
    const float *gate_in = L::gate_in(smem, stage), *gate_out = L::gate_out(smem, stage);
    if constexpr (kRecompute) store_pairs(state, chunk_state_block<E>(p.states, p, chunks.first + j, hv, at), K);

    // The operand is -S^T, so that the partial products sum onto U^T, which the first warp starts from.
    scratch.key_operand.set(state, -1.f);
    float w_part[1][kChunk / 8][4];
    if (at.half == 0) {
      load_accumulator(w_part, transposed(u_tile), at.v0 - v_block);
    } else {
      zero(w_part);
    }
    warp_mma(w_part, scratch.key_operand, transposed(w_tile), 0, at.k0);
    put_partial<8>(scratch.mine, w_part, 0, at.lane);
    float q_part[1][kChunk / 8][4];
    if constexpr (!kRecompute) {
      zero(q_part);
      warp_mma(q_part, scratch.key_operand, transposed(L::key_tile(smem, stage, 2)), 0, at.k0);
      with_token_half(at.half ^ 1, [&](auto tile) {  // the partner's tokens
        put_partial<4>(scratch.mine + 8 * 32, q_part, decltype(tile)::value, at.lane);
      });
    }
    at.pair_sync();

    float delta[1][kChunk / 8][4];
    sum_partials<8>(delta, w_part, 0, scratch.theirs, at.lane);
    if constexpr (kRecompute) {
      float half_delta[1][kHalfChunk / 8][4];
      with_token_half(at.half, [&](auto tile) { take_tiles(half_delta, delta, decltype(tile)::value); });
      store_token_rows(half_delta, scratch.token_tile, token_half<E>(p.delta, p, info, hv, at), token_stride,
                       tokens_in_half(info, at));
    } else {
      float out[1][kHalfChunk / 8][4];
      with_token_half(at.half, [&](auto tile) {
        sum_partials<4>(out, q_part, decltype(tile)::value, scratch.theirs + 8 * 32, at.lane);
      });
      scale_columns(out, gate_in + kHalfChunk * at.half, -p.scale);
      scratch.chunk_operand.set(delta, 1.f);
      warp_mma(out, scratch.chunk_operand, transposed(L::chunk_tile(smem, stage, 0)), kHalfChunk * at.half);
      store_token_rows(out, scratch.token_tile, token_half<E>(p.o, p, info, hv, at), token_stride,
                       tokens_in_half(info, at));
    }

    const float decay = gate_in[kChunk - 1];
    for_each(state, 0, 0, [&](int, int, float& x) { x *= decay; });
    scratch.chunk_operand.set(delta, 1.f, gate_out);
    warp_mma(state, scratch.chunk_operand, plain(k_tile), at.k0);
  });
  if constexpr (!kRecompute) {
    if (p.ht != nullptr) store_state(state, p.ht, p, n, hv, at);
  }
}

// Backward, chunks in reverse; dS^T is the pair's block of the gradient of the state after the chunk:
//   D^T  = (dS^T K^T) diag(e^(gamma_last - gamma)) + dO^T P      (key halves and P's row halves summed by the pair)
//   dS^T = e^gamma_last dS^T + (dO^T diag(scale e^gamma)) Q - D^T W      (each warp: its key half)
// The gradient after each chunk is stored for the chunk-gradient kernel; what enters chunk 0 is dh0.
template <class E, int K, int kGroups>
struct BackwardPass {
  using L = SequentialSmem<E, K, kGroups, 3, 1, 8>;  // stage tiles: W, K, Q, P, dO; exchanged: D's partial
};

template <class E, int K, int kGroups>
__global__ void __launch_bounds__(64 * kGroups) state_backward_kernel(Params p) {
  using L = typename BackwardPass<E, K, kGroups>::L;
  constexpr int kThreads = 64 * kGroups, kColumns = 16 * kGroups;
  extern __shared__ __align__(16) char smem[];
  const int n = blockIdx.x, hv = blockIdx.y, v_block = blockIdx.z * kColumns;
  const WarpPlace at(kColumns, K);
  const SequenceChunks chunks(p, n);

  auto issue = [&](int j, int stage) {
    issue_chunk<L, kThreads, true, E>(smem, stage, p, chunks[j], hv, v_block, p.d_o);
  };
  WarpScratch<L, E, K> scratch(smem, at);
  float dstate[1][K / 16][4];
  load_state(dstate, p.dht, p, n, hv, at);

  sequential_pass<L::stages, true>(chunks.count, issue, [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    const auto w_tile = L::key_tile(smem, stage, 0), k_tile = L::key_tile(smem, stage, 1);
    const auto q_tile = L::key_tile(smem, stage, 2);
    const auto p_tile = L::chunk_tile(smem, stage, 0);
    const auto do_tile = L::column_tile(smem, stage);
    const float *gate_in = L::gate_in(smem, stage), *gate_out = L::gate_out(smem, stage);
    store_pairs(dstate, chunk_state_block<E>(p.dstates, p, chunks.first + j, hv, at), K);

    scratch.key_operand.set(dstate, 1.f);
    float part[1][kChunk / 8][4];
    zero(part);
    warp_mma(part, scratch.key_operand, transposed(k_tile), 0, at.k0);
    scale_columns(part, gate_out, 1.f);
    const int t0 = kHalfChunk * at.half;  // this warp's rows of P
    warp_mma(part, transposed(do_tile), at.v0 - v_block, plain(p_tile), 0, t0, t0 + kHalfChunk);
    put_partial<8>(scratch.mine, part, 0, at.lane);
    at.pair_sync();
    float ddelta[1][kChunk / 8][4];
    sum_partials<8>(ddelta, part, 0, scratch.theirs, at.lane);
    float half_ddelta[1][kHalfChunk / 8][4];
    with_token_half(at.half, [&](auto tile) { take_tiles(half_ddelta, ddelta, decltype(tile)::value); });
    store_token_rows(half_ddelta, scratch.token_tile, token_half<E>(p.ddelta, p, info, hv, at),
                     static_cast<std::int64_t>(p.HV) * p.V, tokens_in_half(info, at));

    const float decay = gate_in[kChunk - 1];
    for_each(dstate, 0, 0, [&](int, int, float& x) { x *= decay; });
    float do_t[1][kChunk / 8][4];
    load_accumulator(do_t, transposed(do_tile), at.v0 - v_block);
    scratch.chunk_operand.set(do_t, p.scale, gate_in);
    warp_mma(dstate, scratch.chunk_operand, plain(q_tile), at.k0);
    scratch.chunk_operand.set(ddelta, -1.f);
    warp_mma(dstate, scratch.chunk_operand, plain(w_tile), at.k0);
  });
  if (p.dh0 != nullptr) store_state(dstate, p.dh0, p, n, hv, at);
}

// Calls f.template operator()<kGroups>() with the warp pairs per CTA the plan chose; float32 inputs always
// take 2 (shared memory), so their 4-pair kernels are never built.
template <class E, class F>
void with_groups(const Params& p, F&& f) {
  if constexpr (sizeof(E) == 4) {
    f.template operator()<2>();
  } else if (p.warp_pairs == 2) {
    f.template operator()<2>();
  } else {
    f.template operator()<4>();
  }
}

template <class E, int K, int kGroups, bool kRecompute>
void launch_forward(const Params& p, KernelSequence& kernels) {
  const dim3 grid(p.sequences, p.HV, p.V / (16 * kGroups));
  launch<state_forward_kernel<E, K, kGroups, kRecompute>>(
      kRecompute ? "gdn state_forward_kernel (recompute)" : "gdn state_forward_kernel", grid, dim3(64 * kGroups),
      ForwardPass<E, K, kGroups, kRecompute>::L::bytes, kernels);
}

template <class E, int K, int kGroups>
void launch_backward(const Params& p, KernelSequence& kernels) {
  launch<state_backward_kernel<E, K, kGroups>>("gdn state_backward_kernel",
                                              dim3(p.sequences, p.HV, p.V / (16 * kGroups)), dim3(64 * kGroups),
                                              BackwardPass<E, K, kGroups>::L::bytes, kernels);
}

}  // namespace

void launch_state_forward(const Params& p, DType io, bool recompute, KernelSequence& kernels) {
  if (launch_state_forward_hopper(p, io, recompute, kernels)) return;
  dispatch(io, p.K, [&]<class E, int K>() {
    with_groups<E>(p, [&]<int kGroups>() {
      recompute ? launch_forward<E, K, kGroups, true>(p, kernels) : launch_forward<E, K, kGroups, false>(p, kernels);
    });
  });
}

void launch_state_backward(const Params& p, DType io, KernelSequence& kernels) {
  if (launch_state_backward_hopper(p, io, kernels)) return;
  dispatch(io, p.K, [&]<class E, int K>() {
    with_groups<E>(p, [&]<int kGroups>() { launch_backward<E, K, kGroups>(p, kernels); });
  });
}

void launch_backward_state_passes(const Params& p, DType io, KernelSequence& kernels) {
  if (launch_state_passes_paired_hopper(p, io, kernels)) return;
  launch_state_forward(p, io, true, kernels);
  launch_state_backward(p, io, kernels);
}

}  // namespace deltatrain::gdn::cuda
