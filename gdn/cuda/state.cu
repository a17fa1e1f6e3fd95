// The two sequential passes over the chunks of each (sequence, value head): the state recurrence forward
// (gdn-kernels.md section 2) and the state gradient backward (section 3, step 3). One CTA owns 64 columns
// of V; each of its four warps keeps 16 columns of the state transposed (S^T, 16 x K) in float32 registers
// and walks the chunks in order, while the next chunk's tiles arrive by cp.async into the other stage.
#include "chunk.cuh"
#include "dispatch.cuh"
#include "launch.h"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kStateThreads = 128;
constexpr int kStateColumns = 64;       // V columns of one CTA
constexpr int kSmemLimit = 227 * 1024;  // per-block opt-in limit of sm_80 and sm_90

// Shared memory of a sequential pass: `kKeyTiles` chunk tiles 64 x K and `kChunkTiles` 64 x 64 per stage,
// plus per warp `kWarpTiles` 16 x 64 tiles and one 16 x K tile. Two stages when they fit.
template <class E, int K, int kKeyTiles, int kChunkTiles, int kWarpTiles>
struct SequentialSmem {
  using KeyTile = Tile<E, kChunk, K>;
  using ChunkTile = Tile<E, kChunk, kChunk>;
  using WarpKeyTile = Tile<E, 16, K>;
  using WarpChunkTile = Tile<E, 16, kChunk>;
  static constexpr int stage_bytes = kKeyTiles * KeyTile::kBytes + kChunkTiles * ChunkTile::kBytes + kChunk * 4;
  static constexpr int warp_bytes = WarpKeyTile::kBytes + kWarpTiles * WarpChunkTile::kBytes;
  static constexpr int stages = 2 * stage_bytes + 4 * warp_bytes <= kSmemLimit ? 2 : 1;
  static constexpr int bytes = stages * stage_bytes + 4 * warp_bytes;
  static_assert(bytes <= kSmemLimit, "a sequential pass needs more shared memory than an SM has");

  __device__ static KeyTile key_tile(char* smem, int stage, int i) {
    return {smem_at<E>(smem, stage * stage_bytes + i * KeyTile::kBytes)};
  }
  __device__ static ChunkTile chunk_tile(char* smem, int stage, int i) {
    return {smem_at<E>(smem, stage * stage_bytes + kKeyTiles * KeyTile::kBytes + i * ChunkTile::kBytes)};
  }
  __device__ static float* gamma(char* smem, int stage) {
    return smem_at<float>(smem, stage * stage_bytes + kKeyTiles * KeyTile::kBytes + kChunkTiles * ChunkTile::kBytes);
  }
  __device__ static WarpKeyTile warp_key_tile(char* smem, int warp) {
    return {smem_at<E>(smem, stages * stage_bytes + warp * warp_bytes)};
  }
  __device__ static WarpChunkTile warp_chunk_tile(char* smem, int warp, int i) {
    return {smem_at<E>(smem, stages * stage_bytes + warp * warp_bytes + WarpKeyTile::kBytes + i * WarpChunkTile::kBytes)};
  }
};

// The chunks of sequence n: contiguous, 64 tokens each but the last. Computed rather than read from the
// chunk table so that no global load sits on the sequential path.
struct SequenceChunks {
  std::int64_t begin, end;
  int first;  // global index of the first chunk (per-chunk workspace rows)
  int count;
  __device__ SequenceChunks(const Params& p, int n)
      : begin(sequence_start(p, n)), end(sequence_start(p, n + 1)), first(p.sequence_chunks[n]),
        count(static_cast<int>((end - begin + kChunk - 1) / kChunk)) {}
  __device__ ChunkInfo operator[](int j) const {
    const std::int64_t start = begin + static_cast<std::int64_t>(j) * kChunk;
    return ChunkInfo{static_cast<std::int32_t>(start), static_cast<std::int32_t>(end - start < kChunk ? end - start : kChunk),
                     0, 0};
  }
};

// Walks the chunks of a sequence (in order, or last to first) with `stages` chunks in flight:
// issue(j, stage) starts chunk j's copies into a stage, body(j, stage) consumes them once they landed.
template <int kStages, bool kReverse, class Issue, class Body>
__device__ __forceinline__ void sequential_pass(int count, Issue&& issue, Body&& body) {
  auto chunk = [&](int i) { return kReverse ? count - 1 - i : i; };
  for (int s = 0; s < kStages; ++s) {
    if (s < count) issue(chunk(s), s);
    cp_async_commit();
  }
#pragma unroll 1
  for (int i = 0; i < count; ++i) {
    const int stage = i % kStages;
    cp_async_wait<kStages - 1>();
    __syncthreads();
    body(chunk(i), stage);
    __syncthreads();  // the stage is free
    if (i + kStages < count) issue(chunk(i + kStages), stage);
    cp_async_commit();
  }
}

// The 16 x K state block of this warp in a [N, HV, K, V] float32 tensor (zero when absent), read into acc
// and into the warp's operand copy.
template <int NT, class TileT>
__device__ __forceinline__ void load_state(float (&acc)[1][NT][4], TileT copy, const float* src, const Params& p, int n,
                                           int hv, int v0) {
  const std::int64_t base = (static_cast<std::int64_t>(n) * p.HV + hv) * p.K * p.V;
  for_each(acc, 0, 0, [&](int r, int c, float& x) {
    x = src == nullptr ? 0.f : src[base + static_cast<std::int64_t>(c) * p.V + v0 + r];
  });
  store(acc, copy, 0, 0);
}
template <int NT>
__device__ __forceinline__ void store_state(float (&acc)[1][NT][4], float* dst, const Params& p, int n, int hv, int v0) {
  const std::int64_t base = (static_cast<std::int64_t>(n) * p.HV + hv) * p.K * p.V;
  for_each(acc, 0, 0, [&](int r, int c, float& x) { dst[base + static_cast<std::int64_t>(c) * p.V + v0 + r] = x; });
}

// Forward: per chunk, with S^T the warp's state block entering it,
//   Delta^T = U^T - S^T W^T
//   O^T     = scale e^gamma (S^T Q^T) + Delta^T P^T                (kRecompute: not computed)
//   S^T     = e^gamma_last S^T + (Delta^T diag(e^(gamma_last - gamma))) K
// kRecompute (for the backward) stores S^T entering each chunk and Delta instead of O.
template <class E, int K, bool kRecompute>
__global__ void __launch_bounds__(kStateThreads) state_forward_kernel(Params p) {
  // stage tiles: W, K (, Q) and U (, P)
  using L = SequentialSmem<E, K, kRecompute ? 2 : 3, kRecompute ? 1 : 2, kRecompute ? 2 : 3>;
  extern __shared__ __align__(16) char smem[];
  const int n = blockIdx.x, hv = blockIdx.y, v_block = blockIdx.z * kStateColumns, h = hv / p.group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31, v0 = v_block + 16 * warp;
  const SequenceChunks chunks(p, n);

  auto issue = [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    load_chunk_rows<kStateThreads>(L::key_tile(smem, stage, 0), p.w, p.HV, hv, K, 0, info, tid);
    load_chunk_rows<kStateThreads>(L::key_tile(smem, stage, 1), keys<E>(p), p.H, h, K, 0, info, tid);
    load_chunk_rows<kStateThreads>(L::chunk_tile(smem, stage, 0), p.u, p.HV, hv, p.V, v_block, info, tid);
    if constexpr (!kRecompute) {
      load_chunk_rows<kStateThreads>(L::key_tile(smem, stage, 2), queries<E>(p), p.H, h, K, 0, info, tid);
      load_chunk_rows<kStateThreads>(L::chunk_tile(smem, stage, 1), p.p, p.HV, hv, kChunk, 0, info, tid);
    }
    load_gamma_async(p, L::gamma(smem, stage), hv, info, tid);
  };

  const auto s_tile = L::warp_key_tile(smem, warp);
  const auto delta_tile = L::warp_chunk_tile(smem, warp, 0);
  const auto delta_decayed_tile = L::warp_chunk_tile(smem, warp, 1);
  float state[1][K / 8][4];
  load_state(state, s_tile, p.h0, p, n, hv, v0);

  sequential_pass<L::stages, false>(chunks.count, issue, [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    const auto w_tile = L::key_tile(smem, stage, 0), k_tile = L::key_tile(smem, stage, 1);
    const auto u_tile = L::chunk_tile(smem, stage, 0);
    const float* gamma = L::gamma(smem, stage);
    const float gamma_last = gamma[kChunk - 1];
    if constexpr (kRecompute) {
      const std::int64_t chunk = chunks.first + j;
      store_rows<32>(s_tile, static_cast<E*>(p.states) + ((chunk * p.HV + hv) * p.V + v0) * K,
                     K, 16, lane);
    }

    float delta[1][8][4];
    zero(delta);
    warp_mma(delta, plain(s_tile), 0, transposed(w_tile), 0, 0, K);
    for_each(delta, 0, 0, [&](int r, int c, float& x) {
      x = to_float(u_tile(c, 16 * warp + r)) - x;
      delta_tile(r, c) = from_float<E>(x);
      delta_decayed_tile(r, c) = from_float<E>(x * __expf(gamma_last - gamma[c]));
    });
    __syncwarp();
    const std::int64_t token_row = (static_cast<std::int64_t>(info.start) * p.HV + hv) * p.V + v0;
    if constexpr (kRecompute) {
      store_columns(delta_tile, static_cast<E*>(p.delta) + token_row, static_cast<std::int64_t>(p.HV) * p.V, info.length);
    } else {
      const auto q_tile = L::key_tile(smem, stage, 2);
      const auto p_tile = L::chunk_tile(smem, stage, 1);
      const auto o_tile = L::warp_chunk_tile(smem, warp, 2);
      float out[1][8][4];
      zero(out);
      warp_mma(out, plain(s_tile), 0, transposed(q_tile), 0, 0, K);
      for_each(out, 0, 0, [&](int, int c, float& x) { x *= p.scale * __expf(gamma[c]); });
      warp_mma(out, plain(delta_tile), 0, transposed(p_tile), 0, 0, kChunk);
      store(out, o_tile, 0, 0);
      __syncwarp();
      store_columns(o_tile, static_cast<E*>(p.o) + token_row, static_cast<std::int64_t>(p.HV) * p.V, info.length);
    }

    const float decay = __expf(gamma_last);
    for_each(state, 0, 0, [&](int, int, float& x) { x *= decay; });
    warp_mma(state, plain(delta_decayed_tile), 0, plain(k_tile), 0, 0, kChunk);
    __syncwarp();  // every lane has read the old S^T and Delta^T
    store(state, s_tile, 0, 0);
  });
  if constexpr (!kRecompute) {
    if (p.ht != nullptr) store_state(state, p.ht, p, n, hv, v0);
  }
}

// Backward, chunks in reverse; dS^T is the warp's block of the gradient of the state after the chunk:
//   D^T  = (dS^T K^T) diag(e^(gamma_last - gamma)) + dO^T P                (D = dDelta, stored)
//   dS^T = e^gamma_last dS^T + (dO^T scale e^gamma) Q - D^T W            (the gradient entering the chunk)
// The gradient after each chunk is stored for the chunk-gradient kernel; what enters chunk 0 is dh0.
template <class E, int K>
__global__ void __launch_bounds__(kStateThreads) state_backward_kernel(Params p) {
  // stage tiles: W, K, Q and P, dO; warp tiles: -D^T, scaled dO^T
  using L = SequentialSmem<E, K, 3, 2, 2>;
  extern __shared__ __align__(16) char smem[];
  const int n = blockIdx.x, hv = blockIdx.y, v_block = blockIdx.z * kStateColumns, h = hv / p.group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31, v0 = v_block + 16 * warp;
  const SequenceChunks chunks(p, n);

  auto issue = [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    load_chunk_rows<kStateThreads>(L::key_tile(smem, stage, 0), p.w, p.HV, hv, K, 0, info, tid);
    load_chunk_rows<kStateThreads>(L::key_tile(smem, stage, 1), keys<E>(p), p.H, h, K, 0, info, tid);
    load_chunk_rows<kStateThreads>(L::key_tile(smem, stage, 2), queries<E>(p), p.H, h, K, 0, info, tid);
    load_chunk_rows<kStateThreads>(L::chunk_tile(smem, stage, 0), p.p, p.HV, hv, kChunk, 0, info, tid);
    load_chunk_rows<kStateThreads>(L::chunk_tile(smem, stage, 1), p.d_o, p.HV, hv, p.V, v_block, info, tid);
    load_gamma_async(p, L::gamma(smem, stage), hv, info, tid);
  };

  const auto ds_tile = L::warp_key_tile(smem, warp);
  const auto neg_ddelta_tile = L::warp_chunk_tile(smem, warp, 0);
  const auto do_scaled_tile = L::warp_chunk_tile(smem, warp, 1);
  float dstate[1][K / 8][4];
  load_state(dstate, ds_tile, p.dht, p, n, hv, v0);

  sequential_pass<L::stages, true>(chunks.count, issue, [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    const std::int64_t chunk = chunks.first + j;
    const auto w_tile = L::key_tile(smem, stage, 0), k_tile = L::key_tile(smem, stage, 1);
    const auto q_tile = L::key_tile(smem, stage, 2);
    const auto p_tile = L::chunk_tile(smem, stage, 0), do_tile = L::chunk_tile(smem, stage, 1);
    const float* gamma = L::gamma(smem, stage);
    const float gamma_last = gamma[kChunk - 1];
    store_rows<32>(ds_tile, static_cast<E*>(p.dstates) + ((chunk * p.HV + hv) * p.V + v0) * K,
                   K, 16, lane);

    float ddelta[1][8][4];
    zero(ddelta);
    warp_mma(ddelta, plain(ds_tile), 0, transposed(k_tile), 0, 0, K);
    for_each(ddelta, 0, 0, [&](int, int c, float& x) { x *= __expf(gamma_last - gamma[c]); });
    warp_mma(ddelta, transposed(do_tile), 16 * warp, plain(p_tile), 0, 0, kChunk);
    for_each(ddelta, 0, 0, [&](int r, int c, float& x) { neg_ddelta_tile(r, c) = from_float<E>(-x); });
    for (int i = lane; i < 16 * kChunk; i += 32) {
      const int r = i / kChunk, c = i % kChunk;
      do_scaled_tile(r, c) = from_float<E>(to_float(do_tile(c, 16 * warp + r)) * p.scale * __expf(gamma[c]));
    }
    __syncwarp();
    store_columns(neg_ddelta_tile, static_cast<E*>(p.ddelta) + (static_cast<std::int64_t>(info.start) * p.HV + hv) * p.V + v0,
                  static_cast<std::int64_t>(p.HV) * p.V, info.length, -1.f);

    const float decay = __expf(gamma_last);
    for_each(dstate, 0, 0, [&](int, int, float& x) { x *= decay; });
    warp_mma(dstate, plain(do_scaled_tile), 0, plain(q_tile), 0, 0, kChunk);
    warp_mma(dstate, plain(neg_ddelta_tile), 0, plain(w_tile), 0, 0, kChunk);
    __syncwarp();
    store(dstate, ds_tile, 0, 0);
  });
  if (p.dh0 != nullptr) store_state(dstate, p.dh0, p, n, hv, v0);
}

}  // namespace

void launch_state_forward(const Params& p, DType io, bool recompute, cudaStream_t stream) {
  dispatch(io, p.K, [&]<class E, int K>() {
    const dim3 grid(p.sequences, p.HV, p.V / kStateColumns);
    if (recompute) {
      launch<state_forward_kernel<E, K, true>>("gdn state_forward_kernel (recompute)", grid, dim3(kStateThreads),
             SequentialSmem<E, K, 2, 1, 2>::bytes, stream, p);
    } else {
      launch<state_forward_kernel<E, K, false>>("gdn state_forward_kernel", grid, dim3(kStateThreads),
             SequentialSmem<E, K, 3, 2, 3>::bytes, stream, p);
    }
  });
}

void launch_state_backward(const Params& p, DType io, cudaStream_t stream) {
  dispatch(io, p.K, [&]<class E, int K>() {
    launch<state_backward_kernel<E, K>>("gdn state_backward_kernel", dim3(p.sequences, p.HV, p.V / kStateColumns),
           dim3(kStateThreads), SequentialSmem<E, K, 3, 2, 2>::bytes, stream, p);
  });
}

}  // namespace deltatrain::gdn::cuda
