// The two sequential passes over the chunks of each (sequence, value head): the state recurrence forward
// (gdn-kernels.md section 2) and the state gradient backward (section 3, step 3). One CTA owns 64 columns
// of V; each of its four warps keeps 16 columns of the state transposed (S^T, 16 x K) in float32 registers
// and walks the chunks in order, while the next chunk's tiles arrive by cp.async into the other stage.
// Every product of a step has the warp's own 16 rows as its A operand (S^T, Delta^T, dS^T, D^T), so the
// operand passes from accumulator to product in registers (WarpOperand) and warps never wait on each other
// within a step; only the shared chunk tiles (B operands) come from shared memory.
#include "chunk.cuh"
#include "dispatch.cuh"
#include "launch.h"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kStateThreads = 128;
constexpr int kStateColumns = 64;       // V columns of one CTA
constexpr int kSmemLimit = 227 * 1024;  // per-block opt-in limit of sm_80 and sm_90

// Shared memory of a sequential pass: per stage `kKeyTiles` chunk tiles 64 x K, `kChunkTiles` 64 x 64 and
// the chunk's two gate vectors; per warp the staging tile of its token-major stores and the shared backing
// of its two operands (float32 only). Two stages when they fit.
template <class E, int K, int kKeyTiles, int kChunkTiles>
struct SequentialSmem {
  using KeyTile = Tile<E, kChunk, K>;
  using ChunkTile = Tile<E, kChunk, kChunk>;
  using TokenTile = Tile<E, kChunk, 16>;
  static constexpr int gates_bytes = 2 * kChunk * 4;
  static constexpr int stage_bytes = kKeyTiles * KeyTile::kBytes + kChunkTiles * ChunkTile::kBytes + gates_bytes;
  static constexpr int key_operand_bytes = WarpOperand<E, K>::kSmemBytes;
  static constexpr int warp_bytes = TokenTile::kBytes + key_operand_bytes + WarpOperand<E, kChunk>::kSmemBytes;
  static constexpr int stages = 2 * stage_bytes + 4 * warp_bytes <= kSmemLimit ? 2 : 1;
  static constexpr int bytes = stages * stage_bytes + 4 * warp_bytes;
  static_assert(bytes <= kSmemLimit, "a sequential pass needs more shared memory than an SM has");

  __device__ static KeyTile key_tile(char* smem, int stage, int i) {
    return {smem_at<E>(smem, stage * stage_bytes + i * KeyTile::kBytes)};
  }
  __device__ static ChunkTile chunk_tile(char* smem, int stage, int i) {
    return {smem_at<E>(smem, stage * stage_bytes + kKeyTiles * KeyTile::kBytes + i * ChunkTile::kBytes)};
  }
  __device__ static float* gate_in(char* smem, int stage) {
    return smem_at<float>(smem, stage * stage_bytes + kKeyTiles * KeyTile::kBytes + kChunkTiles * ChunkTile::kBytes);
  }
  __device__ static float* gate_out(char* smem, int stage) { return gate_in(smem, stage) + kChunk; }
  __device__ static TokenTile token_tile(char* smem, int warp) {
    return {smem_at<E>(smem, stages * stage_bytes + warp * warp_bytes)};
  }
  __device__ static char* key_operand(char* smem, int warp) {
    return smem + stages * stage_bytes + warp * warp_bytes + TokenTile::kBytes;
  }
  __device__ static char* chunk_operand(char* smem, int warp) { return key_operand(smem, warp) + key_operand_bytes; }
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

// The warp's 16 x K block of a [N, HV, K, V] float32 state (zero when absent), as S^T in acc.
template <int NT>
__device__ __forceinline__ void load_state(float (&acc)[1][NT][4], const float* src, const Params& p, int n, int hv,
                                           int v0) {
  const std::int64_t base = (static_cast<std::int64_t>(n) * p.HV + hv) * p.K * p.V;
  for_each(acc, 0, 0, [&](int r, int c, float& x) {
    x = src == nullptr ? 0.f : src[base + static_cast<std::int64_t>(c) * p.V + v0 + r];
  });
}
template <int NT>
__device__ __forceinline__ void store_state(float (&acc)[1][NT][4], float* dst, const Params& p, int n, int hv, int v0) {
  const std::int64_t base = (static_cast<std::int64_t>(n) * p.HV + hv) * p.K * p.V;
  for_each(acc, 0, 0, [&](int r, int c, float& x) { dst[base + static_cast<std::int64_t>(c) * p.V + v0 + r] = x; });
}

// The warp's rows of a per-chunk [chunks, HV, V, K] tensor of states.
template <class E>
__device__ __forceinline__ E* chunk_state_rows(void* base, const Params& p, std::int64_t chunk, int hv, int v0) {
  return static_cast<E*>(base) + ((chunk * p.HV + hv) * p.V + v0) * p.K;
}

// Forward: per chunk, with S^T the warp's state block entering it,
//   Delta^T = U^T - S^T W^T
//   O^T     = scale e^gamma (S^T Q^T) + Delta^T P^T                (kRecompute: not computed)
//   S^T     = e^gamma_last S^T + (Delta^T diag(e^(gamma_last - gamma))) K
// kRecompute (for the backward) stores S^T entering each chunk and Delta instead of O.
template <class E, int K, bool kRecompute>
__global__ void __launch_bounds__(kStateThreads) state_forward_kernel(Params p) {
  // stage tiles: W, K (, Q) and U (, P)
  using L = SequentialSmem<E, K, kRecompute ? 2 : 3, kRecompute ? 1 : 2>;
  extern __shared__ __align__(16) char smem[];
  const int n = blockIdx.x, hv = blockIdx.y, v_block = blockIdx.z * kStateColumns, h = hv / p.group;
  const int tid = threadIdx.x, warp = tid / 32, v0 = v_block + 16 * warp;
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
    load_gates_async(p, L::gate_in(smem, stage), L::gate_out(smem, stage), hv, info, tid);
  };

  const auto token_tile = L::token_tile(smem, warp);
  WarpOperand<E, K> s_operand(L::key_operand(smem, warp));
  WarpOperand<E, kChunk> delta_operand(L::chunk_operand(smem, warp));
  const std::int64_t token_stride = static_cast<std::int64_t>(p.HV) * p.V;
  float state[1][K / 8][4];
  load_state(state, p.h0, p, n, hv, v0);

  sequential_pass<L::stages, false>(chunks.count, issue, [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    const auto w_tile = L::key_tile(smem, stage, 0), k_tile = L::key_tile(smem, stage, 1);
    const auto u_tile = L::chunk_tile(smem, stage, 0);
    const float *gate_in = L::gate_in(smem, stage), *gate_out = L::gate_out(smem, stage);
    E* const token_rows = static_cast<E*>(kRecompute ? p.delta : p.o) +
                          (static_cast<std::int64_t>(info.start) * p.HV + hv) * p.V + v0;
    if constexpr (kRecompute) store_pairs(state, chunk_state_rows<E>(p.states, p, chunks.first + j, hv, v0), K);

    // The operand is -S^T, so that Delta^T = U^T + (-S^T) W^T accumulates onto U^T as loaded.
    s_operand.set(state, -1.f);
    float delta[1][kChunk / 8][4];
    load_accumulator(delta, transposed(u_tile), 16 * warp);
    warp_mma(delta, s_operand, transposed(w_tile), 0);
    if constexpr (kRecompute) {
      store_token_rows(delta, token_tile, token_rows, token_stride, info.length, 1.f);
    } else {
      const auto q_tile = L::key_tile(smem, stage, 2);
      const auto p_tile = L::chunk_tile(smem, stage, 1);
      float out[1][kChunk / 8][4];
      zero(out);
      warp_mma(out, s_operand, transposed(q_tile), 0);
      scale_columns(out, gate_in, -p.scale);
      delta_operand.set(delta, 1.f);
      warp_mma(out, delta_operand, transposed(p_tile), 0);
      store_token_rows(out, token_tile, token_rows, token_stride, info.length, 1.f);
    }

    const float decay = gate_in[kChunk - 1];
    for_each(state, 0, 0, [&](int, int, float& x) { x *= decay; });
    delta_operand.set(delta, 1.f, gate_out);
    warp_mma(state, delta_operand, plain(k_tile), 0);
  });
  if constexpr (!kRecompute) {
    if (p.ht != nullptr) store_state(state, p.ht, p, n, hv, v0);
  }
}

// Backward, chunks in reverse; dS^T is the warp's block of the gradient of the state after the chunk:
//   D^T  = (dS^T K^T) diag(e^(gamma_last - gamma)) + dO^T P                (D = dDelta, stored)
//   dS^T = e^gamma_last dS^T + (dO^T diag(scale e^gamma)) Q - D^T W      (the gradient entering the chunk)
// The gradient after each chunk is stored for the chunk-gradient kernel; what enters chunk 0 is dh0.
template <class E, int K>
__global__ void __launch_bounds__(kStateThreads) state_backward_kernel(Params p) {
  using L = SequentialSmem<E, K, 3, 2>;  // stage tiles: W, K, Q and P, dO
  extern __shared__ __align__(16) char smem[];
  const int n = blockIdx.x, hv = blockIdx.y, v_block = blockIdx.z * kStateColumns, h = hv / p.group;
  const int tid = threadIdx.x, warp = tid / 32, v0 = v_block + 16 * warp;
  const SequenceChunks chunks(p, n);

  auto issue = [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    load_chunk_rows<kStateThreads>(L::key_tile(smem, stage, 0), p.w, p.HV, hv, K, 0, info, tid);
    load_chunk_rows<kStateThreads>(L::key_tile(smem, stage, 1), keys<E>(p), p.H, h, K, 0, info, tid);
    load_chunk_rows<kStateThreads>(L::key_tile(smem, stage, 2), queries<E>(p), p.H, h, K, 0, info, tid);
    load_chunk_rows<kStateThreads>(L::chunk_tile(smem, stage, 0), p.p, p.HV, hv, kChunk, 0, info, tid);
    load_chunk_rows<kStateThreads>(L::chunk_tile(smem, stage, 1), p.d_o, p.HV, hv, p.V, v_block, info, tid);
    load_gates_async(p, L::gate_in(smem, stage), L::gate_out(smem, stage), hv, info, tid);
  };

  const auto token_tile = L::token_tile(smem, warp);
  WarpOperand<E, K> ds_operand(L::key_operand(smem, warp));
  WarpOperand<E, kChunk> chunk_operand(L::chunk_operand(smem, warp));
  float dstate[1][K / 8][4];
  load_state(dstate, p.dht, p, n, hv, v0);

  sequential_pass<L::stages, true>(chunks.count, issue, [&](int j, int stage) {
    const ChunkInfo info = chunks[j];
    const auto w_tile = L::key_tile(smem, stage, 0), k_tile = L::key_tile(smem, stage, 1);
    const auto q_tile = L::key_tile(smem, stage, 2);
    const auto p_tile = L::chunk_tile(smem, stage, 0), do_tile = L::chunk_tile(smem, stage, 1);
    const float *gate_in = L::gate_in(smem, stage), *gate_out = L::gate_out(smem, stage);
    store_pairs(dstate, chunk_state_rows<E>(p.dstates, p, chunks.first + j, hv, v0), K);

    ds_operand.set(dstate, 1.f);
    float ddelta[1][kChunk / 8][4];
    zero(ddelta);
    warp_mma(ddelta, ds_operand, transposed(k_tile), 0);
    scale_columns(ddelta, gate_out, 1.f);
    warp_mma(ddelta, transposed(do_tile), 16 * warp, plain(p_tile), 0, 0, kChunk);
    store_token_rows(ddelta, token_tile,
                     static_cast<E*>(p.ddelta) + (static_cast<std::int64_t>(info.start) * p.HV + hv) * p.V + v0,
                     static_cast<std::int64_t>(p.HV) * p.V, info.length, 1.f);

    const float decay = gate_in[kChunk - 1];
    for_each(dstate, 0, 0, [&](int, int, float& x) { x *= decay; });
    float do_t[1][kChunk / 8][4];
    load_accumulator(do_t, transposed(do_tile), 16 * warp);
    chunk_operand.set(do_t, p.scale, gate_in);
    warp_mma(dstate, chunk_operand, plain(q_tile), 0);
    chunk_operand.set(ddelta, -1.f);
    warp_mma(dstate, chunk_operand, plain(w_tile), 0);
  });
  if (p.dh0 != nullptr) store_state(dstate, p.dh0, p, n, hv, v0);
}

}  // namespace

void launch_state_forward(const Params& p, DType io, bool recompute, cudaStream_t stream) {
  dispatch(io, p.K, [&]<class E, int K>() {
    const dim3 grid(p.sequences, p.HV, p.V / kStateColumns);
    if (recompute) {
      launch<state_forward_kernel<E, K, true>>("gdn state_forward_kernel (recompute)", grid, dim3(kStateThreads),
             SequentialSmem<E, K, 2, 1>::bytes, stream, p);
    } else {
      launch<state_forward_kernel<E, K, false>>("gdn state_forward_kernel", grid, dim3(kStateThreads),
             SequentialSmem<E, K, 3, 2>::bytes, stream, p);
    }
  });
}

void launch_state_backward(const Params& p, DType io, cudaStream_t stream) {
  dispatch(io, p.K, [&]<class E, int K>() {
    launch<state_backward_kernel<E, K>>("gdn state_backward_kernel", dim3(p.sequences, p.HV, p.V / kStateColumns),
           dim3(kStateThreads), SequentialSmem<E, K, 3, 2>::bytes, stream, p);
  });
}

}  // namespace deltatrain::gdn::cuda
